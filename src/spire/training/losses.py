"""Draft training losses (SPIRe paper §3.6).

With p the target's next-token distribution and q the draft's:
  HardTargetLoss  = cross-entropy of q against the data token;
  distillation    = E[-sum_i p_i log q_i];
  alpha           = E[sum_i min(p_i, q_i)], the expected acceptance probability of one drafted token;
  MixedLoss(omega) = omega * distillation + (1 - omega) * (-alpha)   (paper: omega = 0.5 slightly best).
All in float32.

With a draft vocabulary (a subset of the target's, EAGLE-3's d2t map) the draft gives q = 0 outside it, so
sum_i min(p_i, q_i) runs over the draft vocabulary only and is still the exact acceptance probability; the
distillation term is taken over the same subset (outside it -log q is infinite and has no gradient), with p
normalized over the full vocabulary (:func:`mixed_loss_logp` takes log p restricted to the subset).
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
    return mixed_loss_logp(draft_logits, F.log_softmax(target_logits.float(), -1), omega)


def mixed_loss_logp(draft_logits: torch.Tensor, target_logp: torch.Tensor, omega: float = 0.5) -> LossTerms:
    """MixedLoss(omega) of draft logits (..., N) against the target's log-probabilities (..., N) of the same N
    tokens (N = V, or a draft vocabulary; the target's p normalized over its full vocabulary, so that p sums
    to at most 1 over the N tokens). Returns the loss and its parts (means over positions)."""
    log_q = F.log_softmax(draft_logits.float(), -1)
    p = target_logp.float().exp()
    distill = -(p * log_q).sum(-1).mean()
    alpha = torch.minimum(p, log_q.exp()).sum(-1).mean()
    loss = omega * distill - (1 - omega) * alpha
    return LossTerms(loss, distill.item(), alpha.item())


def hard_target_loss(draft_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of draft_logits (..., N) against the data tokens (...) as indices into the N columns
    (a draft vocabulary maps tokens outside it to -100, which is ignored)."""
    return F.cross_entropy(draft_logits.float().flatten(0, -2), tokens.flatten())


@torch.no_grad()
def acceptance_alpha(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """sum_i min(p_i, q_i) per position: (..., V) -> (...). Expected acceptance at temperature 1."""
    return acceptance_alpha_logp(draft_logits, F.log_softmax(target_logits.float(), -1))


@torch.no_grad()
def acceptance_alpha_logp(draft_logits: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    """sum_i min(p_i, q_i) per position over the draft's N tokens: draft logits and target log-probabilities
    (..., N) (see :func:`mixed_loss_logp`) -> (...)."""
    return torch.minimum(target_logp.float().exp(), F.softmax(draft_logits.float(), -1)).sum(-1)
