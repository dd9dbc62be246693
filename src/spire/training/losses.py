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

from spire import kernels

# MixedLoss and HardTargetLoss run through the native row kernels (:func:`spire.kernels.mixed_loss_rows`,
# :func:`spire.kernels.cross_entropy_rows`) where they apply (float32 CPU) when called with kernel=True (the
# trainer passes its Backend.loss_kernel); kernel=False: the torch implementations below (the same formulas).


@dataclass
class LossTerms:
    """loss: scalar, differentiable. distill_t, alpha_t: its parts as 0-dim detached tensors on the loss's device;
    :attr:`distill` / :attr:`alpha` read them as floats, a host sync each, so a training step reads them only where
    it logs them."""

    loss: torch.Tensor
    distill_t: torch.Tensor
    alpha_t: torch.Tensor

    @property
    def distill(self) -> float:
        return float(self.distill_t)

    @property
    def alpha(self) -> float:
        return float(self.alpha_t)


class _MixedLoss(torch.autograd.Function):
    """MixedLoss(omega) over rows of draft logits z (n, N) against target log-probabilities (n, N), with the
    gradient worked by hand (a few passes over the (n, N) arrays instead of autograd's dozen; with the native
    kernel the forward computes each row's gradient and the backward scales it). With
    q = softmax(z), S_p = Σ_i p_i, m_i = 1[q_i < p_i] (1/2 at q_i = p_i, as torch.minimum's gradient):

        d/dz_j −Σ_i p_i log q_i = q_j S_p − p_j;   d/dz_j Σ_i min(p_i, q_i) = m_j q_j − q_j Σ_i m_i q_i.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, logp: torch.Tensor, omega: float, need_grad: bool = True, kernel: bool = True):
        n = z.numel() // z.shape[-1]
        fused = kernels.mixed_loss_rows(z, logp, omega, need_grad) if kernel and z.dim() == 2 else None
        if fused is not None:  # the row gradient is computed here (unless not needed), the backward only scales it
            grad, d_rows, a_rows = fused
            distill, alpha = (d_rows.sum() / n).float(), (a_rows.sum() / n).float()
            ctx.save_for_backward(grad if grad is not None else z.new_zeros(0))
            ctx.fused, ctx.n = True, n
            ctx.mark_non_differentiable(distill, alpha)
            return omega * distill - (1 - omega) * alpha, distill, alpha
        ctx.fused = False
        log_q = F.log_softmax(z, -1)
        q, p = log_q.exp(), logp.exp()
        distill = (p * log_q).sum().neg_() / n
        alpha = torch.minimum(p, q).sum() / n
        ctx.save_for_backward(q, p)
        ctx.omega, ctx.n = omega, n
        ctx.mark_non_differentiable(distill, alpha)
        return omega * distill - (1 - omega) * alpha, distill, alpha

    @staticmethod
    def backward(ctx, g: torch.Tensor, _g_distill, _g_alpha):
        if ctx.fused:
            (grad,) = ctx.saved_tensors
            if grad.numel() == 0:
                raise RuntimeError("MixedLoss was computed without its gradient (need_grad=False)")
            return grad * (g / ctx.n), None, None, None, None
        q, p = ctx.saved_tensors
        w = ctx.omega
        mq = (q < p).to(q.dtype).add_((q == p).to(q.dtype), alpha=0.5).mul_(q)
        grad = q * (w * p.sum(-1, keepdim=True) + (1 - w) * mq.sum(-1, keepdim=True))
        grad.sub_(p, alpha=w).sub_(mq, alpha=1 - w).mul_(g / ctx.n)
        return grad, None, None, None, None


def mixed_loss_logp(draft_logits: torch.Tensor, target_logp: torch.Tensor, omega: float = 0.5,
                    kernel: bool = True) -> LossTerms:
    """MixedLoss(omega) of draft logits (..., N) against the target's log-probabilities (..., N) of the same N
    tokens (N = V, or a draft vocabulary; the target's p normalized over its full vocabulary, so that p sums
    to at most 1 over the N tokens). Returns the loss and its parts (means over positions). The gradient flows
    to draft_logits only (the target is the teacher); it equals :func:`mixed_loss_logp_reference`'s to float32
    rounding. On float32 CPU tensors with ``kernel`` it runs through the native row kernel (one pass per
    row for the loss and its gradient: 0.1 s against 0.4 s for the torch formulas over 1,024 × 16,384 logits
    on one Zen 2 core), else through the torch formulas of :class:`_MixedLoss` (about 0.8× the reference's
    time)."""
    N = draft_logits.shape[-1]
    need_grad = torch.is_grad_enabled() and draft_logits.requires_grad
    loss, distill, alpha = _MixedLoss.apply(draft_logits.float().reshape(-1, N),
                                            target_logp.detach().float().reshape(-1, N), omega, need_grad, kernel)
    return LossTerms(loss, distill.detach(), alpha.detach())


def mixed_loss_logp_reference(draft_logits: torch.Tensor, target_logp: torch.Tensor, omega: float = 0.5
                              ) -> LossTerms:
    """:func:`mixed_loss_logp` written with autograd (what the trainer used before; the tests' reference)."""
    log_q = F.log_softmax(draft_logits.float(), -1)
    p = target_logp.float().exp()
    distill = -(p * log_q).sum(-1).mean()
    alpha = torch.minimum(p, log_q.exp()).sum(-1).mean()
    loss = omega * distill - (1 - omega) * alpha
    return LossTerms(loss, distill.detach(), alpha.detach())


class _HardTargetLoss(torch.autograd.Function):
    """Mean cross-entropy over the rows whose target is not ignored, through the native row kernel: the forward
    computes each row's gradient softmax(z) − onehot(y) with its loss, the backward scales it (torch's
    log_softmax and its backward took ~0.5 s of a ~1.8 s vanilla step over 1,020 × 49,152 logits on one core)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, y: torch.Tensor, grad: torch.Tensor | None, loss_rows: torch.Tensor):
        n_valid = int((y >= 0).sum())
        ctx.save_for_backward(grad if grad is not None else z.new_zeros(0))
        ctx.n = n_valid
        return (loss_rows.sum() / n_valid).float() if n_valid else z.new_zeros(())  # no valid row: contributes 0

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if grad.numel() == 0:
            raise RuntimeError("HardTargetLoss was computed without its gradient")
        return grad * (g / ctx.n) if ctx.n else torch.zeros_like(grad), None, None, None


def hard_target_loss(draft_logits: torch.Tensor, tokens: torch.Tensor, kernel: bool = True) -> torch.Tensor:
    """Cross-entropy of draft_logits (..., N) against the data tokens (...) as indices into the N columns
    (a draft vocabulary maps tokens outside it to -100, which is ignored): the mean over the rows not ignored,
    as ``F.cross_entropy``; 0 (with a zero gradient) when every row is ignored (a batch with no target in the draft
    vocabulary contributes nothing, where ``F.cross_entropy`` gives NaN). On float32 CPU rows with ``kernel`` it
    runs through the native row kernel (:func:`spire.kernels.cross_entropy_rows`; equal to torch's to float32
    rounding)."""
    z = draft_logits.float().flatten(0, -2)
    y = tokens.flatten()
    if kernel and z.device.type == "cpu" and bool((y != -100).eq(y >= 0).all()):
        if not bool((y >= 0).any()):  # every row ignored: it contributes zero, not torch's NaN (a host read)
            return z.sum() * 0.0
        need_grad = torch.is_grad_enabled() and z.requires_grad
        fused = kernels.cross_entropy_rows(z.detach().contiguous(), y, need_grad)
        if fused is not None:
            return _HardTargetLoss.apply(z, y, *fused)
    # the mean over the rows not ignored, 0 when all are (F.cross_entropy's mean would be NaN), with no read back
    return F.cross_entropy(z, y, reduction="sum") / (y != -100).sum().clamp_min(1)


@torch.no_grad()
def acceptance_alpha_logp(draft_logits: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    """sum_i min(p_i, q_i) per position over the draft's N tokens: draft logits and target log-probabilities
    (..., N) (see :func:`mixed_loss_logp`) -> (...)."""
    return torch.minimum(target_logp.float().exp(), F.softmax(draft_logits.float(), -1)).sum(-1)


def kl_loss_logp(draft_logits: torch.Tensor, target_logp: torch.Tensor, kernel: bool = True) -> LossTerms:
    """speculators' Eagle3 loss (``losses.eager.kl_div_loss``): the forward KL(p' || q) per position, averaged,
    where p' is the target's distribution renormalized over the draft's N tokens (speculators' targets are the
    verifier's head rows t2d, softmaxed over N) and q the draft's.

    draft_logits: (..., N); target_logp: (..., N) the target's log-probabilities of those N tokens normalized
    over its whole vocabulary (:meth:`spire.training.sources.TeacherBatch.target_logp`). Returns the loss (with
    gradient to draft_logits; MixedLoss(omega = 1) against log p', minus the constant entropy of p', so its value
    is the KL), ``distill`` = the same KL, and ``alpha`` = the expected acceptance Σ min(p, q) with the target's
    true p (not renormalized)."""
    logp = target_logp.detach().float()
    logp_r = logp - logp.logsumexp(-1, keepdim=True)  # p' over the N tokens
    terms = mixed_loss_logp(draft_logits, logp_r, 1.0, kernel)  # -Σ p' log q (mean over positions)
    entropy = -(logp_r.exp() * logp_r).sum(-1).mean()  # H(p'), a constant
    kl = terms.loss - entropy
    alpha = acceptance_alpha_logp(draft_logits.detach(), logp).mean()
    return LossTerms(kl, kl.detach(), alpha)


LK_EPS = 1e-8
"""Floor of α before the log in :func:`log_acceptance_loss_logp` (speculators' ``neg_log_acceptance_loss`` floors
it likewise), so a position with no overlap gives a finite loss."""


def log_acceptance_loss_logp(draft_logits: torch.Tensor, target_logp: torch.Tensor) -> LossTerms:
    """The negative log-acceptance loss, LK^α of Samarin et al., "LK Losses: Direct Acceptance Rate Optimization
    for Speculative Decoding" (arXiv 2602.23881; SpecForge PR #492, speculators' ``nla``):

        loss = mean over positions of −log max(α, LK_EPS),   α = Σ_i min(p_i, q_i)

    the acceptance probability of one drafted token itself (α = 1 − TV(p, q)), so the gradient is (1/α)·∇α: the
    TV gradient scaled up where overlap is low. At a one-hot p it is the cross-entropy of q at that token.

    draft_logits: (..., N); target_logp: (..., N) the target's log-probabilities of the draft's N tokens normalized
    over its whole vocabulary (q = 0 outside the N tokens, so α over them is the exact acceptance). Float32.
    Returns the loss (gradient to draft_logits through autograd: torch.minimum gives 1/2 to each side at a tie),
    ``distill`` = the mean −Σ p log q (for the log, as the other losses), ``alpha`` = mean α."""
    p = target_logp.detach().float().exp()
    log_q = F.log_softmax(draft_logits.float(), -1)
    alpha_rows = torch.minimum(p, log_q.exp()).sum(-1)
    loss = -alpha_rows.clamp_min(LK_EPS).log().mean()
    with torch.no_grad():
        distill = -(p * log_q).sum(-1).mean()
    return LossTerms(loss, distill, alpha_rows.detach().mean())
