"""Batched speculative decoding: the round loop (SPIRe paper §2; Leviathan et al. 2023).

A round, per batch, in four named steps:

1. draft (:func:`_draft`): the draft proposes k tokens per row, one draft forward each;
2. verify (:func:`_sd_round`): the target scores the pending token and the k proposals in one forward over
   k+1 positions;
3. accept (:func:`_accept`): :mod:`spire.verification` keeps a prefix of each row's proposals and gives the
   recovered or bonus token (greedy or by rejection sampling; the module defines the terms);
4. commit / rollback (:class:`_Rows`): each active row emits its output tokens (cut by its budget, EOS and
   stop strings) and its committed length advances past them; rejected tokens are rolled back by not
   advancing.

Each row keeps its own committed length ``n`` and its positions start at 0 at its first token, so rows of
different prompt lengths and accept lengths never wait for or shift one another.

Cache invariant (why rollback needs no work): the target cache holds the committed tokens at positions
< n - 1; the last committed token is *pending* and is the first input of the next round. Every forward writes
its positions before any query reads them, and a query reads only positions <= its own, so entries of
rejected tokens (and of right-padding in prefill) are overwritten before they are ever read.

``draft=None`` runs autoregressive decoding (AD, :func:`_ad_round`) with the same prefill and stopping rules.

:func:`generate` = :func:`prefill` + :func:`start_draft` + :func:`decode`; the parts are public so that a
benchmark can run several decoders (AD, each draft) from one prefill (``Prefilled.clone_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from spire.drafts.base import Draft
from spire.errors import ConfigError
from spire.kv_cache import KVCache
from spire.model import ForwardOutput, Transformer
from spire.sampling import SamplingParams, probs_from_logits, sample
from spire.timing import Stopwatch
from spire.verification import output_tokens, verify, verify_greedy


@dataclass
class GenerationResult:
    """tokens: per row, the emitted tokens (prompt excluded); finish_reasons: "stop" (EOS) or "length";
    rounds / emitted: per-row counts of rounds run while the row was active and tokens emitted;
    prefill_s / decode_s: wall-clock seconds of the prefill and of the round loop (device-synchronized);
    decode_cpu_s: CPU seconds the process spent in the round loop (all its threads; on a shared machine a
    single-threaded run's CPU time is what the loop would take on an idle core)."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    rounds: list[int]
    emitted: list[int]
    accepted_per_round: list[list[int]] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_cpu_s: float = 0.0

    @property
    def tau(self) -> float:
        """Average tokens emitted per round (bonus included): total emitted / total rounds."""
        return sum(self.emitted) / max(1, sum(self.rounds))

    def row_tau(self, b: int) -> float:
        return self.emitted[b] / max(1, self.rounds[b])


@dataclass
class Prefilled:
    """A batch after its prefill (all but the last prompt token of each row are in ``cache``).

    rows: the prompts; max_len: cache length (tokens); tokens, pos, valid: (B, W) right-padded prefill
    tokens, their positions and a real-token mask (None when every prompt has one token); out: the prefill's
    :class:`ForwardOutput` (hidden states of ``hidden_layers``) for :meth:`Draft.observe`; prefill_s: seconds.
    """

    rows: list[list[int]]
    cache: KVCache
    max_len: int
    tokens: torch.Tensor | None
    pos: torch.Tensor | None
    valid: torch.Tensor | None
    out: ForwardOutput | None
    prefill_s: float = 0.0

    def clone_cache(self) -> KVCache:
        """A copy of the prefilled target cache (to run several decoders from one prefill)."""
        return self.cache.clone()


def _as_rows(prompts: torch.Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
    rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else [list(map(int, p)) for p in prompts]
    if not rows:
        raise ConfigError("no prompts given")
    if any(len(r) == 0 for r in rows):
        raise ConfigError("empty prompt: every prompt needs at least one token")
    return rows


def cache_length(target: Transformer, rows: Sequence[Sequence[int]], max_new_tokens: int, depth: int) -> int:
    """Cache length (tokens) for prompts ``rows``, ``max_new_tokens`` new tokens and ``depth`` draft tokens
    per round (0 for AD): longest prompt + max_new_tokens + depth + 1. Raises ConfigError beyond the
    target's positions."""
    longest = max(len(r) for r in rows)
    max_len = longest + max_new_tokens + depth + 1
    if max_len - 1 > target.cfg.max_positions:
        extra = f" + k = {depth} draft tokens per round" if depth else ""
        raise ConfigError(f"prompt of {longest} tokens + {max_new_tokens} new tokens{extra} exceeds the "
                          f"target's {target.cfg.max_positions} positions")
    return min(max_len, target.cfg.max_positions)  # the last slot is slack: never more than the target has


@torch.no_grad()
def prefill(target: Transformer, prompts: torch.Tensor | Sequence[Sequence[int]], max_len: int,
            hidden_layers: Sequence[int] = (), cache: KVCache | None = None) -> Prefilled:
    """Run the target over all but the last token of every prompt (right-padded; pad entries lie past each
    row's committed length and are overwritten before being read).

    Args:
        target: the target model.
        prompts: (B, L) token ids or B lists of ids.
        max_len: cache length (see :func:`cache_length`).
        hidden_layers: target layers whose input residual streams the drafts need (``Draft.hidden_layers``).
        cache: a fresh cache to fill (default: ``target.new_cache(B, max_len)``).
    Raises:
        ConfigError: empty prompts, or max_len beyond the target's positions.
    """
    rows = _as_rows(prompts)
    B, dev = len(rows), target.device
    cache = target.new_cache(B, max_len) if cache is None else cache
    lens = torch.tensor([len(r) for r in rows], device=dev)
    width = int(lens.max()) - 1
    watch = Stopwatch(dev)
    padded = pos = valid = out = None
    if width > 0:
        padded = torch.zeros(B, width, dtype=torch.long, device=dev)
        for b, r in enumerate(rows):
            padded[b, : len(r) - 1] = torch.tensor(r[:-1], device=dev)
        pos = torch.arange(width, device=dev)[None].expand(B, width)
        valid = pos < (lens - 1)[:, None]
        out = target(padded, pos, cache, hidden_layers=hidden_layers)
    return Prefilled(rows, cache, max_len, padded, pos, valid, out, watch.seconds())


def start_draft(draft: Draft, target: Transformer, state: Prefilled, k: int,
                cache: KVCache | None = None) -> None:
    """Bind ``draft`` to a generation that continues from ``state``: :meth:`Draft.start` on the target cache
    (``cache``, default ``state.cache``; a clone of it to run several decoders from one prefill), then
    :meth:`Draft.observe` of the prefill (when there was one: prompts of one token have nothing to prefill).
    k: draft tokens per round."""
    cache = state.cache if cache is None else cache
    draft.start(target, cache, len(state.rows), state.max_len, k)
    if state.out is not None:
        draft.observe(state.tokens, state.pos, state.out, valid=state.valid)


@torch.no_grad()
def generate(target: Transformer, prompts: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int,
             draft: Draft | None = None, k: int = 4, params: SamplingParams = SamplingParams(),
             generator: torch.Generator | None = None, eos_ids: Sequence[int] = (),
             stop: StopStrings | None = None, progress=None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per row, with speculative rounds when a draft is given.

    Args:
        target: the target model.
        prompts: (B, L) token ids or B lists of ids (lengths may differ).
        max_new_tokens: budget per row (tokens); never overshot.
        draft: a :class:`Draft`, or None for AD.
        k: draft tokens per round (>= 1).
        params: sampling transform applied identically to p and q.
        generator: torch RNG for reproducible sampling.
        eos_ids: token ids that end a row (the EOS token is emitted, then the row stops).
        stop: optional :class:`StopStrings`; a row ends at the token that completes a stop string.
        progress: optional callable(n_new_tokens) called as tokens are emitted (e.g. tqdm.update).
    Raises:
        ConfigError: k < 1, max_new_tokens < 1, empty prompt, or a context beyond the target's positions.
    """
    _check(k, max_new_tokens)
    rows = _as_rows(prompts)
    max_len = cache_length(target, rows, max_new_tokens, k if draft is not None else 0)
    state = prefill(target, rows, max_len, draft.hidden_layers if draft is not None else ())
    if draft is not None:
        start_draft(draft, target, state, k)
    return decode(target, state, max_new_tokens, draft, k, params, generator, eos_ids, stop, progress)


def _check(k: int, max_new_tokens: int) -> None:
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.no_grad()
def decode(target: Transformer, state: Prefilled, max_new_tokens: int, draft: Draft | None = None, k: int = 4,
           params: SamplingParams = SamplingParams(), generator: torch.Generator | None = None,
           eos_ids: Sequence[int] = (), stop: StopStrings | None = None, progress=None,
           cache: KVCache | None = None) -> GenerationResult:
    """The round loop after :func:`prefill` (arguments as :func:`generate`). ``cache`` (default
    ``state.cache``) is the target cache to continue from; a draft must already be started on it and have
    observed the prefill (:func:`start_draft`). Greedy decoding (temperature 0) takes argmaxes directly
    (:func:`spire.verification.verify_greedy`).

    Raises ConfigError for k < 1 or max_new_tokens < 1, or a cache too short for max_new_tokens.
    """
    _check(k, max_new_tokens)
    cache = state.cache if cache is None else cache
    need = cache_length(target, state.rows, max_new_tokens, k if draft is not None else 0)
    if need > cache.max_len:
        raise ConfigError(f"the cache holds {cache.max_len} positions, {need} are needed")
    eos_set = set(int(t) for t in eos_ids)
    watch = Stopwatch(target.device)
    rows = _Rows.start(state.rows, target.device)
    accepted_log: list[list[int]] = []
    while any(rows.active):
        pos0 = rows.n - 1  # (B,) position of the pending token
        if draft is None:
            n_acc, next_tok, block = _ad_round(target, cache, rows.pending, pos0, params, generator)
        else:
            n_acc, next_tok, block = _sd_round(target, cache, draft, rows.pending, pos0, k, params, generator)
        accepted = n_acc.tolist()
        accepted_log.append(accepted)
        new_tokens = rows.emit(block.tolist(), accepted, max_new_tokens, eos_set, stop)
        if progress is not None:
            progress(new_tokens)
        rows.advance(n_acc, next_tok)
    decode_s, decode_cpu_s = watch.stop()
    return GenerationResult(rows.emitted, rows.finish, rows.rounds, [len(e) for e in rows.emitted], accepted_log,
                            prefill_s=state.prefill_s, decode_s=decode_s, decode_cpu_s=decode_cpu_s)


def _ad_round(target: Transformer, cache: KVCache, pending: torch.Tensor, pos0: torch.Tensor,
              params: SamplingParams, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AD step: the target's token after the pending one. Returns n_accepted (B,) zeros, next_token (B,)
    and the output tokens (B, 1)."""
    logits = target(pending[:, None], pos0[:, None], cache).logits[:, -1]  # (B, V)
    if params.greedy:
        next_tok = logits.argmax(-1)
    else:
        next_tok = sample(probs_from_logits(logits, params), generator)
    return torch.zeros_like(next_tok), next_tok, next_tok[:, None]


def _sd_round(target: Transformer, cache: KVCache, draft: Draft, pending: torch.Tensor, pos0: torch.Tensor, k: int,
              params: SamplingParams, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One speculative round: draft k tokens, verify them in one target forward over k+1 positions, accept a
    prefix; the draft then observes the target's pass. Returns n_accepted (B,), next_token (B,) (recovered or
    bonus) and the output tokens as a (B, k+1) block (:func:`spire.verification.output_tokens`)."""
    d_tokens, q = _draft(draft, pending, pos0, k, params, generator)  # (B, k), (B, k, V) or None (greedy)
    verify_in = torch.cat([pending[:, None], d_tokens], 1)  # (B, k+1)
    vpos = pos0[:, None] + torch.arange(k + 1, device=pos0.device)  # (B, k+1)
    out = target(verify_in, vpos, cache, hidden_layers=draft.hidden_layers)
    n_acc, next_tok = _accept(d_tokens, q, out.logits, params, generator)
    draft.observe(verify_in, vpos, out)
    return n_acc, next_tok, output_tokens(d_tokens, n_acc, next_tok)


def _draft(draft: Draft, pending: torch.Tensor, pos0: torch.Tensor, k: int, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k draft forwards from the pending token. Returns the draft tokens (B, k) and the exact distributions
    they were drawn from (B, k, V); greedy: each step's argmax, and None (no distributions are built)."""
    tok, tokens, qs = pending, [], []
    for j in range(k):
        logits = draft.step(tok[:, None], (pos0 + j)[:, None])  # (B, V)
        if params.greedy:
            tok = logits.argmax(-1)
        else:
            q = probs_from_logits(logits, params)  # (B, V)
            tok = sample(q, generator)
            qs.append(q)
        tokens.append(tok)
    return torch.stack(tokens, 1), torch.stack(qs, 1) if qs else None


def _accept(d_tokens: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, params: SamplingParams,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification of draft tokens (B, k) against the target's logits (B, k+1, V): greedy, or by rejection
    sampling with p transformed exactly as q was. Returns n_accepted (B,), next_token (B,)."""
    if params.greedy:
        return verify_greedy(d_tokens, logits)
    return verify(d_tokens, q, probs_from_logits(logits, params), generator)  # p: (B, k+1, V)


@dataclass
class _Rows:
    """The round loop's per-row state. n: (B,) committed length; pending: (B,) the last committed token, not
    yet in the target cache; emitted, finish, rounds, active: per row, the emitted tokens, the finish reason,
    the rounds run while active, and whether the row still decodes."""

    n: torch.Tensor
    pending: torch.Tensor
    emitted: list[list[int]]
    finish: list[str]
    rounds: list[int]
    active: list[bool]

    @classmethod
    def start(cls, prompts: list[list[int]], device: torch.device) -> _Rows:
        B = len(prompts)
        return cls(torch.tensor([len(r) for r in prompts], device=device),
                   torch.tensor([r[-1] for r in prompts], device=device),
                   [[] for _ in range(B)], ["length"] * B, [0] * B, [True] * B)

    def emit(self, block: list[list[int]], accepted: list[int], max_new_tokens: int, eos_set: set[int],
             stop: StopStrings | None) -> int:
        """Commit each active row's output tokens ``block[b][: accepted[b] + 1]``, cut at its budget, at an EOS
        token (emitted) or at the token that completes a stop string; a cut row finishes. Returns the number of
        tokens emitted."""
        new_total = 0
        for b, toks in enumerate(block):
            if not self.active[b]:
                continue
            self.rounds[b] += 1
            toks, stopped = cut_output(self.emitted[b], toks[: accepted[b] + 1], max_new_tokens, eos_set, stop)
            if stopped:
                self.finish[b] = "stop"
                self.active[b] = False
            self.emitted[b].extend(toks)
            new_total += len(toks)
            if len(self.emitted[b]) >= max_new_tokens:
                self.active[b] = False
        return new_total

    def advance(self, n_acc: torch.Tensor, next_tok: torch.Tensor) -> None:
        """Commit / rollback: an active row's committed length grows by n_acc + 1 and its next token becomes
        pending; its rejected tokens are rolled back by not counting them (the cache invariant). Finished
        rows stay put (their compute this round is wasted, their state untouched)."""
        act = torch.tensor(self.active, device=self.n.device)
        self.n = torch.where(act, self.n + n_acc + 1, self.n)
        self.pending = torch.where(act, next_tok, self.pending)


def cut_output(emitted: list[int], toks: list[int], max_new_tokens: int, eos_set: set[int],
               stop: StopStrings | None) -> tuple[list[int], bool]:
    """One row's share of a round's output tokens ``toks`` (its accepted tokens and the recovered / bonus one),
    given the tokens it ``emitted`` before: cut at its budget (``max_new_tokens`` in all), after an EOS token
    (kept) or after the token that completes a stop string. Returns (the tokens to emit, whether an EOS or a
    stop string ended the row). An EOS or stop string inside the budget wins over the budget (finish "stop")."""
    toks = toks[: max_new_tokens - len(emitted)]
    cut = next((i + 1 for i, t in enumerate(toks) if t in eos_set), None)
    if stop is not None:
        cut_s = stop.cut(emitted, toks[:cut])
        cut = cut_s if cut_s is not None else cut
    return (toks, False) if cut is None else (toks[:cut], True)


def first_stop(text: str, strings: Sequence[str], floor: int = 0) -> tuple[int, str] | None:
    """(start, string) of the stop string occurrence in ``text`` that ends first among those ending past character
    ``floor`` (the text of the tokens before which stop strings are not checked: min_tokens), or None."""
    hits = []
    for st in strings:
        at = text.find(st, max(0, floor - len(st) + 1))
        if at >= 0:
            hits.append((at + len(st), at, st))
    if not hits:
        return None
    _, at, st = min(hits)
    return at, st


class StopStrings:
    """Stop strings checked on decoded text. ``cut(previous, new)`` returns how many of the ``new`` tokens to
    keep so that the row ends with the token that completes the first stop string, or None.

    Args:
        strings: the stop strings (non-empty).
        decode: token ids -> text (e.g. ``tokenizer.decode``).
    """

    def __init__(self, strings: Sequence[str], decode) -> None:
        if any(not st for st in strings):
            raise ConfigError("stop strings must be non-empty")
        self.strings, self.decode = list(strings), decode
        self.span = max(len(st) for st in strings) if strings else 0

    def cut(self, previous: list[int], new: list[int], checked: bool = True) -> int | None:
        """checked: the text of ``previous`` holds no stop string (it was cut before); False (min_tokens): only an
        occurrence that ends past ``previous``'s text counts."""
        if not self.strings or not new:
            return None
        floor = len(self.decode(previous))
        start = max(0, floor - self.span)
        for i in range(len(new)):
            text = self.decode(previous + new[: i + 1])
            if checked and any(st in text[start:] for st in self.strings):
                return i + 1
            if not checked and first_stop(text, self.strings, floor) is not None:
                return i + 1
        return None

    def trim(self, text: str) -> str:
        """The text before the first stop string (the text a user is shown)."""
        hits = [text.find(st) for st in self.strings if st in text]
        return text[: min(hits)] if hits else text
