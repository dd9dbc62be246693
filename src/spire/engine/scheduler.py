"""The engine's scheduler, pure Python (no torch): the waiting queue, the slots, aborts and the prefill budget.

Each :meth:`Scheduler.schedule` returns a :class:`StepPlan` (vLLM v1's ``Scheduler.schedule()`` is the model):
the requests it aborted, the requests that took free slots, the prefill pieces to run (with ``prefill_chunk``, at
most that many prompt tokens per step), the requests that run a round, the rows [0, width) the round computes and
the round's k. :class:`~spire.engine.runner.Runner` executes the plan; :meth:`Scheduler.update_from_output` commits
its round back here (the one writer of what a round changes: the requests' emitted tokens, the stats, the round
policy's feedback, the slots of finished requests).

A request's committed length (its tokens in the target cache plus its pending token) is known here without reading
a tensor: the prompt and the tokens it emitted once it runs, ``prefilled + 1`` while it prefills
(:attr:`Request.committed`). So k near the end of a slot and the k policy's context cost no device sync.

The round's draft tokens are chosen in two parts: :meth:`Scheduler.schedule` caps k (near the end of a slot a round
drafts fewer tokens), then :meth:`Scheduler.choose_round` asks the round policy, per running request, which of the
engine's drafts proposes and how many tokens (a :class:`RoundChoice`), given which drafts have a proposal for
which request (the n-gram lookup's matches, read by the runner). Without a policy every request drafts the cap with
the first draft that proposes for it.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from spire.engine.output import PROMPT_CONTEXT, TextStream, cut_request
from spire.errors import ConfigError
from spire.params import LogitsProcessing, RequestParams, SamplingParams


@dataclass
class RequestOutput:
    """What one engine step gives a request: its new tokens this step (after the cut), whether it finished, with
    finish_reason "stop" (EOS or a stop string), "length" (max_tokens) or "abort", and how many of the round's k
    draft tokens verification accepted (None when it ran no round).

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
    position j (j = 1..k); rounds_by_k[i]: rounds of depth i (the most any request drafted; i = 0: AD); finished:
    requests ended, by reason. By draft (its name; "none" for a request that drafted nothing in a round):
    row_rounds_by_draft[name][i]: row-rounds in which a request drafted i tokens with it;
    accepted_by_draft[name][i]: row-rounds in which it drafted and verification accepted i of its tokens;
    without_proposal[name]: row-rounds in which it had no proposal for the request (the n-gram lookup found no
    match; counted in rounds where some draft could draft), so that "no match" and "the policy chose not to draft"
    are told apart."""

    k: int
    rounds: int = 0
    row_rounds: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    rounds_by_k: list[int] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=dict)
    row_rounds_by_draft: dict[str, list[int]] = field(default_factory=dict)
    accepted_by_draft: dict[str, list[int]] = field(default_factory=dict)
    without_proposal: dict[str, int] = field(default_factory=dict)

    def count_row(self, draft: str | None, k: int, accepted: int | None) -> None:
        """One request's share of a round: it drafted k tokens with ``draft`` (None or k = 0: none) and ``accepted``
        of them were accepted (None: an AD round)."""
        name = draft if draft and k else "none"
        self.row_rounds_by_draft.setdefault(name, [0] * (self.k + 1))[k] += 1
        if name != "none" and accepted is not None:
            self.accepted_by_draft.setdefault(name, [0] * (self.k + 1))[accepted] += 1

    def draft_acceptance(self, draft: str) -> list[float]:
        """:meth:`acceptance` of the row-rounds that drafted with ``draft``: element j-1 is the share of those that
        drafted a token at position j which accepted it (0 where none did)."""
        acc, rows = self.accepted_by_draft.get(draft, []), self.row_rounds_by_draft.get(draft, [])
        reached = [sum(rows[j:]) for j in range(1, self.k + 1)] if rows else [0] * self.k
        return [sum(acc[j:]) / max(1, reached[j - 1]) for j in range(1, self.k + 1)]

    def draft_tau(self, draft: str) -> float:
        """Tokens per row-round (bonus included, before a request's budget or stop cuts them) over the row-rounds
        that drafted with ``draft``: 1 + their mean accepted count (0 where none did)."""
        acc = self.accepted_by_draft.get(draft, [])
        n = sum(acc)
        return sum((i + 1) * c for i, c in enumerate(acc)) / n if n else 0.0

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
class RoundChoice:
    """What one round drafts. k: the round's depth, the most any request drafts (the target verifies k + 1 positions
    of every row; 0: an AD round); drafts[i]: the index, in the engine's drafts, of the draft that proposes for the
    i-th running request of the plan (None: it drafts nothing); ks[i]: how many of the k drafted tokens it may
    accept (0..k; 0 when drafts[i] is None). Rows of one round may so draft different k, 0 for some."""

    k: int
    drafts: list[int | None]
    ks: list[int]

    @classmethod
    def uniform(cls, n: int, k: int, draft: int | None = 0) -> "RoundChoice":
        """Every one of n requests drafts k tokens with the same draft (k = 0: an AD round)."""
        return cls(k, [draft if k else None] * n, [k] * n)

    @property
    def used(self) -> list[int]:
        """The drafts that propose for some request this round (each runs its k steps over the batch)."""
        return sorted({d for d, k in zip(self.drafts, self.ks) if d is not None and k})


@dataclass
class RoundOutput:
    """What the runner gives back of one round (vLLM v1's ``ModelRunnerOutput``), torch-free, one entry per running
    request of the plan, in its order: accepted: the draft tokens verification accepted; tokens: the accepted ones and
    the recovered or bonus one (before any cut); logprobs: per token (logprob, top n) when the request asked, else
    None; prompt_logprobs: in a request's first round, its prompt tokens' (when asked), else None; seconds: the
    round's wall time (drafting, verifying and the read of its result)."""

    accepted: list[int]
    tokens: list[list[int]]
    logprobs: list[list | None]
    prompt_logprobs: list[list | None]
    seconds: float = 0.0


@dataclass(eq=False)
class Request:
    """A request's state, the scheduler's: its prompt, settings, output processor (``stop``: its
    :class:`~spire.engine.output.TextStream` when it has stop strings), emitted tokens and slot (None while it
    waits). prefilled: prompt tokens in its slot's caches (the prompt but its last token, once prefilled). The
    runner's per-request state (generator, token history, prompt logprobs) is the runner's own table
    (:class:`~spire.engine.runner.RowState`)."""

    id: int
    prompt: list[int]
    params: RequestParams
    stop: TextStream | None
    sampling: SamplingParams
    proc: LogitsProcessing
    emitted: list[int] = field(default_factory=list)
    slot: int | None = None
    prefilled: int = 0

    @property
    def special(self) -> bool:
        """Whether its rows need more than the raw argmax: it samples, processes logits, or wants logprobs."""
        return not self.sampling.greedy or self.proc.active or self.params.logprobs is not None

    @property
    def prefilling(self) -> bool:
        """Whether it holds a slot whose prompt is not yet prefilled (it runs no round of its own yet)."""
        return self.slot is not None and self.prefilled < len(self.prompt) - 1

    @property
    def committed(self) -> int:
        """Its slot's committed length n (tokens in the cache + the pending one): a round writes positions
        n - 1 .. n - 1 + k."""
        return self.prefilled + 1 if self.prefilling else len(self.prompt) + len(self.emitted)


Piece = tuple[Request, int, int]
"""A prefill piece: (request, first prompt position, tokens)."""


@dataclass
class StepPlan:
    """One step, decided before any tensor is touched. aborted: requests ended by :meth:`Scheduler.abort` (their
    slots in ``freed``); joiners: requests that took free slots this step; width: the round and prefills run on
    rows [0, width) (0: nothing to run); starts: groups of pieces that start a prompt, each group one right-padded
    batch (:func:`prefill_groups`), pieces of the same tokens computed once; continues: (requests, first position,
    tokens) of a piece that continues a prompt, the same tokens for every request of it; running: requests whose
    prompt is prefilled, which run this step's round; k: the round's draft tokens per row (0: an AD round); choice:
    what each running request drafts (:meth:`Scheduler.choose_round`); prefilled: a batch prefilled elsewhere
    (:class:`~spire.engine.prefill.Prefilled`) whose rows are the joiners, copied into their slots (an admission
    plan, :meth:`Scheduler.admit`), else None; prefilling: the requests in slots whose prompts are still being
    prefilled after this step's pieces (they wait on the steps to come)."""

    aborted: list[Request] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    joiners: list[Request] = field(default_factory=list)
    width: int = 0
    starts: list[list[Piece]] = field(default_factory=list)
    continues: list[tuple[list[Request], int, int]] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    k: int = 0
    choice: RoundChoice | None = None
    prefilled: Any = None
    prefilling: int = 0


class Scheduler:
    """Queue and slots of an engine of ``max_running`` slots of ``max_len`` positions (see the module docstring).

    k: the most draft tokens per round (0: AD); k_policy: the round policy, an object with ``choose(plan, width,
    proposes) -> RoundChoice`` and ``update(plan, accepted, seconds)`` (:mod:`spire.serving.policy`), or one with
    ``k_for(batch, context) -> int`` and ``observe(accepted, k)`` (one k for every request), or None; narrows: whether rounds may run on rows
    [0, highest occupied slot] only (the draft's ``use_rows``); prefill_chunk: prompt tokens prefilled per step at
    most (None: whole prompts); widths: the only widths a round may run at, ascending (a narrowed width is rounded
    up to the next, the rows past the occupied ones running as free slots do: a GPU captures one CUDA graph per
    width, as vLLM pads its batch to its capture sizes); None: any width. Thread-safe for :meth:`add`, :meth:`abort` and the counters; the rest runs on the
    stepping thread."""

    def __init__(self, max_running: int, max_len: int, k: int, k_policy=None, narrows: bool = True,
                 prefill_chunk: int | None = None, draft_names: Sequence[str] = (),
                 widths: Sequence[int] | None = None) -> None:
        if widths is not None and (not widths or list(widths) != sorted(set(widths)) or widths[0] < 1
                                   or widths[-1] != max_running):
            raise ConfigError(f"widths must ascend from >= 1 to max_running ({max_running}), got {list(widths)}")
        self.widths = None if widths is None else list(widths)
        self.max_running, self.max_len, self.k, self.draft_names = max_running, max_len, k, list(draft_names)
        self.k_policy, self.narrows, self.prefill_chunk = k_policy, narrows, prefill_chunk
        self.slots: list[Request | None] = [None] * max_running
        self.waiting: deque[Request] = deque()
        self.stats = EngineStats(max(k, 1))
        self._ids = itertools.count()
        self._aborts: set[int] = set()
        self._lock = threading.Lock()

    # ---- requests ----------------------------------------------------------------------------------------

    def new_request(self, prompt_ids: Sequence[int], params: RequestParams, vocab: int, eos_ids=(),
                    decode: Callable[[list[int]], str] | None = None, text: TextStream | None = None) -> Request:
        """A validated request with the next id (not queued). Its stop strings are checked on ``text`` (the
        caller's output processor of this request, e.g. the server's, which then reads what the check decoded) or
        on a :class:`TextStream` of ``decode`` in the prompt's context. Raises ConfigError naming the field: prompt
        (empty, ids outside [0, vocab), too long for a slot with max_tokens), stop_token_ids, logit_bias, stop."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ConfigError("prompt: empty (a request needs at least one token)")
        if any(not 0 <= t < vocab for t in prompt):
            raise ConfigError(f"prompt: token ids must be in [0, {vocab}) (the target's vocabulary)")
        if len(prompt) > self.max_len - params.max_tokens:
            raise ConfigError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the context "
                              f"of {self.max_len} positions per slot")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ConfigError(f"stop_token_ids: token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise ConfigError(f"logit_bias: token ids must be in [0, {vocab})")
        if params.stop and decode is None and text is None:
            raise ConfigError("stop: stop strings need the engine's decode (a tokenizer)")
        if params.stop and any(not st for st in params.stop):
            raise ConfigError("stop strings must be non-empty")
        stop = None
        if params.stop:
            stop = text if text is not None else TextStream(
                decode, tuple(params.stop), prompt=prompt[-PROMPT_CONTEXT:], min_tokens=params.min_tokens)
        with self._lock:
            rid = next(self._ids)
        return Request(rid, prompt, params, stop, params.sampling(), params.processing(eos_ids))

    def add(self, reqs: Sequence[Request]) -> None:
        """Queue requests (together: the n choices of one prompt join at the same step when slots are free)."""
        with self._lock:
            self.waiting.extend(reqs)

    def admit(self, reqs: Sequence[Request], prefilled: Any = None) -> StepPlan:
        """An admission plan: the requests, whose prompts were prefilled elsewhere (``prefilled``, the batch, row i
        for ``reqs[i]``), take the lowest free slots now as running requests (all but each prompt's last token
        prefilled). The runner runs it as a step's joins (:meth:`Engine.add_prefilled`). Raises ConfigError when
        fewer slots are free."""
        free = [s for s in range(self.max_running) if self.slots[s] is None]
        if len(free) < len(reqs):
            raise ConfigError(f"add_prefilled: {len(reqs)} rows, {len(free)} free slots")
        for req, s in zip(reqs, free):
            req.slot, self.slots[s] = s, req
            req.prefilled = len(req.prompt) - 1
        self.stats.prompt_tokens += sum(len(r.prompt) for r in reqs)
        return StepPlan(joiners=list(reqs), width=self.width(), prefilled=prefilled)

    def abort(self, request_id: int) -> None:
        """End a waiting or running request at the next step; unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.add(request_id)

    def release(self, req: Request, reason: str) -> int | None:
        """A request ended ("stop", "length" or "abort"): its slot is free again. Returns the slot it held."""
        slot, req.slot = req.slot, None
        if slot is not None:
            self.slots[slot] = None
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        return slot

    def waiting_ids(self) -> list[int]:
        """The ids of the queued requests, oldest first (thread-safe)."""
        with self._lock:
            return [r.id for r in self.waiting]

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def has_work(self) -> bool:
        return bool(self.waiting or self._aborts or self.num_running)

    def width(self) -> int:
        """The rows a round computes: one past the highest occupied slot (all slots when rounds cannot narrow),
        rounded up to the next of :attr:`widths` when they are set."""
        occupied = [r.slot for r in self.slots if r is not None]
        if not occupied:
            return 0
        w = max(occupied) + 1 if self.narrows else self.max_running
        return w if self.widths is None else next(x for x in self.widths if x >= w)

    # ---- the plan ----------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Apply aborts, move waiting requests into free slots (lowest first), choose this step's prefill pieces
        (their requests' ``prefilled`` advances: the runner must run them) and the round's requests and k."""
        plan = StepPlan()
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            waited = [r for r in self.waiting if r.id in aborts]
            self.waiting = deque(r for r in self.waiting if r.id not in aborts)
        ran = [r for r in self.slots if r is not None and r.id in aborts]
        plan.aborted = waited + ran
        plan.freed = [self.release(r, "abort") for r in ran]
        for req in waited:
            self.release(req, "abort")
        with self._lock:
            for s in range(self.max_running):
                if self.slots[s] is None and self.waiting:
                    req = self.waiting.popleft()
                    req.slot, self.slots[s] = s, req
                    plan.joiners.append(req)
        self.stats.prompt_tokens += sum(len(r.prompt) for r in plan.joiners)
        plan.width = self.width()
        if plan.width:
            self._plan_prefill(plan, [r for r in self.slots if r is not None and r.prefilling])
            plan.running = [r for r in self.slots if r is not None and not r.prefilling]
            plan.prefilling = sum(1 for r in self.slots if r is not None and r.prefilling)
            plan.k = self._round_k(plan.running, plan.width) if plan.running else 0
        return plan

    def _plan_prefill(self, plan: StepPlan, todo: list[Request]) -> None:
        """The prefill pieces of the slots still prefilling, oldest request first, each taking at most what is left
        of ``prefill_chunk`` tokens. Requests that start (or continue) the same prompt at the same place share one
        piece, charged once to the budget: the n choices of one API request."""
        budget = self.prefill_chunk
        starts: dict[tuple, list] = {}  # a starting piece's prompt -> [n, its requests]
        later: dict[tuple, list] = {}  # a continuing piece's (prompt, start) -> [n, its requests]
        for req in sorted(todo, key=lambda r: r.id):
            n = len(req.prompt) - 1 - req.prefilled
            pieces, key = (later, (tuple(req.prompt), req.prefilled)) if req.prefilled else (starts, tuple(req.prompt))
            if key in pieces:
                pieces[key][1].append(req)
                continue
            if budget is not None:
                if budget <= 0:
                    break
                n = min(n, budget)
                budget -= n
            pieces[key] = [n, [req]]
        unique = list(starts.values())
        plan.starts = [[(req, 0, unique[i][0]) for i in group for req in unique[i][1]]
                       for group in prefill_groups([n for n, _ in unique])]
        plan.continues = [(reqs, reqs[0].prefilled, n) for n, reqs in later.values()]
        for n, reqs in list(starts.values()) + list(later.values()):
            for req in reqs:
                req.prefilled += n

    def _round_k(self, running: list[Request], width: int) -> int:
        """The most draft tokens the round may have: k, fewer near the end of a slot (a round writes positions up to
        n - 1 + k, which must stay below max_len, for every row it computes)."""
        k = self.k
        if k:
            top = max((r.committed for r in self.slots[:width] if r is not None), default=1)
            k = max(0, min(k, self.max_len - top))
        return k

    def choose_round(self, plan: StepPlan, proposes: Sequence[Sequence[bool] | None] = ()) -> RoundChoice:
        """Fill ``plan.choice``: what the round drafts for each running request, within ``plan.k``.

        proposes: per draft of the engine, whether it has a proposal for each running request (None: always), as
        :meth:`~spire.engine.runner.Runner.proposes` reads it. The policy decides (:attr:`k_policy`); a policy of
        the older protocol (``k_for``) gives one k to every request, drafted by the first draft; without a policy
        every request drafts ``plan.k`` with the first draft that proposes for it (the last one where none does).
        Returns the choice (also set on the plan)."""
        n, cap = len(plan.running), plan.k
        for name, p in zip(self.draft_names, proposes):
            if p is not None:
                self.stats.without_proposal[name] = self.stats.without_proposal.get(name, 0) + p.count(False)
        if not cap or not n:
            choice = RoundChoice.uniform(n, 0)
        elif self.k_policy is not None and hasattr(self.k_policy, "choose"):
            choice = self.k_policy.choose(plan, plan.width, proposes)
            if choice.k > cap or len(choice.ks) != n or any(not 0 <= k <= choice.k for k in choice.ks):
                raise ValueError(f"round policy chose k {choice.k} (ks {choice.ks}) for a cap of {cap} and {n} rows")
            if not choice.used:  # nobody drafts: an AD round (one position per row, not k + 1)
                choice = RoundChoice.uniform(n, 0)
        elif self.k_policy is not None:
            context = sum(r.committed for r in plan.running) / n
            choice = RoundChoice.uniform(n, min(max(int(self.k_policy.k_for(n, context)), 0), cap))
        else:
            last = max(0, len(proposes) - 1)
            drafts = [next((d for d, p in enumerate(proposes) if p is None or p[i]), last) for i in range(n)]
            choice = RoundChoice(cap, drafts, [cap] * n)
        plan.choice = choice
        return choice

    def update_from_output(self, plan: StepPlan, output: RoundOutput) -> list[RequestOutput]:
        """The round of ``plan`` ran (``output``, the runner's): the one place its results are written. Each running
        request's share is cut at its budget, EOS, stop token ids and stop strings (:func:`cut_request`) and
        emitted, the stats count the round, the round policy learns from it (``update`` or ``observe``: the
        accepted counts and the round's wall time), finished requests give their slots back (:meth:`release`).
        Returns one :class:`RequestOutput` per running request, in the plan's order."""
        choice, st = plan.choice, self.stats
        st.rounds += 1
        st.rounds_by_k[choice.k] += 1
        policy = self.k_policy
        if policy is not None and hasattr(policy, "update"):
            policy.update(plan, output.accepted, output.seconds)
        elif policy is not None and choice.k:
            policy.observe(list(output.accepted), choice.k)
        outputs = []
        for i, req in enumerate(plan.running):
            k = choice.ks[i]
            name = self.draft_names[choice.drafts[i]] if k else None
            out = self._emit(req, output.tokens[i], output.accepted[i] if k else None, k, name)
            out.logprobs = None if output.logprobs[i] is None else output.logprobs[i][: len(out.new_tokens)]
            out.prompt_logprobs = output.prompt_logprobs[i]
            if out.finished:
                self.release(req, out.finish_reason)
            outputs.append(out)
        return outputs

    def _emit(self, req: Request, toks: list[int], n_accepted: int | None, k: int, draft: str | None
              ) -> RequestOutput:
        """A running request's tokens of the round, cut, emitted and counted; k: the tokens it drafted with the
        draft named ``draft``."""
        p, st, eos = req.params, self.stats, set(req.proc.banned)
        toks, stopped = cut_request(req.emitted, toks, p.max_tokens, eos, req.stop, p.min_tokens)
        req.emitted.extend(toks)
        st.row_rounds += 1
        st.generated_tokens += len(toks)
        if n_accepted is not None and k:
            st.accepted[n_accepted] += 1
            for j in range(k):
                st.drafted[j] += 1
        st.count_row(draft, k, n_accepted)
        reason = "stop" if stopped else "length" if len(req.emitted) >= p.max_tokens else None
        stop_token = toks[-1] if stopped and toks and toks[-1] in eos else None
        return RequestOutput(req.id, toks, reason is not None, reason, n_accepted, stop_token)


def draft_sets(n: int) -> list[tuple[int, ...]]:
    """The sets of drafts a round may run, of n drafts (indices): every non-empty subset for up to 3, else each one
    alone and all together."""
    if n <= 3:
        return [c for r in range(1, n + 1) for c in itertools.combinations(range(n), r)]
    return [(d,) for d in range(n)] + [tuple(range(n))]


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
