"""A batch's prefill: the target over all but the last token of every prompt, right-padded (:func:`prefill`), the
cache length a batch needs (:func:`cache_length`), and the one place a draft is started on a prefilled batch
(:func:`start_draft`).

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
