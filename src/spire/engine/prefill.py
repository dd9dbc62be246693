"""A batch's prefill: the target over all but the last token of every prompt, right-padded (:func:`prefill`), the
cache length a batch needs (:func:`cache_length`), the one place a draft is started on a prefilled batch
(:func:`start_draft`), and what each draft of a serving engine is given of a prefill (:func:`observe_prefill`).

Cache invariant (why rollback needs no work): the target cache holds a row's committed tokens at positions < n - 1;
the last committed token is *pending* and is the first input of the next round. Every forward writes its positions
before any query reads them, and a query reads only positions <= its own, so entries of rejected draft tokens (and
of right-padding in a prefill) are overwritten before they are ever read (:func:`spire.engine.runner.rollback`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from spire.drafts.base import Draft
from spire.errors import ConfigError
from spire.kv_cache import KVCache
from spire.model import ForwardOutput, Transformer
from spire.timing import Stopwatch


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


def as_rows(prompts: torch.Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
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
    rows = as_rows(prompts)
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


def start_draft(draft: Draft, target: Transformer, k: int, cache: KVCache, state: Prefilled | None = None) -> None:
    """The one place a draft is started: :meth:`Draft.start` on the target cache ``cache`` (its rows, its
    positions), k draft tokens per round, then :meth:`Draft.observe` of ``state``'s prefill when one is given and
    it ran (prompts of one token have nothing to prefill). ``cache`` is ``state.cache`` or a clone of it, to run
    several decoders from one prefill; the engine's :class:`~spire.engine.runner.Runner` starts its draft here on
    its slots."""
    draft.start(target, cache, cache.batch_size, cache.max_len, k)
    if state is not None and state.out is not None:
        draft.observe(state.tokens, state.pos, state.out, valid=state.valid)


# ---- what each draft is given of a prefill ------------------------------------------------------------------------


def observe_prefill(drafts: Sequence[Draft], reads: Sequence[int], width: int, slots: torch.Tensor,
                    tokens: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None, out: ForwardOutput,
                    ends: Sequence[int]) -> None:
    """:meth:`Draft.observe` of a prefill batch for each of ``drafts``: J rows for ``slots`` (J,) of an engine's
    ``width`` S slots; tokens, positions, valid (J, W) (None: every entry); the target's output ``out`` with the
    hidden layers ``reads`` the drafts take; ``ends`` (J,): each row's prompt's last prefilled position, in this
    batch or a later one. Each draft gets the hidden layers it reads (:attr:`Draft.hidden_layers`) and no others. A
    draft with :attr:`Draft.observe_keeps` (sink, tail) gets each row's positions < sink and
    those within ``tail`` of its prompt's end only (:func:`keeps`): its observe then costs O(sink + tail) per
    prompt, not O(prompt), however many pieces the prompt is prefilled in (a piece none of whose positions stays is
    not observed at all); with :attr:`Draft.observe_rows` it gets the J rows alone, else full-batch (S, ·) tensors with
    the other rows invalid."""
    valid = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device) if valid is None else valid
    ends_t = torch.tensor(list(ends), device=pos.device)
    made: dict = {}
    for draft in drafts:
        # each draft's own hidden layers only (an n-gram draft beside SPIRe: none of SPIRe's, scattered to S rows)
        layers = frozenset(draft.hidden_layers) & frozenset(reads)
        key = (draft.observe_keeps, draft.observe_rows, layers)
        if key not in made:
            made[key] = _given(width, slots, tokens, pos, valid, out, ends_t, set(layers), *key[:2])
        if made[key] is None:
            continue  # no position of this piece stays in the draft's state
        t, p, o, v, rows = made[key]
        if rows is None:
            draft.observe(t, p, o, valid=v)
        else:
            draft.observe(t, p, o, valid=v, rows=rows)


def _given(S: int, slots: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
           out: ForwardOutput, ends: torch.Tensor, layers: set[int], keep: tuple[int, int] | None, by_rows: bool
           ) -> tuple | None:
    """What a draft of :attr:`Draft.observe_keeps` ``keep`` and :attr:`Draft.observe_rows` ``by_rows`` is given of
    a prefill batch (:func:`observe_prefill`): (tokens, pos, output, valid, its rows' slots, or None with full-batch
    tensors), or None when it keeps no position of the batch."""
    if keep is not None:
        at, kept = keeps(pos, valid, *keep, ends)
        if by_rows:  # the rows that keep a position, as many columns as the most kept (kept ones come first;
            # a row with fewer repeats its last: the same entry written twice, never a stale one over it)
            n = kept.sum(1)
            live = (n > 0).nonzero()[:, 0]
            if not len(live):
                return None
            n = n[live]
            cols = torch.minimum(torch.arange(int(n.max()), device=n.device)[None], (n - 1)[:, None])
            at = at[live].gather(1, cols)
            kept = torch.ones_like(at, dtype=torch.bool)
            out = _positions_of(out, at, layers, live)  # one gather of the kept (row, column) entries
            tokens, pos, slots = tokens[live[:, None], at], pos[live[:, None], at], slots[live]
        else:
            tokens, pos, out = tokens.gather(1, at), pos.gather(1, at), _positions_of(out, at, layers)
        valid = kept
    if by_rows:
        return tokens, pos, out, valid, slots
    return (*_full_batch(S, slots, tokens, pos, valid, out, layers), None)


def _full_batch(S: int, slots: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                out: ForwardOutput, layers: set[int]) -> tuple:
    """J rows (tokens, pos, valid (J, W), a forward's output) at ``slots`` of (S, W) ones (the other rows invalid,
    their positions 0..W-1): (tokens, pos, output, valid)."""
    (J, W), dev = tokens.shape, tokens.device
    full_tokens = torch.zeros(S, W, dtype=torch.long, device=dev)
    full_valid = torch.zeros(S, W, dtype=torch.bool, device=dev)
    full_pos = torch.arange(W, device=dev)[None].repeat(S, 1)
    full_tokens[slots], full_pos[slots], full_valid[slots] = tokens, pos, valid
    hidden = {j: _scatter(h, slots, S) for j, h in out.hidden.items() if j in layers}
    return full_tokens, full_pos, ForwardOutput(hidden=hidden, compute_logits=lambda: _scatter(out.logits, slots, S)), \
        full_valid


def rows_of(out: ForwardOutput, at: torch.Tensor) -> ForwardOutput:
    """A forward's output with its rows gathered at ``at`` (a shared prefill row given to several slots)."""
    return ForwardOutput(hidden={j: h[at] for j, h in out.hidden.items()}, compute_logits=lambda: out.logits[at])


