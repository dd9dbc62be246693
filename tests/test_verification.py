"""Rejection sampling on toy categorical distributions (CASES.md 1, 2, 4): checked statistically."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spire.sampling import SamplingParams, probs_from_logits, sample
from spire.verification import output_tokens, verify, verify_greedy

N = 100_000


def _rounds(p, q, greedy_draft: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor(p)
    q_dist = torch.tensor(q)
    if greedy_draft:
        d = torch.full((N, 1), int(q_dist.argmax()))
        q_used = torch.nn.functional.one_hot(d[:, 0], len(q)).float()[:, None]  # what d was drawn from
    else:
        d = sample(q_dist.expand(N, -1), g)[:, None]
        q_used = q_dist.expand(N, 1, -1)
    n_acc, nxt = verify(d, q_used, p.expand(N, 2, -1), g)
    first = torch.where(n_acc == 1, d[:, 0], nxt)  # the token emitted at the first position
    return n_acc, first


@pytest.mark.parametrize("greedy_draft", [True, False])
def test_case1_emitted_tokens_follow_p(greedy_draft):
    p, q = [0.5, 0.3, 0.2], [0.6, 0.3, 0.1]
    _, first = _rounds(p, q, greedy_draft)
    counts = np.bincount(first.numpy(), minlength=3)
    assert chisquare(counts, np.array(p) * N).pvalue > 1e-3
    assert abs(counts[1] / N - 0.3) < 0.01  # the wrong implementation emits ~0 of token 1


def test_case2_acceptance_rate():
    p, q = [0.4, 0.35, 0.25], [0.35, 0.4, 0.25]
    n_acc, _ = _rounds(p, q, greedy_draft=False)
    assert abs(n_acc.float().mean().item() - 0.95) < 0.01
    n_acc, _ = _rounds(p, q, greedy_draft=True)
    assert abs(n_acc.float().mean().item() - 0.35) < 0.01


def test_draft_equal_to_target_always_accepts():
    """CASES.md 4: identical transformed p and q accept everything (greedy and T=0.5, top-p 0.8)."""
    torch.manual_seed(0)
    logits = torch.randn(64, 5, 50) * 3
    g = torch.Generator().manual_seed(1)
    for params in (SamplingParams(0.0), SamplingParams(0.5, top_p=0.8)):
        p = probs_from_logits(logits, params)
        d = sample(p[:, :4], g)
        n_acc, _ = verify(d, p[:, :4], p, g)
        assert n_acc.eq(4).all()


def test_residual_is_finite_when_p_equals_q():
    p = torch.full((1, 2, 4), 0.25)
    n_acc, nxt = verify(torch.tensor([[1]]), p[:, :1], p, torch.Generator().manual_seed(0))
    assert n_acc.item() == 1 and 0 <= nxt.item() < 4


def test_sampling_transforms():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert probs_from_logits(logits, SamplingParams(0)).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    topk = probs_from_logits(logits, SamplingParams(1.0, top_k=2))
    assert topk[0, 2:].sum() == 0 and abs(topk.sum() - 1) < 1e-6
    full = logits.softmax(-1)[0]
    topp = probs_from_logits(logits, SamplingParams(1.0, top_p=0.8))[0]
    keep = int((full.cumsum(0) - full < 0.8).sum())  # tokens before the mass reaches 0.8, plus that one
    assert (topp[keep:] == 0).all() and (topp[:keep] > 0).all()
    from spire.errors import ConfigError

    for bad in (dict(temperature=-1), dict(temperature=float("inf")), dict(top_p=0), dict(top_p=1.5),
                dict(top_k=-1)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    # a tiny temperature is (nearly) greedy, never NaN (logits / 1e-38 overflowed to inf, and inf - inf is NaN)
    big = torch.tensor([[30.0, 29.0, -5.0], [3.0, 3.0, 1.0]])
    for T in (1e-38, 1e-45, 1e-320):
        p = probs_from_logits(big, SamplingParams(T))
        assert torch.isfinite(p).all() and p[0].tolist() == [1.0, 0.0, 0.0] and p[1].tolist() == [0.5, 0.5, 0.0]
    assert torch.allclose(probs_from_logits(big, SamplingParams(0.7)), (big / 0.7).softmax(-1))


# --- every position of a block, the bonus token included, with p differing from position to position ---------
# p_j: the target's distribution at block position j (j = k is the bonus position), q_j: the draft's. The toy
# model is context-free, so the token emitted at position j, among the rows whose round reaches j (all of the
# first j drafts accepted), is distributed as p_j. The bonus p_k is close to q_{k-1} so that the off-by-one
# "bonus from normalize(max(p_k - q_{k-1}, 0))" moves most of the bonus mass; the correction at j = 0 and 1
# differs from p_j a lot because q_j differs from p_j.
TOY_P = [[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.3, 0.4, 0.2, 0.1]]  # positions 0, 1 and the bonus 2
TOY_Q = [[0.25, 0.25, 0.25, 0.25], [0.25, 0.45, 0.2, 0.1]]
N_BLOCK = 2_000  # rows (~600 full accepts): the mutants below give p < 1e-9 here, the honest sampler ~U(0, 1)


def _mutant_verify(kind: str):
    """A deliberately wrong :func:`verify` (the mutation check): "bonus-residual" draws the bonus after a full
    accept from normalize(max(p_k - q_{k-1}, 0)); "correction-from-p" draws the correction from p instead of
    the residual."""

    def wrong(draft_tokens, q, p, generator=None):
        B, k = draft_tokens.shape
        idx = draft_tokens[..., None]
        p_x = p[:, :k].gather(-1, idx).squeeze(-1)
        q_x = q.gather(-1, idx).squeeze(-1)
        u = torch.rand(B, k, generator=generator)
        n_acc = (u * q_x < p_x).long().cumprod(-1).sum(-1)
        rows = torch.arange(B)
        p_next = p[rows, n_acc]
        pad = q[:, -1:] if kind == "bonus-residual" else torch.zeros_like(q[:, :1])
        q_next = torch.cat([q, pad], 1)[rows, n_acc]
        if kind == "correction-from-p":
            return n_acc, sample(p_next, generator)
        residual = (p_next - q_next).clamp_min(0)
        return n_acc, sample(residual / residual.sum(-1, keepdim=True), generator)

    return wrong


def _block_pvalues(verify_fn, seed=5) -> list[float]:
    """Chi-square p-value of the token emitted at each block position 0..k against p_j."""
    g = torch.Generator().manual_seed(seed)
    p, q = torch.tensor(TOY_P), torch.tensor(TOY_Q)
    k = q.shape[0]
    d = torch.stack([sample(q[j].expand(N_BLOCK, -1), g) for j in range(k)], 1)  # drafts drawn from q_j
    n_acc, nxt = verify_fn(d, q.expand(N_BLOCK, -1, -1), p.expand(N_BLOCK, -1, -1), g)
    block = torch.cat([d, torch.zeros_like(d[:, :1])], 1)
    block[torch.arange(N_BLOCK), n_acc] = nxt
    out = []
    for j in range(k + 1):
        reached = n_acc >= j
        counts = np.bincount(block[reached, j].numpy(), minlength=4)
        out.append(chisquare(counts, np.array(TOY_P[j]) * counts.sum()).pvalue)
    assert (n_acc == k).sum() > N_BLOCK // 4  # enough full accepts to test the bonus
    return out


def test_every_block_position_follows_its_p():
    """The drafted positions and the bonus token after a full accept (k = 2, p differs per position)."""
    assert min(_block_pvalues(verify)) > 1e-3


@pytest.mark.parametrize("kind,caught_at", [("bonus-residual", [2]), ("correction-from-p", [0, 1])])
def test_wrong_samplers_are_rejected(kind, caught_at):
    """Power: the same statistic rejects each mutant at the positions it corrupts (p < 1e-6, far below the
    1e-3 the honest sampler must pass)."""
    pv = _block_pvalues(_mutant_verify(kind))
    assert all(pv[j] < 1e-6 for j in caught_at), pv



def test_greedy_verification_is_rejection_sampling_with_one_hot_distributions():
    """verify_greedy gives the tokens of verify with one-hot p and q (the argmaxes), whatever the RNG."""
    g = torch.Generator().manual_seed(3)
    B, k, V = 64, 4, 5
    logits = torch.randn(B, k + 1, V, generator=g)
    best = logits.argmax(-1)
    d = torch.where(torch.rand(B, k, generator=g) < 0.7, best[:, :k], torch.randint(0, V, (B, k), generator=g))
    one_hot = torch.nn.functional.one_hot
    n_ref, next_ref = verify(d, one_hot(d, V).float(), one_hot(best, V).float(), g)
    n_acc, nxt = verify_greedy(d, logits)
    assert torch.equal(n_acc, n_ref) and torch.equal(nxt, next_ref)
    assert set(n_acc.tolist()) > {0, k}  # rejections at 0, mid-block and full accepts were all exercised
    block = output_tokens(d, n_acc, nxt)
    for b in range(B):
        n = int(n_acc[b])
        assert block[b, :n].tolist() == d[b, :n].tolist() and int(block[b, n]) == int(best[b, n])
