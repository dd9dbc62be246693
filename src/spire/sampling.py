"""Logits to the distribution that is sampled: greedy, temperature, top-k, top-p.

The same :class:`SamplingParams` transform is applied to the target's p and the draft's q before
verification (Leviathan et al. 2023 require it: otherwise the output is not the sampled-from target
distribution). All probability arithmetic is float32 or wider.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spire.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax, a one-hot distribution); top_k 0 and top_p 1 mean off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after the transform (rows sum to 1)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # subtract the row maximum first: logits / T overflows to inf for a tiny T (1e-38), and inf - inf is NaN;
    # shifted logits are <= 0, so / T gives finite values or -inf; the maxima stay 0 even where T underflows
    # float32 to 0 (1e-320: 0 / 0 would be NaN), so a tiny T is greedy with ties shared
    shifted = logits - logits.amax(-1, keepdim=True)
    logits = torch.where(shifted == 0, torch.zeros_like(shifted), shifted / params.temperature)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of (..., V) probabilities -> (...) int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
