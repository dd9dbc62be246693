"""Continuous batching with lossless speculative decoding: the engine behind ``spire serve``, ``spire generate``,
``spire tau`` and ``spire bench``.

Rows are **slots**: a request takes a free slot between rounds and gives it back as soon as it finishes (or is
aborted). Each :meth:`Engine.step` is plan, run, commit:

1. plan: :meth:`Scheduler.schedule <spire.engine.scheduler.Scheduler.schedule>` (pure Python) applies aborts, admits
   waiting requests into free slots, picks this step's prefill pieces (all joining prompts, or with
   ``prefill_chunk`` at most that many tokens, so a long prompt no longer stalls the running requests) and the
   round's k;
2. run: the :class:`~spire.engine.runner.Runner` restarts the joining slots' draft rows (so a slot's new request
   never sees the previous one's KV, memory or n-gram context), prefills, and runs **one round** over the batch;
3. commit: each running request's share of the round is cut at its budget, EOS, stop token ids and stop strings
   (:func:`spire.engine.output.cut_request`), finished requests free their slots, the others advance.

Several drafts may be served at once (a portfolio, ``spire serve --draft ngram,spire``): each round, each running
request drafts with the one the round policy picks for it (:mod:`spire.serving.policy`), or none, and how many
tokens (:class:`~spire.engine.scheduler.RoundChoice`); a round of k = 0 is an AD round. Every draft observes every
forward of the target, whether it proposed or not, so any of them can take over at the next round.

Lossless per request: a greedy request's tokens are its own single-request AD output whatever else runs beside
it, and a sampled request's tokens are distributed as the target's (the verification of :mod:`spire.verification`,
row by row, with the request's own transform and generator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from spire.drafts.base import Draft
from spire.engine.output import GenerationResult, TextStream
from spire.engine.prefill import Prefilled, cache_length
from spire.engine.runner import RoundTrace, Runner, check_prefilled
from spire.engine.scheduler import EngineStats, Request, RequestOutput, Scheduler, StepPlan
from spire.errors import ConfigError
from spire.model import Transformer
from spire.params import RequestParams, SamplingParams
from spire.timing import Stopwatch


@dataclass(frozen=True)
class EngineStatus:
    """One reading of an :class:`Engine` (:meth:`Engine.status`), instead of a property per field: running:
    requests holding a slot; waiting: requests queued for one; prefilling: those holding a slot whose prompt is not yet
    prefilled (counted in running); max_running, max_len, k: the engine's slots, positions per slot and most draft
    tokens per round (0: AD); width: the rows the last round computed; requests: the ids of the running then the
    waiting requests; stats: the engine's counters (:class:`~spire.engine.scheduler.EngineStats`, live, not a
    copy); k_policy: the round policy, or None."""

    running: int
    waiting: int
    prefilling: int
    max_running: int
    max_len: int
    k: int
    width: int
    requests: tuple[int, ...]
    stats: EngineStats
    k_policy: object = None


def capture_widths(max_running: int) -> list[int]:
    """The widths a round runs at on a GPU: 1, 2, 4, then every multiple of 8, up to ``max_running`` (included),
    vLLM's CUDA-graph capture sizes (``cudagraph_capture_sizes``) below its largest."""
    return sorted({w for w in (1, 2, 4, *range(8, max_running, 8)) if w < max_running} | {max_running})


