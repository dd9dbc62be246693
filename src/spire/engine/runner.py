"""The engine's runner: executes a :class:`~spire.engine.scheduler.StepPlan` on the target and the draft.

The target cache is ``max_running`` rows (slots) of ``max_len`` positions, and the draft is started once on that
batch (:meth:`~spire.drafts.base.Draft.start`). Per slot the runner keeps the committed length ``n`` and the pending
token (the last committed one, the next round's first input). It runs:

- the prefill pieces: a piece that starts a prompt runs in a right-padded batch on a cache of its own, whose keys
  and values are copied into the slots' rows; a piece that continues a prompt runs on its slot's row; the draft
  observes each (the other rows masked out);
- **one round** over the rows [0, width) (:meth:`Runner.round`, a :class:`~spire.engine.scheduler.RoundChoice`):
  each draft that proposes for some row runs its k steps over the batch, each row takes the tokens of its own draft,
  the target verifies k + 1 positions in one forward, and :func:`_accept` keeps a prefix per row of at most the
  row's own k_i tokens (greedy rows by argmax, sampled rows by rejection sampling with their own transform and
  generator, :mod:`spire.verification`); every draft then observes the verified positions;
- the commit of the round's positions (:meth:`Runner.advance`) and the :func:`rollback` of rejected ones.

A free slot below width runs a dummy token at positions 0..k, which the next request in that slot overwrites (its
prefill, then its rounds) before anything reads it. A slot still prefilling runs the round as a dummy at its next
unprefilled position: the round writes only positions its next piece (or its first round) overwrites before any
query of the row reads them, as a rejected draft token's entries are (the cache invariant of
:mod:`spire.engine.prefill`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from spire.drafts.base import Draft
from spire.engine.deferred import DeferredObserves
from spire.engine.prefill import Prefilled, observe_prefill, prefill, rows_of, start_draft
from spire.engine.scheduler import Piece, Request, RequestOutput, RoundChoice, RoundOutput
from spire.errors import ConfigError
from spire.kv_cache import KVCache, Span
from spire.model import ForwardOutput, Transformer
from spire.sampling import TokenHistory, logprobs_from_logits, probs_from_logits, process_logits, sample
from spire.verification import output_tokens, verify, verify_greedy


@dataclass
class RoundTrace:
    """What :attr:`Runner.round_hook` sees of one SD round over slots [0, S): rows: (slot, sampling, tokens it may
    still emit) of each running request (other rows are dummies); pos0 (S,): each slot's pending position (the
    first drafted token is at pos0 + 1); draft_tokens (S, k); draft_logits (S, k, V) float32 (the draft's raw
    logits, before any sampling transform); target_logits (S, k + 1, V); n_accepted (S,)."""

    rows: list[tuple]
    pos0: torch.Tensor
    draft_tokens: torch.Tensor
    draft_logits: torch.Tensor
    target_logits: torch.Tensor
    n_accepted: torch.Tensor


@dataclass
class RowState:
    """The runner's own state of one request (vLLM v1's ``CachedRequestState``), in :attr:`Runner.requests` from
    the step it joins until it finishes: generator (its torch.Generator, seeded, or a fresh random seed), history
    (its :class:`~spire.sampling.TokenHistory` when a penalty is on, else None), prompt_lp (its prompt tokens'
    logprobs, gathered while it prefills, when it asked for them, given with its first round; else None)."""

    generator: torch.Generator
    history: TokenHistory | None = None
    prompt_lp: list | None = None
    tokens: np.ndarray | None = None
    """Its tokens on the host (prompt, then emitted), filled as far as a draft that looks them up has asked
    (:meth:`context`; the n-gram lookup), in a buffer that doubles when full."""
    n_tokens: int = 0

    def context(self, req: Request) -> np.ndarray:
        """(n,) int64, the request's tokens 0..n - 1 (prompt + emitted, the pending one last): a view of
        :attr:`tokens`, extended by the tokens emitted since the last call only."""
        P, total = len(req.prompt), len(req.prompt) + len(req.emitted)
        if self.tokens is None or len(self.tokens) < total:
            grown = np.empty(max(2 * total, 64), dtype=np.int64)
            if self.tokens is not None:
                grown[: self.n_tokens] = self.tokens[: self.n_tokens]
            self.tokens = grown
        if self.n_tokens < P:
            self.tokens[self.n_tokens: P] = req.prompt[self.n_tokens:]
            self.n_tokens = P
        if self.n_tokens < total:
            self.tokens[self.n_tokens: total] = req.emitted[self.n_tokens - P:]
            self.n_tokens = total
        return self.tokens[:total]


def rollback(n: torch.Tensor, live: torch.Tensor, n_accepted: torch.Tensor) -> torch.Tensor:
    """The committed lengths after a round: a live row keeps its n_accepted draft tokens and the recovered or bonus
    token (n + n_accepted + 1); its rejected draft tokens are rolled back by not counting them (their cache entries
    lie past n - 1 and are overwritten before any query reads them). Rows not live stay put. n, live,
    n_accepted: (S,)."""
    return torch.where(live, n + n_accepted + 1, n)


class Runner:
    """The target, the drafts and their caches over ``max_running`` slots of ``max_len`` positions.

    drafts: unstarted :class:`Draft` s (started here, the one place an engine starts one; several: a portfolio,
    each round's rows drafting with the one the round choice names), or none for AD. Raises ConfigError for a draft
    that cannot restart single rows (continuous batching)."""

    def __init__(self, target: Transformer, drafts: Sequence[Draft], k: int, max_running: int, max_len: int) -> None:
        self.target, self.drafts = target, list(drafts)
        dev = target.device
        self.cache = target.new_cache(max_running, max_len)
        self.narrows = True
        for draft in self.drafts:
            start_draft(draft, target, k, self.cache)
            draft.restart_rows(torch.arange(max_running, device=dev))  # refuses a draft that cannot
            self.narrows = draft.use_rows(max_running) and self.narrows
        # the target layers any draft reads (prefill and verify keep them), in order
        self.reads = tuple(sorted({j for d in self.drafts for j in d.hidden_layers}))
        self.width, self._cache_w = max_running, self.cache  # rows [0, width) run; the target cache's view
        self.n = torch.ones(max_running, dtype=torch.long, device=dev)  # (S,) committed length per slot
        self.n_host = [1] * max_running  # the same, on the host: a round's positions go down as a Span from it
        self.pending = torch.zeros(max_running, dtype=torch.long, device=dev)  # (S,) the pending token per slot
        self.round_hook: Callable[[RoundTrace], object] | None = None  # sees every SD round (spire tau --diagnose)
        self.requests: dict[int, RowState] = {}  # request id -> its RowState, from its join until it ends
        self._last: tuple | None = None  # the last round's n_accepted, next token and slots, until its commit
        self.deferred = DeferredObserves(self.drafts)  # AD rounds' commits the drafts that defer take later

    def _attach(self, req: Request) -> None:
        """The request's :class:`RowState` in :attr:`requests`."""
        gen = torch.Generator()
        if req.params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(req.params.seed))
        history = TokenHistory(req.prompt, self.target.cfg.vocab_size, self.n.device) if req.proc.penalized else None
        self.requests[req.id] = RowState(gen, history, [] if req.params.prompt_logprobs is not None else None)

    def narrow(self, w: int) -> None:
        """Run the next rounds on rows [0, w): the target cache's view and the draft's rows."""
        if w and w != self.width:
            self.deferred.replay()  # the deferred observes are over the rows of the old width
            self.width, self._cache_w = w, self.cache.narrow(w)
            for draft in self.drafts:
                draft.use_rows(w)

    def join(self, joiners: Sequence[Request]) -> None:
        """Requests that just took slots: their :class:`RowState` is made, the draft forgets those rows, and each
        slot's pending token is its prompt's first (its dummy rounds, while it prefills, write only positions its
        prefill overwrites)."""
        if not joiners:
            return
        for req in joiners:
            self._attach(req)
        slots = torch.tensor([r.slot for r in joiners], device=self.n.device)
        self.deferred.forget_rows(slots)
        for draft in self.drafts:
            draft.restart_rows(slots)
        self.n[slots] = 1  # a one-token prompt has nothing to prefill: this is its state after the prefill too
        for req in joiners:
            self.n_host[req.slot] = 1
        self.pending[slots] = torch.tensor([r.prompt[0] for r in joiners], device=self.n.device)

    def prefilled(self, req: Request, upto: int) -> None:
        """Positions < upto of the request's prompt are in its slot's caches: its pending token is the next."""
        self.n[req.slot] = self.n_host[req.slot] = upto + 1
        self.pending[req.slot] = req.prompt[upto]

    def add_prefilled(self, state: Prefilled, reqs: Sequence[Request]) -> None:
        """Copy a batch prefilled elsewhere (:func:`check_prefilled`) into the requests' slots (row i to
        ``reqs[i].slot``), let the draft observe it, and make each slot's pending token its prompt's last."""
        slots = torch.tensor([r.slot for r in reqs], device=self.n.device)
        if state.out is not None:
            self._copy_kv(slots, state.cache, state.tokens.shape[1])
            if self.drafts:
                observe_prefill(self.drafts, self.reads, self.width, slots, state.tokens, state.pos, state.valid,
                                state.out, [len(r.prompt) - 2 for r in reqs])
        for req in reqs:
            self.prefilled(req, len(req.prompt) - 1)

    # ---- prefill pieces ------------------------------------------------------------------------------------

    def prefill_start(self, pieces: Sequence[Piece]) -> None:
        """Prompt tokens 0..n-1 of each (request, 0, n), as one right-padded batch on a fresh cache; pieces of the
        same tokens are one row of it, copied into each of their slots."""
        dev = self.n.device
        slots = torch.tensor([r.slot for r, _, _ in pieces], device=dev)
        rows, index, src = [], {}, []
        for r, _, n in pieces:
            key = tuple(r.prompt[: n + 1])
            if key not in index:
                index[key] = len(rows)
                rows.append(list(key))
            src.append(index[key])
        span = max(n for _, _, n in pieces)
        final = any(r.params.prompt_logprobs is not None for r, _, _ in pieces)
        state = prefill(self.target, rows, span, self._hidden(final))
        shared = len(rows) < len(pieces)
        at = torch.tensor(src, device=dev)
        self._copy_kv(slots, state.cache, span, at if shared else None)
        out = rows_of(state.out, at) if shared else state.out
        if self.drafts:
            observe_prefill(self.drafts, self.reads, self.width, slots, state.tokens[at], state.pos[at],
                            state.valid[at], out, [len(r.prompt) - 2 for r, _, _ in pieces])
        for i, (req, _, n) in enumerate(pieces):
            if req.params.prompt_logprobs is not None and n:
                h = state.out.hidden[self.target.cfg.n_layers][src[i]: src[i] + 1, :n]
                self.requests[req.id].prompt_lp.extend(prompt_logprobs(self.target, req, h, 0))
            self.prefilled(req, n)

    def prefill_continue(self, reqs: Sequence[Request], s0: int, n: int) -> None:
        """Prompt tokens s0..s0+n-1 of ``reqs`` (the same tokens for each: the n choices of one prompt), run on the
        first one's slot row, its keys / values copied into the others' rows."""
        req, dev = reqs[0], self.n.device
        tokens = torch.tensor([req.prompt[s0: s0 + n]], device=dev)
        pos = torch.arange(s0, s0 + n, device=dev)[None]
        out = self.target(tokens, pos, self.cache.row(req.slot),
                          hidden_layers=self._hidden(any(r.params.prompt_logprobs is not None for r in reqs)))
        slots = torch.tensor([r.slot for r in reqs], device=dev)
        if len(reqs) > 1:  # the same tokens at the same positions in the other slots: copy the keys / values
            for c in (*self.cache.k, *self.cache.v):
                c[slots[1:], :, s0: s0 + n] = c[req.slot, :, s0: s0 + n]
            at = torch.zeros(len(reqs), dtype=torch.long, device=dev)
            out, tokens, pos = rows_of(out, at), tokens[at], pos[at]
        if self.drafts:
            observe_prefill(self.drafts, self.reads, self.width, slots, tokens, pos, None, out,
                            [len(r.prompt) - 2 for r in reqs])
        for i, r in enumerate(reqs):
            if r.params.prompt_logprobs is not None:
                h = out.hidden[self.target.cfg.n_layers][i: i + 1]
                self.requests[r.id].prompt_lp.extend(prompt_logprobs(self.target, r, h, s0))
            self.prefilled(r, s0 + n)

    def _hidden(self, final: bool) -> tuple[int, ...]:
        """The target layers a prefill keeps: the drafts', and the final residual stream when ``final``."""
        return self.reads + (self.target.cfg.n_layers,) if final else self.reads

    def _copy_kv(self, slots: torch.Tensor, cache: KVCache, span: int, rows: torch.Tensor | None = None) -> None:
        """Keys / values of positions < span from ``cache`` (its rows ``rows``, default all) into ``slots``."""
        for dst, src in zip((*self.cache.k, *self.cache.v), (*cache.k, *cache.v)):
            dst[slots, :, :span] = src[:, :, :span] if rows is None else src[rows, :, :span]

    # ---- one round -------------------------------------------------------------------------------------------

    def proposes(self, running: Sequence[Request]) -> list[list[bool] | None]:
        """Per draft, whether it has a proposal for each running request's next position (None: it always has one;
        the n-gram lookup has one only where the context matches, :meth:`Draft.proposes`). Read before the round
        so that the round policy can give a request without one to another draft, or none."""
        looks = [type(d).proposes is not Draft.proposes for d in self.drafts]  # the others always propose
        if not any(looks):
            return [None] * len(self.drafts)
        pending, pos0 = self.pending[: self.width], self.n[: self.width] - 1
        at = Span([n - 1 for n in self.n_host[: self.width]], 1)
        contexts: list = [None] * self.width  # each row's tokens 0..pos0, as the host has them
        for r in running:
            st = self.requests.get(r.id)
            contexts[r.slot] = st.context(r) if st is not None else np.asarray(r.prompt + r.emitted, dtype=np.int64)
        out = []
        for draft, look in zip(self.drafts, looks):
            if not look:
                out.append(None)
                continue
            p = draft.proposes(pending[:, None], pos0[:, None], span=at, contexts=contexts)
            if isinstance(p, torch.Tensor):
                p = p.tolist()  # a draft that looks on the device: one more read
            out.append(None if p is None else [bool(p[r.slot]) for r in running])
        return out

    def round(self, running: Sequence[Request], choice: RoundChoice | int) -> RoundOutput:
        """:meth:`run_round`, read back (the round's one read of the device) as the scheduler's
        :class:`~spire.engine.scheduler.RoundOutput`: per running request its accepted count, its tokens, their
        logprobs (when asked) and, in its first round, its prompt's; seconds: the round's wall time. The round is
        committed by :meth:`commit`."""
        watch = time.perf_counter()
        n_acc, next_tok, block, lps = self.run_round(running, choice)
        both = torch.cat([n_acc[:, None], block], 1).tolist()  # the round's one read of the device
        accepted, block_l = [row[0] for row in both], [row[1:] for row in both]  # per slot
        seconds = time.perf_counter() - watch
        self._last = (n_acc, next_tok, {r.id: r.slot for r in running}, accepted)
        prompt = [self.requests[r.id].prompt_lp if r.id in self.requests else None for r in running]
        for r in running:  # a request's prompt logprobs come with its first round
            if r.id in self.requests:
                self.requests[r.id].prompt_lp = None
        return _round_output(running, accepted, block_l, lps, prompt, seconds)

    def commit(self, outputs: Sequence[RequestOutput]) -> None:
        """Commit the last :meth:`round`, cut by the scheduler (``outputs``): the token histories take the tokens,
        finished requests' slots are freed and their state dropped, the others :meth:`advance`."""
        n_acc, next_tok, slot_of, accepted = self._last
        self._last = None
        live, freed = [], []
        for out in outputs:
            st = self.requests.get(out.request_id)
            if st is not None and st.history is not None:
                st.history.add(out.new_tokens)
            if out.finished:
                self.requests.pop(out.request_id, None)
                freed.append(slot_of[out.request_id])
            else:
                live.append(slot_of[out.request_id])
        self.advance(live, freed, n_acc, next_tok, accepted)

    def free(self, slots: Sequence[int], request_ids: Sequence[int]) -> None:
        """Aborted requests: their state is dropped and their slots go back to length 1."""
        for rid in request_ids:
            self.requests.pop(rid, None)
        self.advance((), slots)

    def run_round(self, running: Sequence[Request], choice: RoundChoice | int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """One round over the slots [0, width) (S of them): ``choice`` says its depth k (0: AD), and per running
        request the draft that proposes for it and how many of its k tokens it may accept (an int: every request
        drafts that many with the first draft). Returns n_accepted (S,), next_token (S,), the output block (S, k+1)
        and, per slot of a request that asked for logprobs, its (k+1, V) log-probabilities at the round's
        positions."""
        if isinstance(choice, int):
            choice = RoundChoice.uniform(len(running), choice if self.drafts else 0)
        k = choice.k
        special = [(r, self.requests[r.id]) for r in running if r.special]
        cache, pending, pos0 = self._cache_w, self.pending[: self.width], self.n[: self.width] - 1
        starts = [n - 1 for n in self.n_host[: self.width]]  # pos0 on the host: no forward reads a position back
        if not self.drafts or k == 0:
            at = Span(starts, 1)
            out = self.target(pending[:, None], pos0[:, None], cache, hidden_layers=self.reads, span=at)
            next_tok, _, rows = _choose(out.logits[:, -1], special, [], 0)  # (S,)
            for d, draft in enumerate(self.drafts):  # each draft sees the committed token: SD can resume next round
                if d in self.deferred:
                    self.deferred.keep(d, [r.slot for r in running], pending, pos0, out,
                                       min((r.committed - 1 for r in running), default=None), at)
                else:
                    draft.observe(pending[:, None], pos0[:, None], out, span=at)
            return torch.zeros_like(next_tok), next_tok, next_tok[:, None], _logprobs(special, rows)
        self.deferred.replay()
        row_draft = {r.slot: d for r, d in zip(running, choice.drafts)}
        row_k = {r.slot: kk for r, kk in zip(running, choice.ks)}
        proposals = {d: _draft(self.drafts[d], k, pending, pos0, starts, [(r, st) for r, st in special
                                                                         if row_draft[r.slot] == d])
                     for d in choice.used}
        d_tokens, qs, zs = _compose(proposals, row_draft, self.width)
        verify_in = torch.cat([pending[:, None], d_tokens], 1)  # (S, k+1)
        vpos = pos0[:, None] + torch.arange(k + 1, device=pos0.device)
        at = Span(starts, k + 1)
        out = self.target(verify_in, vpos, cache, hidden_layers=self.reads, span=at)  # verify
        own_k = {slot: kk if row_draft[slot] is not None else 0 for slot, kk in row_k.items()}
        ks = None
        if any(kk < k for kk in own_k.values()):
            ks = torch.full((self.width,), k, dtype=torch.long)
            ks[list(own_k)] = torch.tensor(list(own_k.values()), dtype=torch.long)
            ks = ks.to(d_tokens.device)
        n_acc, next_tok, rows = _accept(d_tokens, qs, out.logits, special, ks, own_k)  # accept
        if self.round_hook is not None:
            self.round_hook(RoundTrace([(r.slot, r.sampling, r.params.max_tokens - len(r.emitted)) for r in running],
                                       pos0, d_tokens, torch.stack(zs, 1), out.logits, n_acc))
        for draft in self.drafts:
            draft.observe(verify_in, vpos, out, span=at)
        return n_acc, next_tok, output_tokens(d_tokens, n_acc, next_tok), _logprobs(special, rows)

    def advance(self, live_slots: Sequence[int], freed: Sequence[int], n_acc: torch.Tensor | None = None,
                next_tok: torch.Tensor | None = None, accepted: Sequence[int] | None = None) -> None:
        """Commit a round: the slots still live keep their accepted tokens (:func:`rollback`) and take their next
        pending token; the freed slots go back to length 1 (their dummy rounds then write positions 0..k)."""
        if freed:
            at = torch.tensor(list(freed), device=self.n.device)
            self.n[at], self.pending[at] = 1, 0
            for s in freed:
                self.n_host[s] = 1
        if n_acc is None:
            return
        for s in live_slots:  # rollback's rule on the host, from the round's read (``accepted``: per slot)
            self.n_host[s] += accepted[s] + 1
        w = self.width
        live = torch.zeros(w, dtype=torch.bool)
        live[list(live_slots)] = True
        live = live.to(self.n.device)
        self.n[:w] = rollback(self.n[:w], live, n_acc)
        self.pending[:w] = torch.where(live, next_tok, self.pending[:w])


def prompt_logprobs(target: Transformer, req: Request, h: torch.Tensor, s0: int, chunk: int = 256) -> list:
    """Log-probabilities (the target's, untransformed, at temperature 1: vLLM's) of prompt tokens s0+1 .. s0+T from
    the final residual stream h (1, T, d_model) at positions s0 .. s0+T-1, as :func:`top_logprobs` (logits in chunks
    of ``chunk`` positions, so a long prompt never holds (T, V))."""
    out = []
    for c in range(0, h.shape[1], chunk):
        lg = target.logits(h[:, c: c + chunk])[0]  # (t, V)
        lp = torch.log_softmax(lg.float(), -1)
        toks = req.prompt[s0 + c + 1: s0 + c + 1 + lg.shape[0]]
        out.extend(top_logprobs(lp, toks, req.params.prompt_logprobs))
    return out


def check_prefilled(state: Prefilled, cache: KVCache, drafts: Sequence[Draft]) -> None:
    """Raises ConfigError for a prefill of another layout than ``cache`` or without the layers a draft reads."""
    def layout(c: KVCache) -> tuple:
        k = c.k[0]
        return len(c.k), k.shape[1], k.shape[3], str(k.dtype).removeprefix("torch.")

    if layout(state.cache) != layout(cache):
        raise ConfigError("add_prefilled: the prefill's cache has (layers, KV heads, head size, dtype) "
                          f"{layout(state.cache)}, this engine's target {layout(cache)}")
    for draft in drafts:
        if state.out is not None and not set(draft.hidden_layers) <= set(state.out.hidden):
            raise ConfigError(f"add_prefilled: the prefill kept target layers {sorted(state.out.hidden)}, the "
                              f"{draft.name} draft reads {sorted(draft.hidden_layers)}")


def _round_output(running: Sequence[Request], accepted: list[int], block: list[list[int]],
                  lps: dict[int, torch.Tensor], prompt: list, seconds: float) -> RoundOutput:
    """The scheduler's view of a round read back: per running request its accepted count, its tokens (accepted +
    recovered or bonus) and their :func:`top_logprobs` where it asked."""
    tokens = [block[r.slot][: accepted[r.slot] + 1] for r in running]
    logprobs = [top_logprobs(lps[r.slot][: len(t)], t, r.params.logprobs) if r.slot in lps else None
                for r, t in zip(running, tokens)]
    return RoundOutput([accepted[r.slot] for r in running], tokens, logprobs, prompt, seconds)


def _processed(req: Request, st: RowState, logits: torch.Tensor, drafted: list[int], first: int) -> torch.Tensor:
    """(T, V) logits at T positions after the request's tokens so far and ``drafted[: first + t]`` -> its logits
    processing applied (:func:`spire.sampling.process_logits`)."""
    if not req.proc.active:
        return logits
    return process_logits(logits, req.proc, st.history, len(req.emitted), drafted, first)


def _choose(logits: torch.Tensor, special: list[tuple[Request, RowState]], drafted: list[torch.Tensor], j: int
            ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
    """Tokens (S,) from logits (S, V) at a round's position j (after the drafted tokens ``drafted``, j of (S,)):
    the argmax in every row, then in each special request's row (:attr:`Request.special`) its processed logits'
    argmax (greedy) or a draw from its transformed distribution with its own generator. Returns the tokens, the
    (S, V) float32 distributions they were drawn from (rows of greedy requests are zero; None when no request
    samples) and the processed (1, V) logits of each special request's slot."""
    tok = logits.argmax(-1)
    q = None
    if any(not r.sampling.greedy for r, _ in special):
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    rows = {}
    for req, st in special:
        b = req.slot
        row = _processed(req, st, logits[b: b + 1], [int(t[b]) for t in drafted], j)  # (1, V)
        rows[b] = row
        if req.sampling.greedy:
            tok[b] = row[0].argmax()
        else:
            q[b] = probs_from_logits(row[0], req.sampling)
            tok[b] = sample(q[b], st.generator)
    return tok, q, rows


def _draft(draft: Draft, k: int, pending: torch.Tensor, pos0: torch.Tensor, starts: list[int],
           special: list[tuple[Request, RowState]]) -> tuple[torch.Tensor, list, list]:
    """k steps of one draft from each row's pending token (S,) at positions pos0 (S,) (``starts``: the same on the
    host), each token chosen as the row's request asks (``special``: the rows of this draft that sample, process
    logits or want logprobs). Returns its tokens (S, k), distributions (k of (S, V) or None) and raw logits (k of
    (S, V))."""
    tok, tokens, qs, zs = pending, [], [], []
    for j in range(k):
        z = draft.step(tok[:, None], (pos0 + j)[:, None], span=Span([p + j for p in starts], 1))
        tok, q, _ = _choose(z, special, tokens, j)
        tokens.append(tok)
        qs.append(q)
        zs.append(z)
    return torch.stack(tokens, 1), qs, zs


def _compose(proposals: dict[int, tuple[torch.Tensor, list, list]], row_draft: dict[int, int | None], S: int
             ) -> tuple[torch.Tensor, list[torch.Tensor | None], list[torch.Tensor]]:
    """Each row's proposal from its own draft: ``proposals`` maps a draft index to its tokens (S, k), its k
    distributions ((S, V) or None) and its k raw logits (S, V); row_draft: slot -> the draft it takes (a row of none,
    or a free slot, takes the first draft's). Returns the tokens (S, k), the k distributions and the k logits."""
    first = min(proposals)
    tokens, qs, zs = proposals[first][0].clone(), list(proposals[first][1]), list(proposals[first][2])
    for d, (t, q, z) in proposals.items():
        if d == first:
            continue
        rows = torch.tensor([s for s, x in row_draft.items() if x == d], dtype=torch.long, device=t.device)
        tokens[rows] = t[rows]
        for j in range(len(zs)):
            zs[j] = zs[j].clone()
            zs[j][rows] = z[j][rows]
            if q[j] is not None or qs[j] is not None:
                base = qs[j].clone() if qs[j] is not None else torch.zeros_like(q[j])
                if q[j] is not None:
                    base[rows] = q[j][rows]
                qs[j] = base
    return tokens, qs, zs


def _accept(d_tokens: torch.Tensor, qs: list[torch.Tensor | None], logits: torch.Tensor,
            special: list[tuple[Request, RowState]], ks: torch.Tensor | None = None, row_k: dict[int, int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Verification per row: greedy for every row (:func:`verify_greedy`), then for each special request's row
    with its processed logits (position t after the drafted tokens before it): greedy, or rejection sampling
    (:func:`verify`) with its transform and generator. d_tokens (S, k), qs: k (S, V) or None, logits (S, k+1, V).
    ks (S,): the most draft tokens each row may accept (default k): its tokens past that are not verified, as if it
    had drafted only ks[b] (0: the row's next token is the target's at the round's first position); row_k: the
    same per slot of a running request, as ints (default k). Returns n_accepted (S,), next_token (S,) and the processed
    (k+1, V) logits of each special request's slot."""
    k = d_tokens.shape[1]
    row_k = row_k or {}
    if ks is None:
        n_acc, next_tok = verify_greedy(d_tokens, logits)
    else:  # a token past a row's own k never equals the target's argmax (ids are >= 0)
        past = torch.arange(k, device=d_tokens.device)[None] >= ks[:, None]
        n_acc, next_tok = verify_greedy(torch.where(past, -1, d_tokens), logits)
    rows = {}
    if special:
        q = torch.stack(qs, 1) if any(x is not None for x in qs) else None  # (S, k, V)
        for req, st in special:
            b = req.slot
            kb = row_k.get(b, k)
            row = _processed(req, st, logits[b], d_tokens[b].tolist(), 0)  # (k+1, V)
            rows[b] = row
            if req.sampling.greedy:
                nb, xb = verify_greedy(d_tokens[b: b + 1, :kb], row[None, : kb + 1])
            else:
                p = probs_from_logits(row[None, : kb + 1], req.sampling)  # (1, kb+1, V)
                if kb:
                    nb, xb = verify(d_tokens[b: b + 1, :kb], q[b: b + 1, :kb], p, st.generator)
                else:  # it drafted nothing: the target's own draw at the round's first position, as an AD round
                    nb, xb = torch.zeros(1, dtype=torch.long), sample(p[:, 0], st.generator)
            n_acc[b], next_tok[b] = nb[0], xb[0]
    return n_acc, next_tok, rows


def _logprobs(special: list[tuple[Request, RowState]], rows: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per slot of a request that asked for logprobs: its (T, V) log-probabilities from its processed logits."""
    return {r.slot: logprobs_from_logits(rows[r.slot], r.sampling) for r, _ in special
            if r.params.logprobs is not None}


def top_logprobs(lp: torch.Tensor, toks: list[int], n: int) -> list[tuple[float, list[tuple[int, float]]]]:
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
