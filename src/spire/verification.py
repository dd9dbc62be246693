"""Verification of a round's draft tokens: greedy and by rejection sampling (Leviathan et al. 2023, Chen et al.
2023; SPIRe paper §2). The layout follows vLLM's ``v1/sample/rejection_sampler.py``: both kinds live here.

In a round the draft proposed k tokens x_1..x_k per row and the target scored k+1 positions in one forward
(the pending token followed by the k draft tokens), giving its p_1..p_{k+1}. Per row:

- accepted tokens: the longest prefix of x_1..x_k that verification keeps, n_accepted of them (0..k).
  Rejection sampling accepts x_i with probability min(1, p_i(x_i) / q_i(x_i)), q_i being exactly the
  distribution the draft drew x_i from; greedy verification accepts x_i iff it is the target's argmax.
- recovered token: at the first rejected position i, the token put in x_i's place, drawn from
  normalize(max(p_i - q_i, 0)) (greedy: the target's argmax at i).
- bonus token: when all k are accepted, one more token drawn from p_{k+1} (greedy: its argmax); it costs
  nothing, the target has already scored position k+1.
- output tokens: the accepted tokens followed by the recovered or the bonus token, n_accepted + 1 of them
  (:func:`output_tokens`); the round loop emits them, cut by each row's budget, EOS and stop strings.

With rejection sampling the output tokens are distributed exactly as the target's p. Greedy verification
gives the same tokens as rejection sampling with one-hot p and q, without building (B, k, V) distributions.
"""

from __future__ import annotations

import torch

from spire.sampling import sample


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification (temperature 0): a draft token is accepted iff it is the target's argmax; the
    recovered or bonus token is the target's argmax at the first unaccepted position.

    Args:
        draft_tokens: (B, k) proposed tokens.
        target_logits: (B, k+1, V) the target's logits at the k draft positions plus the bonus position.
    Returns:
        n_accepted: (B,) int64 in [0, k]; next_token: (B,) the recovered (n_accepted < k) or bonus token.
    """
    k = draft_tokens.shape[1]
    best = target_logits.argmax(-1)  # (B, k+1) the target's choice at every position
    n_accepted = (draft_tokens == best[:, :k]).long().cumprod(-1).sum(-1)  # (B,) length of the accepted prefix
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    return n_accepted, best[rows, n_accepted]


def verify(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification by rejection sampling: accept a prefix of each row's draft tokens and draw the next token.

    Args:
        draft_tokens: (B, k) proposed tokens.
        q: (B, k, V) float32 draft distributions the tokens were drawn from.
        p: (B, k+1, V) float32 target distributions at the same positions plus the bonus position.
        generator: torch RNG for the acceptance draws and the recovered / bonus token.
    Returns:
        n_accepted: (B,) int64 in [0, k]; next_token: (B,) the recovered (n_accepted < k) or bonus token.
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


def output_tokens(draft_tokens: torch.Tensor, n_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """The round's output tokens as a (B, k+1) block: row b's are ``block[b, : n_accepted[b] + 1]`` (the
    accepted draft tokens, then the recovered or bonus token); entries past them are meaningless.

    Args:
        draft_tokens: (B, k); n_accepted: (B,) int64; next_token: (B,) (from :func:`verify` or
        :func:`verify_greedy`).
    """
    block = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], 1)  # (B, k+1)
    block[torch.arange(block.shape[0], device=block.device), n_accepted] = next_token
    return block
