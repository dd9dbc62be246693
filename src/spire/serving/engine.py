"""Continuous batching with lossless speculative decoding: the engine behind ``spire serve``.

The static-batch loop of :mod:`spire.speculative` starts every row together and runs until the last one ends.
Here rows are **slots**: the target cache is ``max_running`` rows of ``max_len`` positions, and the draft is
started once on that batch (:meth:`~spire.drafts.base.Draft.start`). A request takes a free slot between rounds,
and gives it back as soon as it finishes (or is aborted):

- :meth:`Engine.add_request` queues a request (its own sampling settings, generator, budget, stop strings);
- :meth:`Engine.step` admits waiting requests into free slots (the draft's rows restarted with
  :meth:`~spire.drafts.base.Draft.restart_rows` so a slot's new request never sees the previous one's KV, memory
  or n-gram context), prefills their prompts (together; with ``prefill_chunk``, at most that many prompt tokens
  per step, so a long prompt is prefilled over several steps while the other requests keep decoding), then runs
  **one round** over the batch: draft k tokens per row,
  verify them in one target forward over k + 1 positions, accept a prefix per row (greedy rows by argmax,
  sampled rows by rejection sampling with their own transform and generator), commit each running row's output
  tokens (cut by its budget, EOS and stop strings, :func:`spire.speculative.cut_output`);
- :meth:`Engine.abort` ends a request at the next step and frees its slot.

With a k policy (:mod:`spire.serving.policy`), each round drafts the k the policy picks for the running requests
(0..k): k = 0 is an AD round, in which the draft still observes what the target committed.

Lossless per request: a greedy request's tokens are its own single-request AD output
(``spire.speculative.generate(target, [prompt], n)``) whatever else runs beside it, and a sampled request's
tokens are distributed as the target's (the verification of :mod:`spire.verification`, row by row).

A round computes the rows [0, w) where w is one past the highest occupied slot (requests take the lowest free
slot; the target cache is narrowed to a view, the draft with :meth:`~spire.drafts.base.Draft.use_rows`, or all
rows for a draft that cannot): a free slot below w runs a dummy token at positions 0..k, which the next request
in that slot overwrites (its prefill, then its rounds) before anything reads it. A slot whose prompt is being
prefilled in chunks runs the round too, as a dummy at its next unprefilled position (its pending token is the
next prompt token): the round writes only positions its next chunk (or, past the prompt, its first round)
overwrites before any query of the row reads them, as a rejected draft token's entries are.
The cache invariant of :mod:`spire.speculative` holds per slot: a row's committed tokens are at positions < n - 1,
its pending token is the next round's first input.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from spire.drafts.base import Draft
from spire.errors import ConfigError
from spire.kv_cache import KVCache
from spire.model import ForwardOutput, Transformer
from spire.serving.policy import KPolicy
from spire.sampling import (LogitsProcessing, SamplingParams, TokenHistory, logprobs_from_logits,
                            probs_from_logits, process_logits, sample)
from spire.speculative import GenerationResult, Prefilled, StopStrings, cache_length, cut_output, prefill
from spire.timing import Stopwatch
from spire.verification import output_tokens, verify, verify_greedy


@dataclass(frozen=True)
class RequestParams:
    """One request's settings. max_tokens: new tokens at most (>= 1); temperature 0 = greedy; top_k 0, top_p 1 and
    min_p 0 = off (:class:`~spire.sampling.SamplingParams`); seed: its own generator's seed (None: a fresh random
    one); stop: stop strings (the request ends with the token that completes one); ignore_eos: do not stop at EOS.

    The logits processing of :class:`~spire.sampling.LogitsProcessing`, applied to the target's and the draft's
    logits alike (greedy requests take the argmax of the processed logits): stop_token_ids end the request like
    EOS (also with ignore_eos); min_tokens: EOS and stop_token_ids are banned, and stop strings not checked, until
    that many tokens were generated; logit_bias ((token id, bias) pairs), repetition_penalty, presence_penalty,
    frequency_penalty.

    logprobs: None, or n >= 0: each emitted token's log-probability under the target's processed distribution
    (:func:`~spire.sampling.logprobs_from_logits`) and the n most likely tokens there
    (:attr:`RequestOutput.logprobs`). prompt_logprobs: the same for every prompt token after the first (from the
    prefill), given once, with the request's first output. Raises ConfigError for impossible values."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ConfigError(f"{name} must be None or an integer >= 0, got {v!r}")
        self.sampling()  # validates temperature, top_k, top_p, min_p
        self.processing(())  # validates the penalties, min_tokens, logit_bias

    def sampling(self) -> SamplingParams:
        return SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p), float(self.min_p))

    def processing(self, eos_ids) -> LogitsProcessing:
        """The logits processing, min_tokens banning ``eos_ids`` (unless ignore_eos) and the stop token ids."""
        banned = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))
        return LogitsProcessing(tuple(self.logit_bias), int(self.min_tokens), tuple(sorted(banned)),
                                float(self.repetition_penalty), float(self.presence_penalty),
                                float(self.frequency_penalty))


