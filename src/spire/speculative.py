"""Batched speculative decoding: the round loop (SPIRe paper §2; Leviathan et al. 2023).

One round per batch: the draft proposes k tokens per row (k draft forwards), the target scores the pending
token plus the k proposals in one forward over k+1 positions, :func:`spire.verification.verify` accepts a
prefix per row and draws the next token. Each row keeps its own committed length ``n`` and its positions
start at 0 at its first token, so rows of different prompt lengths and accept lengths never wait for or
shift one another.

Cache invariant (why no explicit rollback is needed): the target cache holds the committed tokens at
positions < n - 1; the last committed token is *pending* and is the first input of the next round. Every
forward writes its positions before any query reads them, and a query reads only positions <= its own, so
entries of rejected tokens (and of right-padding in prefill) are overwritten before they are ever read.

``draft=None`` runs autoregressive decoding (AD) with the same prefill and stopping rules.

:func:`generate` = :func:`prefill` + :func:`decode`; the two halves are public so that a benchmark can run
several decoders (AD, each draft) from one prefill (``Prefilled.clone_cache``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from spire.drafts.base import Draft
from spire.errors import ConfigError
from spire.kv_cache import KVCache
from spire.model import ForwardOutput, Transformer
from spire.sampling import SamplingParams, probs_from_logits, sample
from spire.verification import verify


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_length(target: Transformer, rows: Sequence[Sequence[int]], max_new_tokens: int, depth: int) -> int:
    """Cache length (tokens) for prompts ``rows``, ``max_new_tokens`` new tokens and ``depth`` draft tokens
    per round (0 for AD): longest prompt + max_new_tokens + depth + 1. Raises ConfigError beyond the
    target's positions."""
    longest = max(len(r) for r in rows)
    max_len = longest + max_new_tokens + depth + 1
    if max_len - 1 > target.cfg.max_positions:
        raise ConfigError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the "
                          f"target's {target.cfg.max_positions} positions")
    return max_len


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
    _sync(dev)
    t0 = time.perf_counter()
    padded = pos = valid = out = None
    if width > 0:
        padded = torch.zeros(B, width, dtype=torch.long, device=dev)
        for b, r in enumerate(rows):
            padded[b, : len(r) - 1] = torch.tensor(r[:-1], device=dev)
        pos = torch.arange(width, device=dev)[None].expand(B, width)
        valid = pos < (lens - 1)[:, None]
        out = target(padded, pos, cache, hidden_layers=hidden_layers)
    _sync(dev)
    return Prefilled(rows, cache, max_len, padded, pos, valid, out, time.perf_counter() - t0)


@torch.no_grad()
def generate(target: Transformer, prompts: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int,
             draft: Draft | None = None, k: int = 4, params: SamplingParams = SamplingParams(),
             generator: torch.Generator | None = None, eos_ids: Sequence[int] = (),
             stop: "StopStrings | None" = None, progress=None) -> GenerationResult:
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
    cache = target.new_cache(len(rows), max_len)
    if draft is not None:
        draft.start(target, cache, len(rows), max_len, k)
    state = prefill(target, rows, max_len, draft.hidden_layers if draft is not None else (), cache)
    if draft is not None and state.out is not None:
        draft.observe(state.tokens, state.pos, state.out, valid=state.valid)
    return decode(target, state, max_new_tokens, draft, k, params, generator, eos_ids, stop, progress)


