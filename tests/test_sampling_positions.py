"""Speculative sampling at T > 0 reproduces the target at *every* emitted position (SPIRE.md §5; issue 16):
the bonus token after a full accept, the first token of the second round, every block position, in a batch
of rows with different prompt lengths, with temperature, top-k and top-p.

Each emitted token y at context c is turned into u = P(Y before y) + U * p(y | c) (tokens ordered by
descending p(. | c), U uniform): when every token is drawn from the target's p(. | c), the u of all tokens
are independent and uniform on (0, 1) (the randomized probability integral transform), whatever the
contexts. Each group of tokens is tested with a chi-square on 10 equal bins of u. The contexts' exact p
come from an uncached forward of the whole emitted sequence.

The mutation checks run the same statistic with a deliberately wrong sampler patched into the round loop
and require a rejection: it is sized to catch these mutants, not bigger.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.sampling import SamplingParams, probs_from_logits
import tests.oracle as spec
from tests.oracle import generate
from tests.conftest import make_tiny
from tests.helpers import NoisyTargetDraft
from tests.test_verification import _mutant_verify

K = 2  # small k: ~1/3 of the rounds accept everything, so many bonus tokens
LENGTHS = (1, 9, 23)  # prompts of different lengths, interleaved in one batch
ROWS = 300  # per prompt length: ~1,200 bonus tokens; the mutants give p < 1e-9 in their group
NEW = 6  # at least two rounds per row (a round emits at most K + 1 = 3)


def _target():
    target = make_tiny(seed=11)
    with torch.no_grad():  # soften the tiny model so that many tokens have mass
        target.lm_head.weight.mul_(0.35)
    return target


@pytest.fixture(scope="module")
def soft_target():
    return _target()


def _prompts():
    g = torch.Generator().manual_seed(2)
    base = [torch.randint(0, 97, (n,), generator=g).tolist() for n in LENGTHS]
    return [base[i % len(base)] for i in range(ROWS * len(base))]


def _pit_groups(target, draft, params, seed) -> dict[str, np.ndarray]:
    """Generate, then the u of every emitted token, grouped: all, bonus (a full accept's extra token),
    round2-first (the first token of each row's second round), position j of a round, prompt length."""
    prompts = _prompts()
    res = generate(target, prompts, NEW, draft=draft, k=K, params=params,
                   generator=torch.Generator().manual_seed(seed))
    g = np.random.default_rng(seed)
    groups: dict[str, list[float]] = {}
    for n in LENGTHS:
        rows = [b for b, p in enumerate(prompts) if len(p) == n]
        seqs = torch.tensor([prompts[b] + res.tokens[b] for b in rows])
        with torch.no_grad():
            logits = target(seqs, torch.arange(seqs.shape[1])[None].expand_as(seqs)).logits[:, n - 1: -1]
        p = probs_from_logits(logits, params).double().numpy()  # (rows, NEW, V): p of each emitted token
        for i, b in enumerate(rows):
            assert len(res.tokens[b]) == NEW
            t, rnd = 0, 0
            while t < NEW:
                acc = res.accepted_per_round[rnd][b]
                for j in range(acc + 1):
                    if t == NEW:
                        break
                    dist, y = p[i, t], res.tokens[b][t]
                    assert dist[y] > 0, f"token {y} has no mass under the transformed target (params {params})"
                    before = dist[dist > dist[y]].sum() + dist[(dist == dist[y]) & (np.arange(len(dist)) < y)].sum()
                    u = before + g.random() * dist[y]
                    keys = ["all", f"position{j}", f"length{n}"]
                    keys += ["bonus"] if j == K else []
                    keys += ["round2-first"] if rnd == 1 and j == 0 else []
                    for key in keys:
                        groups.setdefault(key, []).append(u)
                    t += 1
                rnd += 1
    return {key: np.array(v) for key, v in groups.items()}


def _uniform_pvalue(u: np.ndarray, bins: int = 10) -> float:
    counts = np.bincount(np.minimum((u * bins).astype(int), bins - 1), minlength=bins)
    return chisquare(counts).pvalue


CASES = [  # (draft, params): temperature; temperature + top-k + top-p; an (untrained) SPIRe draft with top-p
    (lambda: MagicDecDraft(sink=1, window=3), SamplingParams(1.0)),
    (lambda: NoisyTargetDraft(noise=0.6), SamplingParams(0.8, top_k=20, top_p=0.9)),
    (lambda: SpireDraft(SpireDraftModel(_target(), SpireConfig(n_draft_layers=2, window=4))),
     SamplingParams(0.7, top_p=0.95)),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_position_follows_the_target(soft_target, case):
    make_draft, params = CASES[case]
    groups = _pit_groups(soft_target, make_draft(), params, seed=20 + case)
    assert len(groups["bonus"]) > 300 and len(groups["round2-first"]) == ROWS * len(LENGTHS)
    pvalues = {key: _uniform_pvalue(u) for key, u in groups.items()}
    assert min(pvalues.values()) > 1e-3, pvalues


def _target_without_truncation(logits, params):
    """Mutant: the target's p in the verify block ignores top-k / top-p (applied to the draft only)."""
    if logits.dim() == 3:
        params = SamplingParams(params.temperature)
    return probs_from_logits(logits, params)


@pytest.mark.parametrize("mutant,case,group", [
    ("bonus-residual", 0, "bonus"),  # the named off-by-one: bonus from normalize(max(p_k - q_{k-1}, 0))
    ("correction-from-p", 1, "all"),  # the correction drawn from p instead of the residual
    ("bonus-residual", 2, "bonus"),
])
@pytest.mark.slow
def test_wrong_samplers_fail_this_statistic(soft_target, monkeypatch, mutant, case, group):
    """Power: with the mutant in the round loop, the same test rejects (p < 1e-3) in the group it corrupts."""
    make_draft, params = CASES[case]
    monkeypatch.setattr(spec, "verify", _mutant_verify(mutant))
    groups = _pit_groups(soft_target, make_draft(), params, seed=20 + case)
    assert _uniform_pvalue(groups[group]) < 1e-3


@pytest.mark.slow
def test_truncation_of_the_draft_only_is_caught(soft_target, monkeypatch):
    """Mutant: top-k / top-p applied to q but not to the target's p: tokens outside the target's nucleus
    are emitted (a mass-zero token is an immediate failure)."""
    make_draft, params = CASES[1]
    monkeypatch.setattr(spec, "probs_from_logits", _target_without_truncation)
    with pytest.raises(AssertionError, match="no mass under the transformed target"):
        _pit_groups(soft_target, make_draft(), params, seed=21)
