"""The protocol every draft implements for the round loop in :mod:`spire.speculative`.

A round (SPIRe paper §2): the draft proposes k tokens one forward at a time, the target verifies k+1
positions in one forward, a prefix is accepted per row, and the draft is told what was committed.
Positions are absolute text positions, starting at 0 at each row's first token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from spire.kv_cache import KVCache
from spire.model import ForwardOutput, Transformer


class Draft(ABC):
    """A draft model bound to one generation (``start``) at a time.

    ``hidden_layers`` names the target layers whose *input* residual streams the draft needs; the round
    loop asks the target for them in prefill and verify and passes them to :meth:`observe`.
    """

    name: str = "draft"
    hidden_layers: tuple[int, ...] = ()

    @abstractmethod
    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        """Allocate per-generation state for ``batch_size`` rows, positions < max_len, k tokens per round."""

    @abstractmethod
    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One draft forward. tokens, pos: (B, 1) -> float32 logits (B, V) for position pos + 1."""

    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None) -> None:
        """The target has just run on ``tokens`` at ``pos`` (B, T) (prefill or verify); ``target_out``
        holds its logits and the requested hidden states; ``valid`` (B, T) marks real tokens (False for
        right-padding in a batched prefill). Entries past each row's committed length may be stale; the
        next round overwrites them before any query reads them."""