class Engine:
    """Continuous batching over ``max_running`` slots of ``max_len`` positions (see the module docstring).

    Args:
        target: the target model.
        draft: an unstarted :class:`Draft` (from ``spire.drafts.make_draft``), a sequence of them (a portfolio: each
            request drafts with the one the policy picks, round by round), or None for AD.
        k: draft tokens per round (>= 1; ignored for AD).
        max_running: slots, i.e. requests decoded together (a round's batch: the rows up to the highest occupied
            slot, or all of them for a draft whose ``use_rows`` returns False).
        max_len: positions per slot (a request needs prompt + max_tokens <= max_len: near the end of a slot a round
            drafts fewer tokens, down to 0, so that it writes no position past max_len - 1); default the smaller of
            the target's positions and 2048.
        eos_ids: token ids that end a request (emitted, then finish "stop"), unless its ``ignore_eos``.
        decode: token ids -> text, needed for stop strings.
        k_policy: the round policy (:mod:`spire.serving.policy`; the protocols in
            :class:`~spire.engine.scheduler.Scheduler`): per request the draft and k in 0..k; None: every request
            drafts k with the first draft that proposes for it.
        prefill_chunk: prompt tokens prefilled per step at most, over all joining requests (chunked prefill, as
            vLLM's ``max_num_batched_tokens``). None: every joining prompt is prefilled whole at the step it joins.
        widths: the only batch widths a round runs at (:class:`~spire.engine.scheduler.Scheduler`), so that a GPU
            captures one CUDA graph per width; "auto": :func:`capture_widths` on CUDA, any width elsewhere (on a CPU
            padded rows cost compute and no graph is captured); None: any width.
    Raises:
        ConfigError: bad k / max_running / max_len / prefill_chunk / widths, or a draft that cannot restart single rows (it
            names the draft).
    """

    def __init__(self, target: Transformer, draft: Draft | Sequence[Draft] | None = None, k: int = 4,
                 max_running: int = 8,
                 max_len: int | None = None, eos_ids: Sequence[int] = (),
                 decode: Callable[[list[int]], str] | None = None, k_policy=None,
                 prefill_chunk: int | None = None, widths: Sequence[int] | str | None = "auto") -> None:
        if k < 1 or max_running < 1:
            raise ConfigError(f"k and max_running must be >= 1, got k = {k}, max_running = {max_running}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or int(prefill_chunk) < 1):
            raise ConfigError(f"prefill_chunk must be >= 1 tokens (or None: whole prompts), got {prefill_chunk!r}")
        drafts = [] if draft is None else list(draft) if isinstance(draft, (list, tuple)) else [draft]
        self.target, self.drafts, self.decode = target, drafts, decode
        self.k = k if drafts else 0
        self.max_len = min(target.cfg.max_positions, 2048) if max_len is None else int(max_len)
        if not self.k + 2 <= self.max_len <= target.cfg.max_positions:
            raise ConfigError(f"max_len must be in [{self.k + 2}, {target.cfg.max_positions}] (the target's "
                              f"positions), got {self.max_len}")
        self.max_running, self.eos_ids = max_running, frozenset(int(t) for t in eos_ids)
        self.runner = Runner(target, drafts, k, max_running, self.max_len)
        if widths == "auto":
            widths = capture_widths(max_running) if target.device.type == "cuda" else None
        self.scheduler = Scheduler(max_running, self.max_len, self.k, k_policy if drafts else None,
                                   self.runner.narrows, None if prefill_chunk is None else int(prefill_chunk),
                                   [d.name for d in drafts], widths)

    # ---- views -------------------------------------------------------------------------------------------------

    @property
    def draft(self) -> Draft | None:
        """The first (with one draft, the only) served draft, or None for AD."""
        return self.drafts[0] if self.drafts else None

    def status(self) -> EngineStatus:
        """One reading of the engine's state (:class:`EngineStatus`), for the server's admission and /metrics."""
        sch = self.scheduler
        waiting = sch.waiting_ids()
        held = [r for r in list(sch.slots) if r is not None]
        return EngineStatus(len(held), len(waiting), sum(r.prefilling for r in held), self.max_running,
                            self.max_len, self.k, self.runner.width, tuple([r.id for r in held] + waiting), sch.stats,
                            sch.k_policy)

    @property
    def stats(self) -> EngineStats:
        """The engine's counters (written by :meth:`Scheduler.update_from_output` and the admissions)."""
        return self.scheduler.stats

    @property
    def slots(self) -> list[Request | None]:
        """The slots' requests (None: free), the scheduler's."""
        return self.scheduler.slots

    @property
    def round_hook(self) -> Callable[[RoundTrace], object] | None:
        """Sees every SD round (:class:`~spire.engine.runner.RoundTrace`; ``spire tau --diagnose``)."""
        return self.runner.round_hook

    @round_hook.setter
    def round_hook(self, hook: Callable[[RoundTrace], object] | None) -> None:
        self.runner.round_hook = hook

    @property
    def num_running(self) -> int:
        return self.status().running

    @property
    def num_prefilling(self) -> int:
        return self.status().prefilling

    @property
    def num_waiting(self) -> int:
        return self.status().waiting

    @property
    def width(self) -> int:
        return self.status().width

    def has_work(self) -> bool:
        """Whether :meth:`step` has anything to do (running or waiting requests, or aborts to apply)."""
        return self.scheduler.has_work()

    def max_prompt(self, max_tokens: int) -> int:
        """The longest prompt (tokens) a request of ``max_tokens`` new tokens may have (any k: rounds near the end
        of a slot draft fewer tokens)."""
        return self.max_len - max_tokens

    # ---- requests (thread-safe) ------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: RequestParams = RequestParams()) -> int:
        """Queue a request; it joins at a later :meth:`step`. prompt_ids: its token ids (>= 1, each in
        [0, vocab)). Returns its id. Raises ConfigError (the message names the field: prompt, max_tokens, stop)."""
        return self.add_requests(prompt_ids, [params])[0]

    def add_requests(self, prompt_ids: Sequence[int], params: Sequence[RequestParams],
                     texts: Sequence[TextStream] | None = None) -> list[int]:
        """Queue one request per settings, all of one prompt (the n choices of an API request), at once: they join
        at the same step when slots are free and then share the prompt's prefill. texts: each request's output
        processor (its stop strings are checked on it; default: one of the engine's decode). Returns their ids.
        Raises ConfigError as :meth:`add_request` (then none is queued)."""
        texts = texts if texts is not None else [None] * len(params)
        reqs = [self._new_request(prompt_ids, p, t) for p, t in zip(params, texts, strict=True)]
        self.scheduler.add(reqs)
        return [r.id for r in reqs]

    def add_prefilled(self, state: Prefilled, params: Sequence[RequestParams]) -> list[int]:
        """Admit the rows of a batch that :func:`spire.engine.prefill.prefill` already ran (all but each prompt's last
        token in ``state.cache``) as running requests in the lowest free slots, by an admission plan
        (:meth:`Scheduler.admit`) run on the path of a step's joins (:meth:`run_prefill`): their keys and values are
        copied into the slots, the draft observes the prefill (``hidden_layers`` of the prefill must include the
        draft's), and their first round runs at the next :meth:`step`. So several drafts decode from one prefill
        (``spire tau``, ``spire bench``: :func:`decode_prefilled`). Call it between steps, on the thread that steps.
        params: one :class:`RequestParams` per row. Returns the request ids, in row order.

        Raises ConfigError: params not one per row, a prefill of another target's shape or without the hidden layers
        the draft reads, fewer than B free slots, or a row that does not fit a slot (as :meth:`add_request`)."""
        if len(params) != len(state.rows):
            raise ConfigError(f"add_prefilled: {len(params)} request settings for {len(state.rows)} prefilled rows")
        check_prefilled(state, self.runner.cache, self.drafts)
        reqs = [self._new_request(r, p) for r, p in zip(state.rows, params)]
        self.run_prefill(self.scheduler.admit(reqs, state))
        return [r.id for r in reqs]

    def _new_request(self, prompt_ids: Sequence[int], params: RequestParams, text: TextStream | None = None
                     ) -> Request:
        return self.scheduler.new_request(prompt_ids, params, self.target.cfg.vocab_size, self.eos_ids, self.decode,
                                          text)

    def abort(self, request_id: int) -> None:
        """End a waiting or running request at the next :meth:`step` (its slot is freed there, finish "abort");
        unknown or finished ids are ignored."""
        self.scheduler.abort(request_id)

    # ---- the step: plan, run, commit -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Apply aborts, admit waiting requests into free slots, prefill (all joining prompts, or up to
        ``prefill_chunk`` of their tokens), then one round for every running request whose prompt is prefilled.
        Returns one :class:`RequestOutput` per request that got tokens or finished."""
        plan = self.scheduler.schedule()
        outputs = [RequestOutput(r.id, [], True, "abort") for r in plan.aborted]
        self.runner.free(plan.freed, [r.id for r in plan.aborted])
        if not plan.width:
            return outputs
        self.run_prefill(plan)
        if not plan.running:
            return outputs
        choice = self.scheduler.choose_round(plan, self.runner.proposes(plan.running) if plan.k else ())
        done = self.scheduler.update_from_output(plan, self.runner.round(plan.running, choice))
        self.runner.commit(done)
        return outputs + done

    def run_prefill(self, plan: StepPlan) -> None:
        """The plan's joins and prefill pieces, on the rows [0, plan.width): a step's, or an admission plan's (the
        batch prefilled elsewhere copied into the joiners' slots, :meth:`add_prefilled`)."""
        self.runner.narrow(plan.width)
        self.runner.join(plan.joiners)
        if plan.prefilled is not None:
            self.runner.add_prefilled(plan.prefilled, plan.joiners)
        for pieces in plan.starts:
            self.runner.prefill_start(pieces)
        for reqs, s0, n in plan.continues:
            self.runner.prefill_continue(reqs, s0, n)


