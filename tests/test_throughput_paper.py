"""Every number the paper quotes from its cost model (SPIRE.md §2-§3), checked against hand computations."""


import pytest

from spire.throughput import PAPER_DRAFTS, RowOptions, delta_t, get_preset, round_costs, throughput_rows
from spire.throughput import shapes
from spire.throughput.analysis import (
    NO_SPARSE_KV,
    ablation_rows,
    critical_context,
    growing_context_multiplier,
    growing_rows,
    headline,
    operational_intensity_data,
)
from spire.throughput.cost_model import critical_batch_size, saving_units

PAPER = get_preset("paper-67m")


def test_headline_gains():
    h = headline(PAPER)
    m = h["multiplier"]
    two = {d: round(v, 2) for d, v in m.items()}
    assert two == {"vanilla": 1.36, "magicdec": 2.05, "spire": 2.78}  # the paper's headline (SPIRE.md §2)
    # The paper's "+104 %" and "+35.6 %" are ratios of the two-decimal multipliers (104.41 %, 35.61 %):
    assert round(100 * (two["spire"] / two["vanilla"] - 1)) == 104
    assert round(100 * (two["spire"] / two["magicdec"] - 1), 1) == 35.6
    # From the unrounded model: +104.1 % and +35.4 % (the paper's 35.6 comes from rounding first).
    assert round(h["spire_gain_vs_vanilla_pct"]) == 104
    assert round(h["spire_gain_vs_vanilla_pct"], 1) == 104.1
    assert round(h["spire_gain_vs_magicdec_pct"], 1) == 35.4


def test_cost_analysis_formula():
    # saving = 10·(1 − 1/m) − 0.25; at m = 2.78: 10·1.78/2.78 − 0.25 = 6.40288 − 0.25
    assert saving_units(2.78) == pytest.approx(17.8 / 2.78 - 0.25)
    assert round(saving_units(2.78), 4) == 6.1529
    assert saving_units(1.0, training_cost=0.25) == -0.25  # no speedup: only the training cost
    assert saving_units(2.0, training_cost=0.0) == 5.0
    assert round(headline(PAPER)["spire_saving_units"], 3) == 6.151  # unrounded m = 2.77867
    rows = {r["draft"]: r for r in throughput_rows(PAPER, [64], [512], RowOptions(cost_analysis=True))}
    # MagicDec trains nothing; vanilla costs its body share 8,390,656 / 67,117,056 = 0.12502
    assert rows["magicdec"]["saving_units"] == pytest.approx(10 * (1 - 1 / rows["magicdec"]["multiplier"]))
    assert rows["vanilla"]["saving_units"] == pytest.approx(10 * (1 - 1 / rows["vanilla"]["multiplier"])
                                                            - 8_390_656 / 67_117_056)


def test_body_params_of_every_paper_shape():
    assert shapes.TARGET_67M.body_params() == 67_117_056
    assert shapes.VANILLA_67M.body_params() == 8_390_656
    assert shapes.SPIRE_67M.body_params() == 16_779_264
    # Llama 3: per layer 2·8192 + 10·8·8192·128 + 8·8·128·8192 + 3·8192·28672 = 855,654,400
    assert shapes.LLAMA3_70B.body_params() == 80 * 855_654_400 == 68_452_352_000
    assert shapes.LLAMA3_8B.body_params() == 32 * 218_112_000
    assert shapes.SPIRE_70B.body_params() == 20 * 855_654_400
    # plus untied embeddings (2·128,256·d) they give the published totals 70.55B and 8.03B
    assert shapes.LLAMA3_70B.body_params() + shapes.LLAMA3_70B.embedding_params() == 70_553_698_304
    assert shapes.LLAMA3_8B.body_params() + shapes.LLAMA3_8B.embedding_params() == 8_030_257_152
    # SmolLM2-135M (tied): 30·3,540,096 + 49,152·576 = 134,514,432; + the final norm (576) = the published 134,515,008
    assert shapes.SMOLLM2_135M.body_params() + shapes.SMOLLM2_135M.embedding_params() == 134_515_008 - 576


def test_tau_table_and_ablation_taus():
    assert shapes.PAPER_TAU_TABLE == {
        256: {"vanilla": 2.637, "magicdec": 4.005, "spire": 3.427},
        512: {"vanilla": 2.647, "magicdec": 3.891, "spire": 3.401},
        960: {"vanilla": 2.644, "magicdec": 3.793, "spire": 3.382},
    }
    assert shapes.PAPER_TAUS == shapes.PAPER_TAU_TABLE[512]
    assert list(shapes.ABLATION_TAUS.values()) == [3.401, 3.352, 2.959, 3.375, 3.069, 3.105]
    for name in ("paper-67m", "llama3-70b"):
        assert dict(get_preset(name).taus) == {"vanilla": 2.647, "magicdec": 3.891, "spire": 3.401}


# --- Figure 3 -------------------------------------------------------------------------------------------