def _check(k: int, max_new_tokens: int) -> None:
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.no_grad()
def decode(target: Transformer, state: Prefilled, max_new_tokens: int, draft: Draft | None = None, k: int = 4,
           params: SamplingParams = SamplingParams(), generator: torch.Generator | None = None,
           eos_ids: Sequence[int] = (), stop: "StopStrings | None" = None, progress=None,
           cache: KVCache | None = None) -> GenerationResult:
    """The round loop after :func:`prefill` (arguments as :func:`generate`). ``cache`` (default
    ``state.cache``) is the target cache to continue from; a draft must already be started on it and have
    observed the prefill. Greedy decoding (temperature 0) takes argmaxes directly: the same tokens as
    rejection sampling with one-hot p and q (a draft token is accepted iff it is the target's argmax; the
    correction / bonus is the target's argmax), without building (B, k, V) distributions.

    Raises ConfigError for k < 1 or max_new_tokens < 1, or a cache too short for max_new_tokens.
    """
    _check(k, max_new_tokens)
    cache = state.cache if cache is None else cache
    rows = state.rows
    B, dev = len(rows), target.device
    need = cache_length(target, rows, max_new_tokens, k if draft is not None else 0)
    if need > cache.max_len:
        raise ConfigError(f"the cache holds {cache.max_len} positions, {need} are needed")
    lens = torch.tensor([len(r) for r in rows], device=dev)
    _sync(dev)
    t0, c0 = time.perf_counter(), time.process_time()
    n = lens.clone()  # committed length per row
    pending = torch.tensor([r[-1] for r in rows], device=dev)  # (B,) last committed token, not yet in cache
    eos_set = set(int(t) for t in eos_ids)
    emitted: list[list[int]] = [[] for _ in range(B)]
    finish = ["length"] * B
    rounds, accepted_log = [0] * B, []
    active = [True] * B
    hidden_layers = draft.hidden_layers if draft is not None else ()
    arange_b = torch.arange(B, device=dev)
    offsets = torch.arange(k + 1, device=dev)

    while any(active):
        pos0 = n - 1  # (B,) position of the pending token
        if draft is None:
            logits = target(pending[:, None], pos0[:, None], cache).logits  # (B, 1, V)
            n_acc = torch.zeros(B, dtype=torch.long, device=dev)
            if params.greedy:
                next_tok = logits[:, -1].argmax(-1)
            else:
                next_tok = sample(probs_from_logits(logits[:, -1], params), generator)
            block = next_tok[:, None]
        else:
            if params.greedy:
                d_tokens = _propose_greedy(draft, pending, pos0, k)  # (B, k)
            else:
                d_tokens, q = _propose(draft, pending, pos0, k, params, generator)  # (B, k), (B, k, V)
            verify_in = torch.cat([pending[:, None], d_tokens], 1)  # (B, k+1)
            vpos = pos0[:, None] + offsets  # (B, k+1)
            out = target(verify_in, vpos, cache, hidden_layers=hidden_layers)
            if params.greedy:
                best = out.logits.argmax(-1)  # (B, k+1) the target's choice at every position
                n_acc = (d_tokens == best[:, :k]).long().cumprod(-1).sum(-1)
                next_tok = best[arange_b, n_acc]
            else:
                p = probs_from_logits(out.logits, params)  # (B, k+1, V)
                n_acc, next_tok = verify(d_tokens, q, p, generator)
            draft.observe(verify_in, vpos, out)
            block = torch.cat([d_tokens, torch.zeros_like(d_tokens[:, :1])], 1)
            block[arange_b, n_acc] = next_tok  # row b emits block[b, : n_acc[b] + 1]
        n_acc_list = n_acc.tolist()
        accepted_log.append(n_acc_list)
        block_list = block.tolist()
        new_total = 0
        for b in range(B):
            if not active[b]:
                continue
            rounds[b] += 1
            toks = block_list[b][: n_acc_list[b] + 1]
            toks = toks[: max_new_tokens - len(emitted[b])]
            cut = next((i + 1 for i, t in enumerate(toks) if t in eos_set), None)
            if stop is not None:
                cut_s = stop.cut(emitted[b], toks[:cut])
                cut = cut_s if cut_s is not None else cut
            if cut is not None:
                toks = toks[:cut]
                finish[b] = "stop"
                active[b] = False
            emitted[b].extend(toks)
            new_total += len(toks)
            if len(emitted[b]) >= max_new_tokens:
                active[b] = False
        if progress is not None:
            progress(new_total)
        # advance active rows; finished rows stay put (their compute is wasted, their state untouched)
        act = torch.tensor(active, device=dev)
        n = torch.where(act, n + n_acc + 1, n)
        pending = torch.where(act, next_tok, pending)
    _sync(dev)
    return GenerationResult(emitted, finish, rounds, [len(e) for e in emitted], accepted_log,
                            prefill_s=state.prefill_s, decode_s=time.perf_counter() - t0,
                            decode_cpu_s=time.process_time() - c0)


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

    def cut(self, previous: list[int], new: list[int]) -> int | None:
        if not self.strings or not new:
            return None
        start = max(0, len(self.decode(previous)) - self.span)
        for i in range(len(new)):
            tail = self.decode(previous + new[: i + 1])[start:]
            if any(st in tail for st in self.strings):
                return i + 1
        return None

    def trim(self, text: str) -> str:
        """The text before the first stop string (the text a user is shown)."""
        hits = [text.find(st) for st in self.strings if st in text]
        return text[: min(hits)] if hits else text


def _propose_greedy(draft: Draft, pending: torch.Tensor, pos0: torch.Tensor, k: int) -> torch.Tensor:
    """k greedy draft forwards -> draft tokens (B, k) (the argmax of each step's logits)."""
    tok, tokens = pending, []
    for j in range(k):
        tok = draft.step(tok[:, None], (pos0 + j)[:, None]).argmax(-1)
        tokens.append(tok)
    return torch.stack(tokens, 1)


def _propose(draft: Draft, pending: torch.Tensor, pos0: torch.Tensor, k: int, params: SamplingParams,
             generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """k draft forwards. Returns draft tokens (B, k) and the exact distributions they were drawn from (B, k, V)."""
    tok, tokens, qs = pending, [], []
    for j in range(k):
        q = probs_from_logits(draft.step(tok[:, None], (pos0 + j)[:, None]), params)  # (B, V)
        tok = sample(q, generator)
        tokens.append(tok)
        qs.append(q)
    return torch.stack(tokens, 1), torch.stack(qs, 1)