def keeps(pos: torch.Tensor, valid: torch.Tensor, sink: int, tail: int, ends: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each row of a (J, W) batch (positions ``pos``, ``valid``; ``ends`` (J,): the last position its prompt's
    prefill reaches, in this batch or a later one), the columns of its valid positions < sink and of those within
    the last ``tail`` positions up to its end (an earlier one is overwritten by a later position of the same
    prompt), in order: (J, sink + tail) column indices and which of them hold such a position (a row with fewer
    fills the rest with columns it does not keep)."""
    keep = valid & ((pos < sink) | (pos > ends[:, None] - tail))
    at = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, : sink + tail]
    return at, keep.gather(1, at)


def _positions_of(out: ForwardOutput, at: torch.Tensor, layers: set[int], rows: torch.Tensor | None = None
                  ) -> ForwardOutput:
    """A forward's output at columns ``at`` (J, T) of its rows, or of its rows ``rows`` (J,) (hidden (·, W, d) ->
    (J, T, d)), of the hidden ``layers`` only."""
    def cols(x: torch.Tensor) -> torch.Tensor:
        if rows is not None:
            return x[rows[:, None], at]
        return x.gather(1, at[..., None].expand(*at.shape, x.shape[-1]))
    return ForwardOutput(hidden={j: cols(h) for j, h in out.hidden.items() if j in layers},
                         compute_logits=lambda: cols(out.logits))


def _scatter(x: torch.Tensor, slots: torch.Tensor, S: int) -> torch.Tensor:
    """(J, ...) rows into a zero (S, ...) tensor at ``slots``."""
    full = torch.zeros(S, *x.shape[1:], dtype=x.dtype, device=x.device)
    full[slots] = x
    return full