def test_critical_context_and_batch():
    # L_crit: largest L with 2·N·k > HOI·L·x: 536,936,448 / (600·16,384) = 54.62 -> 54
    assert critical_context(PAPER.target) == 54
    assert critical_batch_size(PAPER.target, 54) is not None and critical_batch_size(PAPER.target, 55) is None
    # B_crit(L = 48) = ceil(600·N / (2·N·4 − 600·48·16,384)) = ceil(40,270,233,600 / 65,077,248) = ceil(618.8)
    assert critical_batch_size(PAPER.target, 48) == 619
    data = operational_intensity_data(PAPER.target, [32, 512], [1, 64], k=4)
    assert data["L_crit"] == 54 and [c["B_crit"] for c in data["curves"]] == [182, None]
    # OI(B=1, L=512) = 2·N·4 / (N + 512·16,384)
    assert data["curves"][1]["oi"][0] == pytest.approx(536_936_448 / (67_117_056 + 8_388_608))
    assert critical_context(shapes.LLAMA3_70B) == 5570  # 2·68.45e9·4 / (600·163,840) = 5570.7


# --- Figure 5 -------------------------------------------------------------------------------------------


def test_ablation_and_no_sparse_kv():
    rows = {r["variant"]: r for r in ablation_rows(PAPER, [512])}
    # by hand, every pass memory-bound at (64, 512): Δt = 1 + 4·(16,779,264 + 64·65·4,096) / (67,117,056 +
    # 64·512·16,384) = 1 + 4·33,818,624 / 603,987,968 = 1.2239688
    spire_dt = 1 + 4 * 33_818_624 / 603_987_968
    assert delta_t(PAPER, "spire", 64, 512) == pytest.approx(spire_dt)
    assert rows["SPIRe"]["multiplier"] == pytest.approx(3.401 / spire_dt)  # the paper's τ over Δt
    assert rows["HardTargetLoss"]["multiplier"] == pytest.approx(3.069 / spire_dt)  # = 2.5074
    # Full draft KV at (64, 512): every pass memory-bound, the draft reads exactly 1/4 of the target's
    # bytes (N/4 weights, x/4 KV), so Δt = 4·(1/4) + 1 = 2 and the multiplier is 3.401 / 2.
    assert rows[NO_SPARSE_KV]["delta_t"] == pytest.approx(2.0)
    assert rows[NO_SPARSE_KV]["multiplier"] == pytest.approx(1.7005)
    assert len(rows) == 7


# --- Figure 6 -------------------------------------------------------------------------------------------


def test_llama3_70b_extrapolation():
    """Figure 6's B = 64 slice at L = 8192, worked by hand from SPIRE.md §2 (the paper plots the curve but
    prints no number): every pass is memory-bound (C ≤ (N + KV)·600 for each), so
    Δt = 1 + 4·(N_d + KV_d) / (N_t + KV_t) with N_t + KV_t = 68,452,352,000 + 64·8192·163,840 = 154,351,697,920:
      vanilla (Llama 3 8B, full KV):  N_d + KV_d = 6,979,584,000 + 64·8192·65,536 = 41,339,322,368
                                      Δt = 2.071302, multiplier 2.647 / 2.071302 = 1.277940
      MagicDec (target over 1 + 8192 // 8 = 1025 positions): 68,452,352,000 + 64·1025·163,840 = 79,200,256,000
                                      Δt = 3.052462, multiplier 3.891 / 3.052462 = 1.274709
      SPIRe (20 target layers, 1025 positions): 17,113,088,000 + 64·1025·40,960 = 19,800,064,000
                                      Δt = 1.513116, multiplier 3.401 / 1.513116 = 2.247680"""
    p = get_preset("llama3-70b")
    got = {r["draft"]: r["multiplier"] for r in throughput_rows(p, [64], [8192])}
    assert got == pytest.approx({"vanilla": 1.277940, "magicdec": 1.274709, "spire": 2.247680}, abs=1e-6)
    assert delta_t(p, "vanilla", 64, 8192) == pytest.approx(1 + 4 * 41_339_322_368 / 154_351_697_920)
    assert delta_t(p, "magicdec", 64, 8192) == pytest.approx(1 + 4 * 79_200_256_000 / 154_351_697_920)
    assert delta_t(p, "spire", 64, 8192) == pytest.approx(1 + 4 * 19_800_064_000 / 154_351_697_920)


# --- the alternative metric: growing context ------------------------------------------------------------


def test_growing_context_reduces_to_fixed_for_one_token():
    for d in PAPER_DRAFTS:
        one = growing_context_multiplier(PAPER, d, 64, 512, 1, PAPER.taus[d])
        assert one == pytest.approx(PAPER.taus[d] / delta_t(PAPER, d, 64, 512))


def test_growing_context_sums_costs_at_growing_lengths():
    # τ = 2, G = 4: SD runs 2 rounds at lengths L and L + 2; AD runs 4 steps at L .. L + 3.
    def t(c):
        return max(c.C, (c.N + c.KV) * 600)

    L, B = 100, 8
    costs = [round_costs(PAPER.target, PAPER.drafts["spire"], "spire", B, L + i) for i in range(4)]
    ad = sum(t(c.target) for c in costs)
    sd = sum(4 * t(costs[i].draft) + t(costs[i].verify) for i in (0, 2))
    assert growing_context_multiplier(PAPER, "spire", B, L, 4, 2.0) == pytest.approx(ad / sd)
    rows = growing_rows(PAPER, [64], [8, 512], G=64)
    magicdec_8 = next(r for r in rows if r["draft"] == "magicdec" and r["L"] == 8)
    assert magicdec_8["multiplier"] > 1 > magicdec_8["multiplier_fixed_L"]  # L grows from 8 to 72
