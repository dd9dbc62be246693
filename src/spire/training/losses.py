"""Draft training losses (SPIRe paper §3.6).

With p the target's next-token distribution and q the draft's:
  HardTargetLoss  = cross-entropy of q against the data token;
  distillation    = E[-sum_i p_i log q_i];
  alpha           = E[sum_i min(p_i, q_i)], the expected acceptance probability of one drafted token;
  MixedLoss(omega) = omega * distillation + (1 - omega) * (-alpha)   (paper: omega = 0.5 slightly best).
All in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, differentiable
    distill: float
    alpha: float


def mixed_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, omega: float = 0.5) -> LossTerms:
    """draft_logits, target_logits: (..., V). Returns MixedLoss(omega) and its parts (means over positions)."""
    log_q = F.log_softmax(draft_logits.float(), -1)
    p = F.softmax(target_logits.float(), -1)
    distill = -(p * log_q).sum(-1).mean()
    alpha = torch.minimum(p, log_q.exp()).sum(-1).mean()
    loss = omega * distill - (1 - omega) * alpha
    return LossTerms(loss, distill.item(), alpha.item())


def hard_target_loss(draft_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of draft_logits (..., V) against the data tokens (...)."""
    return F.cross_entropy(draft_logits.float().flatten(0, -2), tokens.flatten())


@torch.no_grad()
def acceptance_alpha(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """sum_i min(p_i, q_i) per position: (..., V) -> (...). Expected acceptance at temperature 1."""
    return torch.minimum(F.softmax(target_logits.float(), -1), F.softmax(draft_logits.float(), -1)).sum(-1)