@dataclass
class RequestOutput:
    """What one :meth:`Engine.step` gives a request: its new tokens this step (after the cut), whether it
    finished, with finish_reason "stop" (EOS or a stop string), "length" (max_tokens) or "abort", and how many of
    the round's k draft tokens verification accepted (None when it ran no round).

    stop_token: the EOS or stop token id that ended it (the last of new_tokens), else None. logprobs (when the
    request asked): one (logprob, [(token id, logprob)] of the top n) per new token. prompt_logprobs (when asked, in
    the request's first output): the same for prompt tokens 1..P-1."""

    request_id: int
    new_tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    accepted: int | None = None
    stop_token: int | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class EngineStats:
    """Counters since start. rounds: engine rounds run; row_rounds: rounds summed over the requests that ran in
    them; prompt_tokens / generated_tokens: tokens in and out; accepted: accepted[i] counts row-rounds that
    accepted i draft tokens (i = 0..k; AD rounds not counted); drafted[j - 1]: row-rounds that drafted a token at
    position j (j = 1..k); rounds_by_k[i]: rounds that drafted i tokens per row (i = 0: AD); finished: requests
    ended, by reason."""

    k: int
    rounds: int = 0
    row_rounds: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    rounds_by_k: list[int] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.accepted = self.accepted or [0] * (self.k + 1)
        self.drafted = self.drafted or [0] * self.k
        self.rounds_by_k = self.rounds_by_k or [0] * (self.k + 1)

    @property
    def tau(self) -> float:
        """Tokens per round per request (bonus included): generated / row-rounds."""
        return self.generated_tokens / max(1, self.row_rounds)

    def acceptance(self) -> list[float]:
        """Acceptance by drafted position: element j-1 is the share of the row-rounds that drafted a token at
        position j (j = 1..k) that accepted it, i.e. accepted at least j."""
        return [sum(self.accepted[j:]) / max(1, self.drafted[j - 1]) for j in range(1, self.k + 1)]


@dataclass
class RoundTrace:
    """What :attr:`Engine.round_hook` sees of one SD round over slots [0, S): rows: (slot, sampling, tokens it may still
    emit) of each running request (other rows are dummies); pos0 (S,): each slot's pending position (the first drafted token is at
    pos0 + 1); draft_tokens (S, k); draft_logits (S, k, V) float32 (the draft's raw logits, before any sampling
    transform); target_logits (S, k + 1, V); n_accepted (S,)."""

    rows: list[tuple[int, SamplingParams, int]]
    pos0: torch.Tensor
    draft_tokens: torch.Tensor
    draft_logits: torch.Tensor
    target_logits: torch.Tensor
    n_accepted: torch.Tensor


class _Request:
    """A request's state: its prompt, settings, generator, stop strings, emitted tokens and slot (None while it
    waits)."""

    def __init__(self, rid: int, prompt: list[int], params: RequestParams, stop: StopStrings | None,
                 eos_ids=(), vocab: int = 0, device: torch.device | str = "cpu") -> None:
        self.id, self.prompt, self.params, self.stop = rid, prompt, params, stop
        self.sampling = params.sampling()
        self.proc = params.processing(eos_ids)
        self.history = TokenHistory(prompt, vocab, device) if self.proc.penalized else None
        self.prompt_lp: list | None = [] if params.prompt_logprobs is not None else None
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(params.seed))
        self.emitted: list[int] = []
        self.slot: int | None = None
        self.prefilled = 0  # prompt tokens in the slot's cache (the prompt but its last token, once prefilled)

    @property
    def special(self) -> bool:
        """Whether its rows need more than the raw argmax: it samples, processes logits, or wants logprobs."""
        return not self.sampling.greedy or self.proc.active or self.params.logprobs is not None

    def logits(self, logits: torch.Tensor, drafted: list[int], first: int) -> torch.Tensor:
        """(T, V) logits at T positions after the tokens so far and ``drafted[: first + t]`` -> processed."""
        if not self.proc.active:
            return logits
        return process_logits(logits, self.proc, self.history, len(self.emitted), drafted, first)

    @property
    def prefilling(self) -> bool:
        """Whether it holds a slot whose prompt is not yet prefilled (it runs no round of its own yet)."""
        return self.slot is not None and self.prefilled < len(self.prompt) - 1


