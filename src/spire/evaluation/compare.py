"""Greedy speculative output against greedy AD, with the first divergence explained (CASES.md 11).

In float32 the two are identical. In bf16 the verify forward (k+1 tokens) and the AD forward (1 token) round
differently, so they may part ways where the target's top-2 logits nearly tie; this reports where and how
close the tie was, instead of hiding it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spire.drafts.base import Draft
from spire.model import Transformer
from spire.engine.engine import generate_batch


@dataclass
class Divergence:
    """Per row: identical, or the first index where SD and AD differ and the AD step's top-2 logit gap
    there (logit units: the target re-scores the AD prefix in its own dtype)."""

    row: int
    identical: bool
    index: int | None = None
    top2_gap: float | None = None


@torch.no_grad()
def compare_greedy(target: Transformer, draft: Draft, prompts: list[list[int]], max_new_tokens: int,
                   k: int = 4) -> list[Divergence]:
    """Run greedy AD and greedy SD on the same prompts (on the serving engine, as ``spire generate``) and report
    the first divergence of each row."""
    ad = generate_batch(target, prompts, max_new_tokens).tokens
    sd = generate_batch(target, prompts, max_new_tokens, draft=draft, k=k).tokens
    out = []
    for b, (x, y) in enumerate(zip(ad, sd)):
        i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if i is None and len(x) == len(y):
            out.append(Divergence(b, True))
            continue
        i = min(len(x), len(y)) if i is None else i
        ids = torch.tensor([prompts[b] + x[:i]], device=target.device)
        logits = target(ids, torch.arange(ids.shape[1], device=target.device)[None]).logits[0, -1].float()
        top2 = logits.topk(2).values
        out.append(Divergence(b, False, i, float(top2[0] - top2[1])))
    return out
