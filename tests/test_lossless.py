"""Speculative sampling reproduces the target's distribution (chi-square), for every draft type, on a small
transformer over the first generated positions (issue 3; Leviathan et al. 2023, Theorem 1)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.drafts.vanilla import VanillaDraft
from spire.sampling import SamplingParams, probs_from_logits
from tests.oracle import generate
from tests.conftest import make_tiny
from tests.helpers import NoisyTargetDraft

N = 3000  # rows of one batch, all with the same prompt


def _exact_marginals(target, prompt, params):
    """Target's exact distribution of generated token 1 and the marginal of token 2."""
    ids = torch.tensor([prompt])
    p1 = probs_from_logits(target(ids, torch.arange(len(prompt))[None]).logits[0, -1], params)  # (V,)
    V = p1.shape[0]
    ext = torch.cat([ids.expand(V, -1), torch.arange(V)[:, None]], 1)
    p2_given = probs_from_logits(target(ext, torch.arange(ext.shape[1])[None].expand_as(ext)).logits[:, -1], params)
    return p1.numpy().astype(float), (p1[:, None] * p2_given).sum(0).numpy().astype(float)


def _chi2(samples, p):
    counts = np.bincount(samples, minlength=len(p)).astype(float)
    big = p * len(samples) >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(p[big], p[~big].sum()) * len(samples)
    keep = exp > 0
    return chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=20, top_p=0.9)])
def test_speculative_sampling_matches_target_distribution(params):
    target = make_tiny(seed=11)
    with torch.no_grad():  # soften the tiny model so that many tokens have mass
        target.lm_head.weight.mul_(0.35)
    prompt = [5, 17, 42, 8, 60, 3, 71]
    p1, p2 = _exact_marginals(target, prompt, params)
    drafts = [MagicDecDraft(sink=1, window=3), NoisyTargetDraft(noise=1.5),
              SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=4))),
              VanillaDraft(make_tiny(seed=4, n_layers=1))]
    for seed, draft in enumerate(drafts):
        res = generate(target, [prompt] * N, 3, draft=draft, k=3, params=params,
                       generator=torch.Generator().manual_seed(100 + seed))
        first = np.array([t[0] for t in res.tokens])
        second = np.array([t[1] for t in res.tokens])
        assert _chi2(first, p1) > 1e-3, draft.name
        assert _chi2(second, p2) > 1e-3, draft.name
        assert 1.0 < res.tau <= 4.0


def test_chi2_detects_a_wrong_distribution():
    """The check above can fail: samples from q instead of p are rejected."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.6, 0.3, 0.1])
    assert _chi2(rng.choice(3, size=N, p=q), p) < 1e-6


@pytest.mark.slow
def test_smollm2_first_positions_follow_target(smollm2):
    """The real target at T = 1: the first generated token, and the second given the most likely first,
    are distributed as the target's p, for MagicDec (window 4) and an untrained SPIRe draft."""
    model, tok = smollm2
    prompt = tok("The capital of France is").input_ids  # a peaked first token, a broad second one
    params = SamplingParams(1.0)
    ids = torch.tensor([prompt])
    pos = torch.arange(len(prompt))[None]
    with torch.no_grad():
        p1 = probs_from_logits(model(ids, pos).logits[0, -1], params)
        x1 = int(p1.argmax())
        ext = torch.tensor([prompt + [x1]])
        p2 = probs_from_logits(model(ext, torch.arange(ext.shape[1])[None]).logits[0, -1], params)
    n = 600
    for seed, draft in enumerate([MagicDecDraft(sink=1, window=4),
                                  SpireDraft(SpireDraftModel(model, SpireConfig(n_draft_layers=4, window=8)))]):
        res = generate(model, [prompt] * n, 2, draft=draft, k=2, params=params,
                       generator=torch.Generator().manual_seed(50 + seed))
        first = np.array([t[0] for t in res.tokens])
        assert _chi2(first, p1.numpy().astype(float)) > 1e-3, draft.name
        second = np.array([t[1] for t in res.tokens if t[0] == x1])
        assert len(second) > 200
        assert _chi2(second, p2.numpy().astype(float)) > 1e-3, draft.name
