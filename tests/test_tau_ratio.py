"""The paired CI of τ_SPIRe / τ_MagicDec that the main job's goal check reports."""

import numpy as np
import pytest

from spire.errors import ConfigError
from spire.evaluation.tau import bootstrap_ratio_ci, paired_ratio_ci


def test_paired_ratio_of_proportional_drafts_has_no_width():
    """Draft a emits exactly 1.5x draft b's tokens in the same rounds on every context: every resample gives
    1.5, whatever the spread between contexts."""
    rng = np.random.default_rng(0)
    rounds = rng.integers(10, 40, 30).astype(float)
    emitted_b = rounds * rng.uniform(1.2, 3.0, 30)
    lo, hi = paired_ratio_ci(1.5 * emitted_b, rounds, emitted_b, rounds)
    assert lo == pytest.approx(1.5) and hi == pytest.approx(1.5)


def test_pairing_removes_the_spread_shared_by_both_drafts():
    """Contexts differ a lot (easy and hard texts) and both drafts feel it: the paired CI of the ratio is far
    narrower than the ratio of the two unpaired CIs, and it contains the true ratio 1.2."""
    rng = np.random.default_rng(1)
    n = 48
    rounds = np.full(n, 16.0)
    difficulty = rng.uniform(1.2, 3.5, n)  # tokens per round of a context, shared by both drafts
    emitted_b = rounds * difficulty
    emitted_a = rounds * difficulty * 1.2 * rng.normal(1.0, 0.03, n)
    lo, hi = paired_ratio_ci(emitted_a, rounds, emitted_b, rounds)
    assert lo < 1.2 < hi and hi - lo < 0.03
    a_lo, a_hi = bootstrap_ratio_ci(emitted_a, rounds)
    b_lo, b_hi = bootstrap_ratio_ci(emitted_b, rounds)
    assert (a_hi / b_lo - a_lo / b_hi) > 5 * (hi - lo)


def test_paired_ratio_needs_the_same_contexts():
    with pytest.raises(ConfigError, match="same, non-empty"):
        paired_ratio_ci(np.ones(3), np.ones(3), np.ones(4), np.ones(4))
    with pytest.raises(ConfigError):
        paired_ratio_ci(np.ones(0), np.ones(0), np.ones(0), np.ones(0))


def test_goal_check_counts_a_cell_where_every_draft_loses_as_autoregressive():
    """SPIRe is 'the best option' only where its multiplier beats 1 (AD) and every other draft's: a cell where
    all drafts lose to AD is AD's, as in the report's 'Which pays off' table."""
    from spire.evaluation.report import goal_check

    def row(B, L, draft, m):
        return {"B": B, "L": L, "draft": draft, "multiplier": m, "delta_t": 2.0}

    rows = [row(1, 256, "spire", 0.67), row(1, 256, "magicdec", 0.5),   # AD wins
            row(64, 512, "spire", 1.6), row(64, 512, "magicdec", 1.4),  # SPIRe wins
            row(64, 4096, "spire", 1.8), row(64, 4096, "magicdec", 1.9)]  # MagicDec wins
    g = goal_check(rows, 64, 512, 4)
    assert g["spire_best_share"] == pytest.approx(1 / 3)
    assert g["spire_vs_magicdec"] == pytest.approx(1.6 / 1.4)
