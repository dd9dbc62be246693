"""Greedy speculative output against greedy AD, with the first divergence explained (CASES.md 11).

In float32 the two are identical. In bf16 the verify forward (k+1 tokens) and the AD forward (1 token) round
differently, so they may part ways where the target's top-2 logits nearly tie; this reports where and how
close the tie was, instead of hiding it, and whether the gap is within the target's rounding there (a near-tie)
or beyond it (a real divergence: a bug, not rounding).

The rounding bound (:func:`rounding_bound`). A logit is ``z_j = h · W_j`` (h the final normed hidden state, W the
unembedding). If every element of h carries a relative error of at most ρ (the accumulated rounding of the forward
in the target's dtype), z_j moves by at most ``ρ · |h|ᵀ|W_j|`` (first order; the componentwise bound of Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1). Two forwards that round differently can then
swap tokens a and b only when ``|z_a − z_b| ≤ ρ · (|h|ᵀ|W_a| + |h|ᵀ|W_b|)``. ρ is the relative tolerance at which
PyTorch itself calls two values of the dtype equal, ``torch.testing.assert_close``'s default rtol (its docs'
table): bfloat16 1.6e-2 (four units of bf16 roundoff 2^-8), float16 1e-3, float32 1.3e-6. Since
``|z_j| ≤ |h|ᵀ|W_j|``, the bound also covers the final rounding of the logits themselves (at most 2^-8 · |z_j|
in bf16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from spire.drafts.base import Draft
from spire.model import Transformer
from spire.engine.engine import generate_batch

RTOL = {torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
"""ρ per compute dtype: torch.testing.assert_close's default rtol (PyTorch documentation)."""


@dataclass
class Divergence:
    """Per row: identical, or the first index where SD and AD differ and the AD step's top-2 logit gap
    there (logit units: the target re-scores the AD prefix in its own dtype).

    ad_token / sd_token: the tokens AD and SD emitted there (None where one output ended first); gap:
    z[ad_token] − z[sd_token] in the re-scored logits; bound: :func:`rounding_bound` for that pair; near_tie:
    gap within the bound (rounding can explain the divergence), False for a real divergence."""

    row: int
    identical: bool
    index: int | None = None
    top2_gap: float | None = None
    ad_token: int | None = None
    sd_token: int | None = None
    gap: float | None = None
    bound: float | None = None
    near_tie: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def rounding_bound(h: torch.Tensor, weight: torch.Tensor, a: int, b: int, dtype: torch.dtype) -> float:
    """ρ · (|h|ᵀ|W_a| + |h|ᵀ|W_b|) (the module docstring gives the derivation and ρ's source).

    h: (d_model,) the final normed hidden state at the position; weight: (V, d_model) the unembedding; a, b:
    token ids; dtype: the dtype the target computed in (picks ρ; others than float32 / bfloat16 / float16
    raise KeyError). Returns logit units."""
    habs = h.detach().float().abs()
    w = weight.detach().float()
    return RTOL[dtype] * float(w[a].abs() @ habs + w[b].abs() @ habs)


def classify(logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, ad_token: int, sd_token: int,
             dtype: torch.dtype) -> tuple[float, float, bool]:
    """(gap, bound, near_tie) at a position where AD emitted ``ad_token`` and SD ``sd_token``: logits (V,) and
    h (d_model,) there, weight (V, d_model) the unembedding. near_tie when |gap| <= bound."""
    gap = float(logits[ad_token].float() - logits[sd_token].float())
    bound = rounding_bound(h, weight, ad_token, sd_token, dtype)
    return gap, bound, abs(gap) <= bound


@torch.no_grad()
def first_divergence(target: Transformer, row: int, prompt: list[int], ad: list[int], sd: list[int]) -> Divergence:
    """Row ``row``'s :class:`Divergence`: identical, or the first index where the AD tokens ``ad`` and the SD tokens
    ``sd`` (both generated after ``prompt``) differ, the target's top-2 gap there and :func:`classify` of the two
    tokens, the target re-scoring ``prompt + ad[:index]`` in its own dtype (one forward over that prefix)."""
    i = next((i for i, (u, v) in enumerate(zip(ad, sd)) if u != v), None)
    if i is None and len(ad) == len(sd):
        return Divergence(row, True)
    i = min(len(ad), len(sd)) if i is None else i
    n = target.cfg.n_layers
    ids = torch.tensor([list(prompt) + list(ad[:i])], device=target.device)
    fwd = target(ids, torch.arange(ids.shape[1], device=target.device)[None], hidden_layers=[n])
    logits = fwd.logits[0, -1].float()
    top2 = logits.topk(2).values
    div = Divergence(row, False, i, float(top2[0] - top2[1]))
    if i < len(ad) and i < len(sd):  # (an output that ended first has no token to compare)
        h = target.model.norm(fwd.hidden[n][:, -1:])[0, 0]
        div.ad_token, div.sd_token = int(ad[i]), int(sd[i])
        div.gap, div.bound, div.near_tie = classify(logits, h, target.lm_head.weight, div.ad_token, div.sd_token,
                                                    target.dtype)
    return div


@torch.no_grad()
def compare_greedy(target: Transformer, draft: Draft, prompts: list[list[int]], max_new_tokens: int,
                   k: int = 4) -> list[Divergence]:
    """Run greedy AD and greedy SD on the same prompts (on the serving engine, as ``spire generate``) and report
    the first divergence of each row, classified near-tie or real (:func:`first_divergence`)."""
    ad = generate_batch(target, prompts, max_new_tokens).tokens
    sd = generate_batch(target, prompts, max_new_tokens, draft=draft, k=k).tokens
    return [first_divergence(target, b, prompts[b], x, y) for b, (x, y) in enumerate(zip(ad, sd))]