class Engine:
    """Continuous batching over ``max_running`` slots of ``max_len`` positions (see the module docstring).

    Args:
        target: the target model.
        draft: an unstarted :class:`Draft` (from ``spire.drafts.make_draft``), or None for AD.
        k: draft tokens per round (>= 1; ignored for AD).
        max_running: slots, i.e. requests decoded together (a round's batch: the rows up to the highest occupied
            slot, or all of them for a draft whose ``use_rows`` returns False).
        max_len: positions per slot (a request needs prompt + max_tokens <= max_len: near the end of a slot a round
            drafts fewer tokens, down to 0, so that it writes no position past max_len - 1); default the smaller of
            the target's positions and 2048.
        eos_ids: token ids that end a request (emitted, then finish "stop"), unless its ``ignore_eos``.
        decode: token ids -> text, needed for stop strings.
        k_policy: picks each round's k in 0..k from the running requests (:mod:`spire.serving.policy`); None:
            every round drafts k.
        prefill_chunk: prompt tokens prefilled per step at most, over all joining requests (chunked prefill, as
            vLLM's ``max_num_batched_tokens``): a longer prompt is prefilled over several steps, each followed by
            the running requests' round, so a long prompt no longer stalls them for its whole prefill. None: every
            joining prompt is prefilled whole at the step it joins.
    Raises:
        ConfigError: bad k / max_running / max_len / prefill_chunk, or a draft that cannot restart single rows (it
            names the draft).
    """

    def __init__(self, target: Transformer, draft: Draft | None = None, k: int = 4, max_running: int = 8,
                 max_len: int | None = None, eos_ids: Sequence[int] = (),
                 decode: Callable[[list[int]], str] | None = None, k_policy: KPolicy | None = None,
                 prefill_chunk: int | None = None) -> None:
        if k < 1 or max_running < 1:
            raise ConfigError(f"k and max_running must be >= 1, got k = {k}, max_running = {max_running}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or int(prefill_chunk) < 1):
            raise ConfigError(f"prefill_chunk must be >= 1 tokens (or None: whole prompts), got {prefill_chunk!r}")
        self.prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)
        self.target, self.draft, self.decode = target, draft, decode
        self.k_policy = k_policy if draft is not None else None
        self.k = k if draft is not None else 0
        self.max_len = min(target.cfg.max_positions, 2048) if max_len is None else int(max_len)
        if not self.k + 2 <= self.max_len <= target.cfg.max_positions:
            raise ConfigError(f"max_len must be in [{self.k + 2}, {target.cfg.max_positions}] (the target's "
                              f"positions), got {self.max_len}")
        self.max_running, self.eos_ids = max_running, frozenset(int(t) for t in eos_ids)
        dev = target.device
        self.cache = target.new_cache(max_running, self.max_len)
        self._narrows = draft is None
        if draft is not None:
            draft.start(target, self.cache, max_running, self.max_len, k)
            draft.restart_rows(torch.arange(max_running, device=dev))  # refuses a draft that cannot
            self._narrows = draft.use_rows(max_running)
        self.width, self._cache_w = max_running, self.cache  # rows [0, width) run; the target cache's view
        self.n = torch.ones(max_running, dtype=torch.long, device=dev)  # (S,) committed length per slot
        self.pending = torch.zeros(max_running, dtype=torch.long, device=dev)  # (S,) the pending token per slot
        self.slots: list[_Request | None] = [None] * max_running
        self.waiting: deque[_Request] = deque()
        self.stats = EngineStats(max(self.k, 1))
        self._ids = itertools.count()
        self._aborts: set[int] = set()
        self._lock = threading.Lock()
        self.round_hook: Callable[[RoundTrace], object] | None = None  # sees every SD round (spire tau --diagnose)

    # ---- requests (thread-safe) ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def num_prefilling(self) -> int:
        """Requests holding a slot whose prompt is not yet fully prefilled (counted in :attr:`num_running`)."""
        return sum(r is not None and r.prefilling for r in self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        """Whether :meth:`step` has anything to do (running or waiting requests, or aborts to apply)."""
        return bool(self.waiting or self._aborts or self.num_running)

    def max_prompt(self, max_tokens: int) -> int:
        """The longest prompt (tokens) a request of ``max_tokens`` new tokens may have (any k: rounds near the end
        of a slot draft fewer tokens)."""
        return self.max_len - max_tokens

    def add_request(self, prompt_ids: Sequence[int], params: RequestParams = RequestParams()) -> int:
        """Queue a request; it joins at a later :meth:`step`. prompt_ids: its token ids (>= 1, each in
        [0, vocab)). Returns its id. Raises ConfigError (the message names the field: prompt, max_tokens, stop)."""
        req = self._new_request(prompt_ids, params)
        with self._lock:
            self.waiting.append(req)
        return req.id

    def add_requests(self, prompt_ids: Sequence[int], params: Sequence[RequestParams]) -> list[int]:
        """Queue one request per settings, all of one prompt (the n choices of an API request), at once: they join
        at the same step when slots are free and then share the prompt's prefill. Returns their ids. Raises
        ConfigError as :meth:`add_request` (then none is queued)."""
        reqs = [self._new_request(prompt_ids, p) for p in params]
        with self._lock:
            self.waiting.extend(reqs)
        return [r.id for r in reqs]

    def add_prefilled(self, state: Prefilled, params: Sequence[RequestParams]) -> list[int]:
        """Admit the rows of a batch that :func:`spire.speculative.prefill` already ran (all but each prompt's last
        token in ``state.cache``) as running requests in the lowest free slots: their keys and values are copied
        into the slots, the draft observes the prefill (``hidden_layers`` of the prefill must include the draft's),
        and their first round runs at the next :meth:`step`. So several drafts decode from one prefill
        (``spire tau``, ``spire bench``: :func:`decode_prefilled`). Call it between steps, on the thread that steps.

        Args:
            state: the prefilled batch (B rows); its cache is read, not kept.
            params: one :class:`RequestParams` per row.
        Returns:
            the request ids, in row order.
        Raises:
            ConfigError: params not one per row, a prefill of another target's shape or without the hidden layers
                the draft reads, fewer than B free slots, or a row that does not fit a slot (as :meth:`add_request`).
        """
        rows = state.rows
        if len(params) != len(rows):
            raise ConfigError(f"add_prefilled: {len(params)} request settings for {len(rows)} prefilled rows")
        def layout(cache: KVCache) -> tuple:
            k = cache.k[0]
            return len(cache.k), k.shape[1], k.shape[3], str(k.dtype).removeprefix("torch.")

        if layout(state.cache) != layout(self.cache):
            raise ConfigError("add_prefilled: the prefill's cache has (layers, KV heads, head size, dtype) "
                              f"{layout(state.cache)}, this engine's target {layout(self.cache)}")
        reads = set(self.draft.hidden_layers) if self.draft is not None else set()
        if state.out is not None and not reads <= set(state.out.hidden):
            raise ConfigError(f"add_prefilled: the prefill kept target layers {sorted(state.out.hidden)}, the "
                              f"{self.draft.name} draft reads {sorted(self.draft.hidden_layers)}")
        reqs = [self._new_request(r, p) for r, p in zip(rows, params)]
        free = [s for s in range(self.max_running) if self.slots[s] is None]
        if len(free) < len(reqs):
            raise ConfigError(f"add_prefilled: {len(reqs)} rows, {len(free)} free slots")
        for req, s in zip(reqs, free):
            req.slot, self.slots[s] = s, req
        self._narrow(max(r.slot for r in self.slots if r is not None) + 1 if self._narrows else self.max_running)
        self._join(reqs)
        slots = torch.tensor(free[: len(reqs)], device=self.n.device)
        if state.out is not None:
            self._copy_kv(slots, state.cache, state.tokens.shape[1])
            if self.draft is not None:
                self._observe_prefill(slots, state.tokens, state.pos, state.valid, state.out)
        for req in reqs:
            self._prefilled(req, len(req.prompt) - 1)
        return [r.id for r in reqs]

    def _new_request(self, prompt_ids: Sequence[int], params: RequestParams) -> _Request:
        """A validated request with the next id (see :meth:`add_request`)."""
        prompt = [int(t) for t in prompt_ids]
        vocab = self.target.cfg.vocab_size
        if not prompt:
            raise ConfigError("prompt: empty (a request needs at least one token)")
        if any(not 0 <= t < vocab for t in prompt):
            raise ConfigError(f"prompt: token ids must be in [0, {vocab}) (the target's vocabulary)")
        if len(prompt) > self.max_prompt(params.max_tokens):
            raise ConfigError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the context "
                              f"of {self.max_len} positions per slot")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ConfigError(f"stop_token_ids: token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise ConfigError(f"logit_bias: token ids must be in [0, {vocab})")
        if params.stop and self.decode is None:
            raise ConfigError("stop: stop strings need the engine's decode (a tokenizer)")
        stop = StopStrings(list(params.stop), self.decode) if params.stop else None
        with self._lock:
            return _Request(next(self._ids), prompt, params, stop, self.eos_ids, vocab, self.n.device)

    def abort(self, request_id: int) -> None:
        """End a waiting or running request at the next :meth:`step` (its slot is freed there, finish "abort");
        unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.add(request_id)

    # ---- the step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Apply aborts, admit waiting requests into free slots, prefill (all joining prompts, or up to
        ``prefill_chunk`` of their tokens), then one round for every running request whose prompt is prefilled.
        Returns one :class:`RequestOutput` per request that got tokens or finished."""
        outputs = self._apply_aborts()
        joiners = self._assign()
        occupied = [r for r in self.slots if r is not None]
        if not occupied:
            return outputs
        self._narrow(max(r.slot for r in occupied) + 1 if self._narrows else self.max_running)
        if joiners:
            self._join(joiners)
        self._prefill([r for r in occupied if r.prefilling])
        running = [r for r in occupied if not r.prefilling]
        if not running:
            return outputs
        k = self.k
        if self.k_policy is not None:
            context = sum(int(self.n[r.slot]) for r in running) / len(running)
            k = min(max(int(self.k_policy.k_for(len(running), context)), 0), self.k)
        if k:  # near the end of a slot, fewer: a round writes positions up to n - 1 + k, which must be < max_len
            k = max(0, min(k, self.max_len - int(self.n[: self.width].max())))
        n_acc, next_tok, block, lps = self._round(running, k)
        accepted, block_l = n_acc.tolist(), block.tolist()
        st = self.stats
        st.rounds += 1
        st.rounds_by_k[k] += 1
        if k and self.k_policy is not None:
            self.k_policy.observe([accepted[r.slot] for r in running], k)
        for req in running:
            b = req.slot
            outputs.append(self._commit(req, block_l[b][: accepted[b] + 1], accepted[b] if k else None, k,
                                        lps.get(b)))
        w = self.width
        live = torch.zeros(w, dtype=torch.bool)  # the finished are freed; a row still prefilling keeps its place
        live[[r.slot for r in running if r.slot is not None]] = True
        live = live.to(self.n.device)
        self.n[:w] = torch.where(live, self.n[:w] + n_acc + 1, self.n[:w])
        self.pending[:w] = torch.where(live, next_tok, self.pending[:w])
        return outputs

    def _narrow(self, w: int) -> None:
        """Run the next rounds on rows [0, w): the target cache's view and the draft's rows."""
        if w != self.width:
            self.width, self._cache_w = w, self.cache.narrow(w)
            if self.draft is not None:
                self.draft.use_rows(w)

    def _apply_aborts(self) -> list[RequestOutput]:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            gone = [r for r in self.waiting if r.id in aborts]
            self.waiting = deque(r for r in self.waiting if r.id not in aborts)
        gone += [r for r in self.slots if r is not None and r.id in aborts]
        for req in gone:
            self._free(req, "abort")
        return [RequestOutput(r.id, [], True, "abort") for r in gone]

    def _free(self, req: _Request, reason: str) -> None:
        if req.slot is not None:
            self.slots[req.slot] = None
            self.n[req.slot], self.pending[req.slot] = 1, 0
            req.slot = None
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _commit(self, req: _Request, toks: list[int], n_accepted: int | None, k: int,
                lp: torch.Tensor | None = None) -> RequestOutput:
        """Emit a running request's share of the round (cut) and free its slot when it finishes. n_accepted: the
        draft tokens it accepted of the round's k (None in an AD round); lp: (k+1, V) its log-probabilities at the
        round's positions (when it asked for logprobs)."""
        eos = (set() if req.params.ignore_eos else set(self.eos_ids)) | set(req.params.stop_token_ids)
        toks, stopped = self._cut(req, toks, eos)
        if req.history is not None:
            req.history.add(toks)
        logprobs = None
        if lp is not None:
            logprobs = _top(lp[: len(toks)], toks, req.params.logprobs)
        prompt_lp = None
        if req.prompt_lp is not None and not req.emitted:
            prompt_lp = req.prompt_lp
        req.emitted.extend(toks)
        st = self.stats
        st.row_rounds += 1
        st.generated_tokens += len(toks)
        if n_accepted is not None:
            st.accepted[n_accepted] += 1
            for j in range(k):
                st.drafted[j] += 1
        reason = "stop" if stopped else "length" if len(req.emitted) >= req.params.max_tokens else None
        if reason is not None:
            self._free(req, reason)
        stop_token = toks[-1] if stopped and toks and toks[-1] in eos else None
        return RequestOutput(req.id, toks, reason is not None, reason, n_accepted, stop_token, logprobs, prompt_lp)

    @staticmethod
    def _cut(req: _Request, toks: list[int], eos: set[int]) -> tuple[list[int], bool]:
        """:func:`spire.speculative.cut_output` with min_tokens: stop strings are checked only from the token that
        reaches min_tokens on (EOS and stop token ids cannot come earlier: they are banned)."""
        p = req.params
        start = max(0, p.min_tokens - len(req.emitted))
        if start == 0 or req.stop is None:
            return cut_output(req.emitted, toks, p.max_tokens, eos, req.stop)
        toks = toks[: p.max_tokens - len(req.emitted)]
        cut = next((i + 1 for i, t in enumerate(toks) if t in eos), None)
        if start < len(toks[:cut]):
            cs = req.stop.cut(req.emitted + toks[:start], toks[start:cut], checked=False)
            cut = start + cs if cs is not None else cut
        return (toks, False) if cut is None else (toks[:cut], True)

    def _assign(self) -> list[_Request]:
        """Move waiting requests into free slots, lowest first. Returns them."""
        joiners: list[_Request] = []
        with self._lock:
            for s in range(self.max_running):
                if self.slots[s] is None and self.waiting:
                    req = self.waiting.popleft()
                    req.slot, self.slots[s] = s, req
                    joiners.append(req)
        return joiners

    def _join(self, joiners: list[_Request]) -> None:
        """The requests that just took slots: the draft forgets those rows, and each slot's pending token is its
        prompt's first (its dummy rounds, while it prefills, write only positions its prefill overwrites)."""
        dev = self.n.device
        if self.draft is not None:
            self.draft.restart_rows(torch.tensor([r.slot for r in joiners], device=dev))
        slots = torch.tensor([r.slot for r in joiners], device=dev)
        self.n[slots] = 1  # a one-token prompt has nothing to prefill: this is its state after the prefill too
        self.pending[slots] = torch.tensor([r.prompt[0] for r in joiners], device=dev)
        self.stats.prompt_tokens += sum(len(r.prompt) for r in joiners)

    def _prefilled(self, req: _Request, upto: int) -> None:
        """Positions < upto of the request's prompt are in its slot's caches: its pending token is the next."""
        req.prefilled = upto
        self.n[req.slot] = upto + 1
        self.pending[req.slot] = req.prompt[upto]

    def _prefill(self, todo: list[_Request]) -> None:
        """Prefill the prompts (all but their last token) of the slots still prefilling, oldest request first: each
        takes at most what is left of ``prefill_chunk`` tokens this step (all of its prompt without a chunk).
        Pieces that start a prompt run in right-padded batches of similar lengths (:func:`prefill_groups`: the
        padding stays within 25 % of the real tokens, so a 2,000-token prompt is not padded onto seven short ones)
        on a cache of their own, whose keys / values are copied into the slots' rows; a piece that continues a
        prompt runs on its slot's row of the engine's cache. The draft observes each batch (the other rows
        masked out).

        Requests that start the same prompt in the same step (the n choices of one API request) share its prefill:
        it is computed once, charged once to the chunk budget, and its keys / values are copied into each slot."""
        budget = self.prefill_chunk
        starts: dict[tuple, list] = {}  # a starting piece's prompt -> [n, its requests]
        later: dict[tuple, list] = {}  # a continuing piece's (prompt, start) -> [n, its requests]
        for req in sorted(todo, key=lambda r: r.id):
            n = len(req.prompt) - 1 - req.prefilled
            pieces, key = (later, (tuple(req.prompt), req.prefilled)) if req.prefilled else (starts, tuple(req.prompt))
            if key in pieces:  # the same tokens as a piece already taken: shared, not charged again
                pieces[key][1].append(req)
                continue
            if budget is not None:
                if budget <= 0:
                    break
                n = min(n, budget)
                budget -= n
            pieces[key] = [n, [req]]
        unique = list(starts.values())
        for group in prefill_groups([n for n, _ in unique]):
            self._prefill_start([(req, unique[i][0]) for i in group for req in unique[i][1]])
        for n, reqs in later.values():
            self._prefill_continue(reqs, n)

    def _prefill_start(self, pieces: list[tuple[_Request, int]]) -> None:
        """Prompt tokens 0..n-1 of each (request, n), as one right-padded batch on a fresh cache; pieces of the same
        tokens are one row of it, copied into each of their slots."""
        dev = self.n.device
        slots = torch.tensor([r.slot for r, _ in pieces], device=dev)
        rows, index, src = [], {}, []
        for r, n in pieces:
            key = tuple(r.prompt[: n + 1])
            if key not in index:
                index[key] = len(rows)
                rows.append(list(key))
            src.append(index[key])
        span = max(n for _, n in pieces)
        hidden = self._hidden(any(r.prompt_lp is not None for r, _ in pieces))
        state = prefill(self.target, rows, span, hidden)
        shared = len(rows) < len(pieces)
        at = torch.tensor(src, device=dev)
        self._copy_kv(slots, state.cache, span, at if shared else None)
        if self.draft is not None:
            out = state.out
            if shared:
                full = state.out
                out = ForwardOutput(hidden={j: h[at] for j, h in full.hidden.items()},
                                    compute_logits=lambda: full.logits[at])
            self._observe_prefill(slots, state.tokens[at], state.pos[at], state.valid[at], out)
        for i, (req, n) in enumerate(pieces):
            if req.prompt_lp is not None and n:
                self._prompt_logprobs(req, state.out.hidden[self.target.cfg.n_layers][src[i]: src[i] + 1, :n], 0)
            self._prefilled(req, n)

    def _hidden(self, final: bool) -> tuple[int, ...]:
        """The target layers a prefill keeps: the draft's, and the final residual stream when ``final``."""
        hidden = tuple(self.draft.hidden_layers) if self.draft is not None else ()
        return hidden + (self.target.cfg.n_layers,) if final else hidden

    def _prompt_logprobs(self, req: _Request, h: torch.Tensor, s0: int, chunk: int = 256) -> None:
        """Log-probabilities (the target's, untransformed, at temperature 1) of prompt tokens s0+1 .. s0+T from the
        final residual stream h (1, T, d_model) at
        positions s0 .. s0+T-1 (logits in chunks of ``chunk`` positions, so a long prompt never holds (T, V))."""
        T = h.shape[1]
        for c in range(0, T, chunk):
            lg = self.target.logits(h[:, c: c + chunk])[0]  # (t, V)
            lp = torch.log_softmax(lg.float(), -1)  # the model's own distribution (no request transform: vLLM's)
            toks = req.prompt[s0 + c + 1: s0 + c + 1 + lg.shape[0]]
            req.prompt_lp.extend(_top(lp, toks, req.params.prompt_logprobs))

    def _copy_kv(self, slots: torch.Tensor, cache: KVCache, span: int, rows: torch.Tensor | None = None) -> None:
        """Positions [0, span) of the rows ``rows`` (default every row, in order) of ``cache`` (a prefill's) into the
        engine cache's rows ``slots``."""
        for layer in range(len(self.cache.k)):
            k, v = cache.k[layer][:, :, :span], cache.v[layer][:, :, :span]
            self.cache.k[layer][slots, :, :span] = k if rows is None else k[rows]
            self.cache.v[layer][slots, :, :span] = v if rows is None else v[rows]

    def _prefill_continue(self, reqs: list[_Request], n: int) -> None:
        """Prompt tokens prefilled .. prefilled + n - 1 of ``reqs`` (requests of the same prompt and progress), on
        the first one's slot's row of the engine's cache; the keys / values are copied into the others' rows."""
        req, others = reqs[0], reqs[1:]
        dev, s0 = self.n.device, req.prefilled
        tokens = torch.tensor([req.prompt[s0: s0 + n]], device=dev)
        pos = torch.arange(s0, s0 + n, device=dev)[None]
        hidden = self._hidden(any(r.prompt_lp is not None for r in reqs))
        out = self.target(tokens, pos, self.cache.row(req.slot), hidden_layers=hidden)
        slots = torch.tensor([r.slot for r in reqs], device=dev)
        if others:  # the same tokens at the same positions in the other slots: copy the keys / values
            for layer in range(len(self.cache.k)):
                for c in (self.cache.k[layer], self.cache.v[layer]):
                    c[slots[1:], :, s0: s0 + n] = c[req.slot, :, s0: s0 + n]
            full = out
            at = torch.zeros(len(reqs), dtype=torch.long, device=dev)
            out = ForwardOutput(hidden={j: h[at] for j, h in full.hidden.items()},
                                compute_logits=lambda: full.logits[at])
            tokens, pos = tokens[at], pos[at]
        if self.draft is not None:
            self._observe_prefill(slots, tokens, pos, None, out)
        for i, r in enumerate(reqs):
            if r.prompt_lp is not None:
                self._prompt_logprobs(r, out.hidden[self.target.cfg.n_layers][i: i + 1], s0)
            self._prefilled(r, s0 + n)

    def _observe_prefill(self, slots: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
                         valid: torch.Tensor | None, out: ForwardOutput) -> None:
        """:meth:`Draft.observe` of a prefill batch (J rows for ``slots``: tokens, positions, valid (J, W), the
        target's output) as full-batch (S, W) tensors, the other rows invalid."""
        S, (J, W) = self.width, tokens.shape
        dev = tokens.device
        full_tokens = torch.zeros(S, W, dtype=torch.long, device=dev)
        full_valid = torch.zeros(S, W, dtype=torch.bool, device=dev)
        full_pos = torch.arange(W, device=dev)[None].repeat(S, 1)
        full_tokens[slots], full_pos[slots] = tokens, pos
        full_valid[slots] = True if valid is None else valid
        hidden = {}
        reads = set(self.draft.hidden_layers)
        for j, h in out.hidden.items():
            if j not in reads:  # the final residual stream kept for prompt logprobs
                continue
            hidden[j] = torch.zeros(S, *h.shape[1:], dtype=h.dtype, device=h.device)
            hidden[j][slots] = h

        def logits() -> torch.Tensor:
            lg = out.logits
            full = torch.zeros(S, *lg.shape[1:], dtype=lg.dtype, device=lg.device)
            full[slots] = lg
            return full

        self.draft.observe(full_tokens, full_pos, ForwardOutput(hidden=hidden, compute_logits=logits),
                           valid=full_valid)

    # ---- one round ----------------------------------------------------------------------------------------

    def _round(self, running: list[_Request], k: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """One round of k draft tokens (0: AD) over the slots [0, width) (S of them). Returns n_accepted (S,),
        next_token (S,), the output block (S, k+1) and, per slot of a request that asked for logprobs, its (k+1, V)
        log-probabilities at the round's positions."""
        special = [r for r in running if r.special]
        w, cache = self.width, self._cache_w
        pending, pos0 = self.pending[:w], self.n[:w] - 1  # (S,) each slot's pending token and its position
        if self.draft is None or k == 0:
            hidden = self.draft.hidden_layers if self.draft is not None else ()
            out = self.target(pending[:, None], pos0[:, None], cache, hidden_layers=hidden)
            next_tok, _, rows = _choose(out.logits[:, -1], special, [], 0)  # (S,)
            if self.draft is not None:  # the draft sees the committed token, so SD can resume next round
                self.draft.observe(pending[:, None], pos0[:, None], out)
            return torch.zeros_like(next_tok), next_tok, next_tok[:, None], _logprobs(special, rows)
        tok, tokens, qs, zs = pending, [], [], []
        for j in range(k):
            z = self.draft.step(tok[:, None], (pos0 + j)[:, None])
            tok, q, _ = _choose(z, special, tokens, j)
            tokens.append(tok)
            qs.append(q)
            if self.round_hook is not None:
                zs.append(z)
        d_tokens = torch.stack(tokens, 1)  # (S, k)
        verify_in = torch.cat([pending[:, None], d_tokens], 1)  # (S, k+1)
        vpos = pos0[:, None] + torch.arange(k + 1, device=pos0.device)
        out = self.target(verify_in, vpos, cache, hidden_layers=self.draft.hidden_layers)
        n_acc, next_tok, rows = _accept(d_tokens, qs, out.logits, special)
        if self.round_hook is not None:
            self.round_hook(RoundTrace([(r.slot, r.sampling, r.params.max_tokens - len(r.emitted)) for r in running],
                                       pos0, d_tokens, torch.stack(zs, 1),
                                       out.logits, n_acc))
        self.draft.observe(verify_in, vpos, out)
        return n_acc, next_tok, output_tokens(d_tokens, n_acc, next_tok), _logprobs(special, rows)


def prefill_groups(spans: Sequence[int], slack: float = 1.25) -> list[list[int]]:
    """Indices of prefill spans (tokens) grouped for right-padded batches: sorted by length, a group grows while
    its padded size (members x longest) stays within ``slack`` x its real tokens (spans of 0 join any group).
    Returns the groups, each a list of indices into ``spans``, longest first."""
    order = sorted(range(len(spans)), key=lambda i: -spans[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * spans[g[0]] <= slack * (sum(spans[j] for j in g) + spans[i]) + 1:
            g.append(i)
        else:
            groups.append([i])
    return groups


def _choose(logits: torch.Tensor, special: list[_Request], drafted: list[torch.Tensor], j: int
            ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
    """Tokens (S,) from logits (S, V) at a round's position j (after the drafted tokens ``drafted``, j of (S,)):
    the argmax in every row, then in each special request's row (:attr:`_Request.special`) its processed logits'
    argmax (greedy) or a draw from its transformed distribution with its own generator. Returns the tokens, the
    (S, V) float32 distributions they were drawn from (rows of greedy requests are zero; None when no request
    samples) and the processed (1, V) logits of each special request's slot."""
    tok = logits.argmax(-1)
    q = None
    if any(not r.sampling.greedy for r in special):
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    rows = {}
    for req in special:
        b = req.slot
        row = req.logits(logits[b: b + 1], [int(t[b]) for t in drafted], j)  # (1, V)
        rows[b] = row
        if req.sampling.greedy:
            tok[b] = row[0].argmax()
        else:
            q[b] = probs_from_logits(row[0], req.sampling)
            tok[b] = sample(q[b], req.generator)
    return tok, q, rows


def _accept(d_tokens: torch.Tensor, qs: list[torch.Tensor | None], logits: torch.Tensor,
            special: list[_Request]) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Verification per row: greedy for every row (:func:`verify_greedy`), then for each special request's row
    with its processed logits (position t after the drafted tokens before it): greedy, or rejection sampling
    (:func:`verify`) with its transform and generator. d_tokens (S, k), qs: k (S, V) or None, logits (S, k+1, V).
    Returns n_accepted (S,), next_token (S,) and the processed (k+1, V) logits of each special request's slot."""
    n_acc, next_tok = verify_greedy(d_tokens, logits)
    rows = {}
    if special:
        q = torch.stack(qs, 1) if any(x is not None for x in qs) else None  # (S, k, V)
        for req in special:
            b = req.slot
            row = req.logits(logits[b], d_tokens[b].tolist(), 0)  # (k+1, V)
            rows[b] = row
            if req.sampling.greedy:
                nb, xb = verify_greedy(d_tokens[b: b + 1], row[None])
            else:
                p = probs_from_logits(row[None], req.sampling)  # (1, k+1, V)
                nb, xb = verify(d_tokens[b: b + 1], q[b: b + 1], p, req.generator)
            n_acc[b], next_tok[b] = nb[0], xb[0]
    return n_acc, next_tok, rows


def _logprobs(special: list[_Request], rows: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per slot of a request that asked for logprobs: its (T, V) log-probabilities from its processed logits."""
    return {r.slot: logprobs_from_logits(rows[r.slot], r.sampling) for r in special if r.params.logprobs is not None}


def _top(lp: torch.Tensor, toks: list[int], n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """lp (T, V) log-probabilities, toks T tokens -> per token (its logprob, the top n (id, logprob))."""
    if not toks:
        return []
    chosen = lp.gather(-1, torch.tensor(toks, device=lp.device)[:, None])[:, 0].tolist()
    if n:
        vals, idx = lp.topk(min(n, lp.shape[-1]), -1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in toks]
    return list(zip(chosen, tops))


@torch.no_grad()
def generate_batch(target: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   draft: Draft | None = None, k: int = 4, params: SamplingParams = SamplingParams(), seed: int = 0,
                   eos_ids: Sequence[int] = (), stop: Sequence[str] = (),
                   decode: Callable[[list[int]], str] | None = None) -> GenerationResult:
    """A batch of prompts on the engine, all joining at the first step (``spire generate``'s decode path): one slot
    per prompt of :func:`spire.speculative.cache_length` positions, each finished row freed at once.

    Args as :func:`spire.speculative.generate`, except: ``seed``: request i samples with its own generator seeded
    ``seed + i`` (so a prompt's sampled output does not depend on the others in the batch); ``stop``: stop strings
    (``decode`` needed). Greedy output equals :func:`spire.speculative.generate`'s. Returns a
    :class:`~spire.speculative.GenerationResult` (rounds: the rounds each request ran in; decode_s: the engine's
    steps, prefill included). Raises ConfigError as :func:`spire.speculative.generate` and :class:`Engine`."""
    if k < 1 or max_new_tokens < 1:
        raise ConfigError(f"k and max_new_tokens must be >= 1, got k = {k}, max_new_tokens = {max_new_tokens}")
    rows = [[int(t) for t in p] for p in prompts]
    if not rows or any(not r for r in rows):
        raise ConfigError("prompt: empty (a request needs at least one token)")
    max_len = cache_length(target, rows, max_new_tokens, k if draft is not None else 0)
    engine = Engine(target, draft, k=k, max_running=len(rows), max_len=max_len, eos_ids=eos_ids, decode=decode)
    ids = [engine.add_request(r, RequestParams(max_new_tokens, params.temperature, params.top_k, params.top_p,
                                               seed + i, tuple(stop))) for i, r in enumerate(rows)]
    watch = Stopwatch(target.device)
    tokens, finish, rounds = drain(engine, ids)
    decode_s, decode_cpu_s = watch.stop()
    return GenerationResult(tokens, finish, rounds, [len(t) for t in tokens], decode_s=decode_s,
                            decode_cpu_s=decode_cpu_s)


@torch.no_grad()
def decode_prefilled(target: Transformer, state: Prefilled, max_new_tokens: int, draft: Draft | None = None,
                     k: int = 4, params: SamplingParams = SamplingParams(), seed: int = 0,
                     progress: Callable[[int], object] | None = None,
                     round_hook: Callable[[RoundTrace], object] | None = None) -> GenerationResult:
    """A prefilled batch decoded on the engine (``spire tau`` and ``spire bench``: several drafts from one
    prefill): one slot per row of ``state.max_len`` positions, the rows admitted with :meth:`Engine.add_prefilled`,
    ``max_new_tokens`` tokens each (no EOS), each finished row freed at once.

    Args:
        state: the batch after :func:`spire.speculative.prefill` with the draft's ``hidden_layers``; its cache is
            copied, not changed, so the next draft can start from it again.
        draft: an unstarted draft (the engine starts it), or None for AD.
        params: sampling of every row; ``seed``: row i samples with its own generator seeded ``seed + i`` (so a
            row's sampled output does not depend on the batch it ran in).
        progress: called with the number of tokens each step emitted.
        round_hook: the engine's :attr:`Engine.round_hook` (row i is slot i).
    Returns:
        a :class:`~spire.speculative.GenerationResult`; rounds: the rounds each row ran; prefill_s: the state's;
        decode_s and decode_cpu_s: the steps only (not the copy of the prefill into the engine's cache).
    Raises:
        ConfigError: k or max_new_tokens < 1, or rows that do not fit ``state.max_len`` with k (as :class:`Engine`).
    """
    if k < 1 or max_new_tokens < 1:
        raise ConfigError(f"k and max_new_tokens must be >= 1, got k = {k}, max_new_tokens = {max_new_tokens}")
    engine = Engine(target, draft, k=k, max_running=len(state.rows), max_len=state.max_len)
    engine.round_hook = round_hook
    ids = engine.add_prefilled(state, [RequestParams(max_new_tokens, params.temperature, params.top_k, params.top_p,
                                                     seed + i) for i in range(len(state.rows))])
    watch = Stopwatch(target.device)
    tokens, finish, rounds = drain(engine, ids, progress)
    decode_s, decode_cpu_s = watch.stop()
    return GenerationResult(tokens, finish, rounds, [len(t) for t in tokens], prefill_s=state.prefill_s,
                            decode_s=decode_s, decode_cpu_s=decode_cpu_s)


def drain(engine: Engine, ids: Sequence[int], progress: Callable[[int], object] | None = None
          ) -> tuple[list[list[int]], list[str], list[int]]:
    """Step ``engine`` until it has no work, collecting the requests ``ids`` (its only requests). progress: called
    with the tokens each step emitted. Returns per request, in the order of ``ids``: its tokens, its finish reason
    and the rounds it ran in."""
    index = {rid: i for i, rid in enumerate(ids)}
    tokens: list[list[int]] = [[] for _ in ids]
    finish, rounds = ["length"] * len(ids), [0] * len(ids)
    while engine.has_work():
        outputs = engine.step()
        for out in outputs:
            i = index[out.request_id]
            tokens[i].extend(out.new_tokens)
            rounds[i] += 1
            if out.finished:
                finish[i] = out.finish_reason
        if progress is not None:
            progress(sum(len(o.new_tokens) for o in outputs))
    return tokens, finish, rounds
