"""Token verification by rejection sampling (Leviathan et al. 2023, Chen et al. 2023; SPIRe paper §2).

Draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
correction is drawn from normalize(max(p_i - q_i, 0)); when all k are accepted a bonus token is drawn from
p_k. q must be exactly the distribution x_i was drawn from (one-hot for a greedy draft). The emitted tokens
are then distributed exactly as the target's p.
"""

from __future__ import annotations

import torch

from spire.sampling import sample


def verify(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's draft block and draw the next token.

    Args:
        draft_tokens: (B, k) proposed tokens.
        q: (B, k, V) float32 draft distributions the tokens were drawn from.
        p: (B, k+1, V) float32 target distributions at the same positions plus the bonus position.
    Returns:
        n_accepted: (B,) int64 in [0, k]; next_token: (B,) the correction (n_accepted < k) or bonus token.
    """
    B, k = draft_tokens.shape
    idx = draft_tokens[..., None]
    p_x = p[:, :k].gather(-1, idx).squeeze(-1)  # (B, k)
    q_x = q.gather(-1, idx).squeeze(-1)  # (B, k)
    u = torch.rand(B, k, generator=generator, device=p.device)
    accept = u * q_x < p_x  # u < p/q without dividing; q_x > 0 as x was drawn from q
    n_accepted = accept.long().cumprod(-1).sum(-1)  # (B,) length of the accepted prefix
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, n_accepted]  # (B, V) target distribution at the first unaccepted position
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n_accepted]  # zero at the bonus position
    residual = (p_next - q_next).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # p == q up to rounding leaves no residual mass: then the rejection had probability ~0; fall back to p
    residual = torch.where(mass > 1e-6, residual / mass.clamp_min(1e-30), p_next)
    return n_accepted, sample(residual, generator)