@torch.no_grad()
def generate_batch(target: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   draft: Draft | None = None, k: int = 4, params: SamplingParams = SamplingParams(), seed: int = 0,
                   eos_ids: Sequence[int] = (), stop: Sequence[str] = (),
                   decode: Callable[[list[int]], str] | None = None,
                   progress: Callable[[int], object] | None = None) -> GenerationResult:
    """A batch of prompts on the engine, all joining at the first step (``spire generate``'s decode path): one slot
    per prompt of :func:`~spire.engine.prefill.cache_length` positions, each finished row freed at once.

    Args:
        prompts: token ids per prompt (lengths may differ); max_new_tokens: budget per prompt (never overshot).
        draft: an unstarted draft, or None for AD; k: draft tokens per round (>= 1).
        params: the sampling transform, applied to the target's and the draft's distributions alike; ``seed``:
            request i samples with its own generator seeded ``seed + i`` (so a prompt's sampled output does not
            depend on the others in the batch).
        eos_ids: tokens that end a row (emitted, then "stop"); stop: stop strings (``decode`` needed).
        progress: called with the number of tokens each step emitted.
    Returns a :class:`~spire.engine.output.GenerationResult` (rounds: the rounds each request ran in; decode_s: the
    engine's steps, prefill included). Raises ConfigError: k or max_new_tokens < 1, an empty prompt, a context
    beyond the target's positions, or as :class:`Engine`."""
    if k < 1 or max_new_tokens < 1:
        raise ConfigError(f"k and max_new_tokens must be >= 1, got k = {k}, max_new_tokens = {max_new_tokens}")
    rows = [[int(t) for t in p] for p in prompts]
    if not rows or any(not r for r in rows):
        raise ConfigError("prompt: empty (a request needs at least one token)")
    max_len = cache_length(target, rows, max_new_tokens, k if draft is not None else 0)
    engine = Engine(target, draft, k=k, max_running=len(rows), max_len=max_len, eos_ids=eos_ids, decode=decode)
    ids = [engine.add_request(r, RequestParams(max_new_tokens, params.temperature, params.top_k, params.top_p,
                                               seed + i, tuple(stop), min_p=params.min_p))
           for i, r in enumerate(rows)]
    watch = Stopwatch(target.device)
    tokens, finish, rounds = drain(engine, ids, progress)
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
        state: the batch after :func:`~spire.engine.prefill.prefill` with the draft's ``hidden_layers``; its cache
            is copied, not changed, so the next draft can start from it again.
        draft: an unstarted draft (the engine starts it), or None for AD.
        params: sampling of every row; ``seed``: row i samples with its own generator seeded ``seed + i``.
        progress: called with the number of tokens each step emitted.
        round_hook: the engine's :attr:`Engine.round_hook` (row i is slot i).
    Returns:
        a :class:`~spire.engine.output.GenerationResult`; rounds: the rounds each row ran; prefill_s: the state's;
        decode_s and decode_cpu_s: the steps only (not the copy of the prefill into the engine's cache).
    Raises:
        ConfigError: k or max_new_tokens < 1, or rows that do not fit ``state.max_len`` with k (as :class:`Engine`).
    """
    if k < 1 or max_new_tokens < 1:
        raise ConfigError(f"k and max_new_tokens must be >= 1, got k = {k}, max_new_tokens = {max_new_tokens}")
    engine = Engine(target, draft, k=k, max_running=len(state.rows), max_len=state.max_len)
    engine.round_hook = round_hook
    ids = engine.add_prefilled(state, [RequestParams(max_new_tokens, params.temperature, params.top_k, params.top_p,
                                                     seed + i, min_p=params.min_p) for i in range(len(state.rows))])
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
