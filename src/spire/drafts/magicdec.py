"""MagicDec self-speculation (Chen et al. 2024, arXiv 2408.11049; SPIRe paper §4).

The draft is the target itself reading a StreamingLLM view (sink + window) of the target's own KV cache.
It writes its keys/values for the drafted positions into that cache; verification overwrites them with
the target's exact keys/values before any query reads them, so no copy or rollback is needed.
"""

from __future__ import annotations

import torch

from spire import defaults
from spire.drafts.base import Draft
from spire.registry import DraftImpl
from spire.kv_cache import KVCache, SinkWindow, Span
from spire.model import Transformer


class MagicDecDraft(Draft):
    """Target weights over a sink + window view (default sink 1, window 64). No training."""

    name = "magicdec"

    def __init__(self, sink: int = defaults.SINK, window: int = defaults.WINDOW) -> None:
        self.view = SinkWindow(sink, window)
        self._target: Transformer | None = None
        self._cache: KVCache | None = None

    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        self._target, self._cache, self._full = target, target_cache, target_cache

    def use_rows(self, n: int) -> bool:
        """Read rows [0, n) of the target's cache (a view)."""
        self._cache = self._full.narrow(n)
        return True

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Nothing to forget: the draft's only state is the target's cache, whose rows a new request overwrites
        (its prefill, then each round) before any query reads them."""

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None) -> torch.Tensor:
        assert self._target is not None, "call start() first"
        return self._target(tokens, pos, self._cache, view=self.view, span=span).logits[:, -1]


def load_draft(target: Transformer, sink: int = defaults.SINK, window: int = defaults.WINDOW, **_) -> MagicDecDraft:
    """MagicDec over a sink + window view of ``target``'s own cache (no weights of its own)."""
    return MagicDecDraft(sink, window)


KIND = DraftImpl(load=load_draft)
