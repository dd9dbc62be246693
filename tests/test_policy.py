"""The cost-model k policy of spire serve (spire.serving.policy): its Δt is the paper's formula of
spire.throughput.cost_model, its choice is the argmax of τ(k)/Δt over k = 0..k_max (0 = AD), α follows the rounds
by maximum likelihood, and it falls back to AD where the model predicts that SD loses."""

from __future__ import annotations

import pytest

from spire.drafts import make_draft
from spire.errors import ConfigError
from spire.engine.engine import Engine
from spire.params import RequestParams
from spire.serving.policy import CostModelPolicy, RoundModel, round_model
from tests.oracle import generate
from spire.throughput.cost_model import CostOptions, delta_t, tau_from_alpha
from spire.throughput.shapes import ModelShape

# SmolLM2-135M: 30 layers, d 576, 9 heads over 3 KV heads of 64, d_ff 1536, 49152-token vocabulary, tied
SMOLLM2 = ModelShape(30, 576, 3, 3, 64, 1536, 49152, True)
SPIRE_DRAFT = SMOLLM2.with_layers(8)
OPTIONS = CostOptions(weight_bytes=4, kv_bytes=4, attention_flops=True, embeddings=True, sink=4, window=64)


def _model(hoi: float, kind: str = "spire") -> RoundModel:
    return RoundModel(SMOLLM2, SPIRE_DRAFT, kind, hoi, OPTIONS, OPTIONS)


@pytest.mark.parametrize("kind", ["spire", "magicdec", "vanilla"])
@pytest.mark.parametrize("B,L,k", [(1, 512, 1), (8, 2048, 4), (64, 512, 3)])
def test_delta_t_is_the_cost_model(kind, B, L, k):
    m = _model(12.0, kind)
    assert m.delta_t(B, L, k) == pytest.approx(delta_t((SMOLLM2, SPIRE_DRAFT), kind, B, L, k, 12.0, "max", OPTIONS),
                                               rel=1e-12)


def test_the_choice_is_the_argmax_of_the_modeled_multiplier():
    policy = CostModelPolicy(_model(12.0), k_max=6, alpha_prior=0.7)
    for B, L in [(1, 100), (4, 700), (16, 2000), (64, 512)]:
        Lr = -(-L // 64) * 64
        mult = [1.0] + [tau_from_alpha(0.7, k) / delta_t((SMOLLM2, SPIRE_DRAFT), "spire", B, Lr, k, 12.0, "max",
                                                          OPTIONS) for k in range(1, 7)]
        assert policy.multipliers(B, L) == pytest.approx(mult, rel=1e-12)
        assert policy.best_k(B, L) == max(range(7), key=lambda k: mult[k])


def test_falls_back_to_ad_where_sd_loses_and_drafts_where_it_wins():
    """A low operational intensity (a CPU) and a large batch: verify costs (k+1)x an AD step, so a weak draft
    loses at every k; at B = 1 (memory-bound) a good draft wins."""
    weak = CostModelPolicy(_model(5.0), k_max=4, alpha_prior=0.2, explore_every=0)
    assert weak.best_k(64, 512) == 0 and max(weak.multipliers(64, 512)[1:]) < 1.0
    good = CostModelPolicy(_model(5.0), k_max=4, alpha_prior=0.8)
    assert good.best_k(1, 512) >= 1 and max(good.multipliers(1, 512)) > 1.0


def test_alpha_is_the_maximum_likelihood_estimate():
    """Prior 0.6 over 16 row-rounds = 24 successes, 16 failures; then rounds of k = 3 accepting 3, 1, 0 add 4
    successes and 2 failures (a full accept has no failure), and k = 2 accepting 2, 2 adds 4 successes."""
    p = CostModelPolicy(_model(12.0), k_max=3, alpha_prior=0.6, prior_rounds=16)
    assert p.alpha == pytest.approx(0.6)
    p.observe([3, 1, 0], 3)
    assert p.alpha == pytest.approx(28 / 46)
    p.observe([2, 2], 2)
    assert p.alpha == pytest.approx(32 / 50)


def test_explores_after_a_run_of_ad_rounds():
    p = CostModelPolicy(_model(5.0), k_max=4, alpha_prior=0.2, explore_every=3)
    ks = [p.k_for(64, 512) for _ in range(8)]
    assert ks[:3] == [0, 0, 0] and ks[3] >= 1 and ks[4:7] == [0, 0, 0] and ks[7] >= 1


def test_bad_settings_are_refused():
    for kw in [dict(k_max=0), dict(alpha_prior=1.0), dict(alpha_prior=0.0), dict(prior_rounds=-1),
               dict(context_step=0), dict(explore_every=-1)]:
        with pytest.raises(ConfigError):
            CostModelPolicy(_model(5.0), **{"k_max": 3, **kw})


def test_the_engine_with_the_cost_model_policy_stays_lossless(tiny):
    """The policy over a real engine: the rounds drafted what it chose, and greedy output is still AD's."""
    draft = make_draft("magicdec", tiny, window=8)
    policy = CostModelPolicy(round_model(tiny, draft, hoi=5.0), k_max=3, alpha_prior=0.5, explore_every=4)
    engine = Engine(tiny, draft, k=3, max_running=4, max_len=96, k_policy=policy)
    prompts = [[1, 2, 3], [5] * 30, [7, 8, 9, 10, 11], list(range(40))]
    ids = [engine.add_request(p, RequestParams(max_tokens=12)) for p in prompts]
    out = {i: [] for i in ids}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_tokens
    for i, p in zip(ids, prompts):
        assert out[i] == generate(tiny, [p], 12).tokens[0]
    assert sum(engine.stats.rounds_by_k) == engine.stats.rounds
    # on the tiny target MagicDec's draft costs nearly a target step: the model picks AD, and explores every 5th
    assert engine.stats.rounds_by_k[0] > 2 * engine.stats.rounds_by_k[1] > 0
