"""Rejection sampling on toy categorical distributions (CASES.md 1, 2, 4): checked statistically."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spire.sampling import SamplingParams, probs_from_logits, sample
from spire.verification import verify

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

    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
