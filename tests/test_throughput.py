"""The paper's cost model (SPIRE.md §2): shapes, golden numbers, memory capacity (CASES.md 10), plots."""

import math

import pytest

from spire.errors import ConfigError
from spire.throughput import (
    DRAFTS,
    PAPER_DRAFTS,
    PRESETS,
    CostOptions,
    ModelShape,
    RowOptions,
    critical_batch_size,
    delta_t,
    forward_time,
    get_preset,
    multiplier,
    throughput_rows,
    verify_operational_intensity,
)
from spire.throughput import shapes
from spire.throughput.plots import plot_multiplier_heatmaps, plot_multiplier_vs_L

GOLDEN_LS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
GOLDEN_B64 = {  # SPIRE.md §2: 67M target, B = 64, HOI 600, max, τ at L = 512
    "vanilla": [1.70, 1.65, 1.59, 1.51, 1.44, 1.39, 1.36, 1.34, 1.33, 1.33, 1.33],
    "magicdec": [0.83, 0.89, 1.00, 1.19, 1.45, 1.76, 2.05, 2.28, 2.42, 2.50, 2.55],
    "spire": [1.77, 1.85, 1.98, 2.17, 2.39, 2.61, 2.78, 2.89, 2.95, 2.99, 3.00],
}
PAPER = get_preset("paper-67m")


# --- shapes -------------------------------------------------------------------------------------------


def test_paper_body_params():
    assert shapes.TARGET_67M.body_params() == 67_117_056
    assert shapes.VANILLA_67M.body_params() == 8_390_656
    assert shapes.SPIRE_67M.body_params() == 16_779_264 == shapes.TARGET_67M.body_params() // 4


def test_smollm2_body_params_and_kv():
    s = shapes.SMOLLM2_135M
    assert s.body_params_per_layer() == 3_540_096
    assert s.body_params() == 30 * 3_540_096
    assert s.kv_values_per_token() == 2 * 30 * 3 * 64
    assert shapes.TARGET_67M.kv_values_per_token() == 16_384


def test_from_hf_config_smollm2():
    config = {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
    }  # fmt: skip
    assert ModelShape.from_hf_config(config) == shapes.SMOLLM2_135M  # head_dim defaults to 576 // 9
    assert ModelShape.from_hf_config({**config, "head_dim": 32}).d_head == 32
    with pytest.raises(ConfigError, match="intermediate_size"):
        ModelShape.from_hf_config({k: v for k, v in config.items() if k != "intermediate_size"})


def test_presets():
    assert set(PRESETS) == {"paper-67m", "llama3-70b", "smollm2-135m"}
    assert get_preset("paper-70b") is get_preset("llama3-70b")  # the skeleton's name stays an alias
    p70 = get_preset("llama3-70b")
    assert p70.target == shapes.LLAMA3_70B and p70.drafts["vanilla"] == shapes.LLAMA3_8B
    assert p70.drafts["spire"] == shapes.LLAMA3_70B.with_layers(20)
    smol = get_preset("smollm2-135m")
    assert smol.drafts["spire"] == smol.target.with_layers(8)
    assert 1 / 10 < smol.drafts["vanilla"].body_params() / smol.target.body_params() < 1 / 6
    assert smol.draft_shape("magicdec") == smol.target
    for p in PRESETS.values():  # the paper measured vanilla, MagicDec and SPIRe (SPIRE.md §2), not EAGLE-3 or n-gram
        assert set(p.taus) == {"vanilla", "magicdec", "spire"}
    assert set(DRAFTS) == {"vanilla", "magicdec", "spire", "eagle3", "ngram"}
    with pytest.raises(ConfigError, match="paper-67m, llama3-70b, smollm2-135m, paper-70b"):
        get_preset("llama")


# --- the model ----------------------------------------------------------------------------------------


def test_forward_time():
    assert forward_time(10, 1, 2, hoi=3) == 10
    assert forward_time(5, 1, 2, hoi=3) == 9
    assert forward_time(5, 1, 2, hoi=3, combine="sum") == 14


@pytest.mark.parametrize("draft", PAPER_DRAFTS)
def test_golden_b64_table(draft):
    """The paper's golden table (SPIRE.md §2: 67M target, B = 64, HOI 600, L = 8 .. 8192), two decimals."""
    rows = throughput_rows(PAPER, [64], GOLDEN_LS)
    got = [round(r["multiplier"], 2) for r in rows if r["draft"] == draft]
    assert got == GOLDEN_B64[draft]


def test_headline_64_512():
    """The paper's headline multipliers at (B, L) = (64, 512) (SPIRE.md §2)."""
    got = {d: round(multiplier(PAPER.taus[d], delta_t(PAPER, d, 64, 512)), 2) for d in PAPER_DRAFTS}
    assert got == {"spire": 2.78, "vanilla": 1.36, "magicdec": 2.05}


def test_delta_t_from_shape_pair_matches_preset():
    pair = (PAPER.target, PAPER.drafts["spire"])
    assert delta_t(pair, "spire", 8, 300) == delta_t(PAPER, "spire", 8, 300)
    assert delta_t(pair, "magicdec", 8, 300) == delta_t(PAPER, "magicdec", 8, 300)  # draft ignored


def test_rows_contract_and_order():
    rows = throughput_rows(PAPER, [1, 64], [8, 512], RowOptions(taus={"spire": 3.0}))
    assert [(r["B"], r["L"], r["draft"]) for r in rows[:4]] == [
        (1, 8, "vanilla"), (1, 8, "magicdec"), (1, 8, "spire"), (1, 512, "vanilla"),
    ]  # fmt: skip
    assert len(rows) == 2 * 2 * 3
    for r in rows:
        assert {"draft", "B", "L", "tau", "delta_t", "multiplier"} <= r.keys()
        assert r["multiplier"] == pytest.approx(r["tau"] / r["delta_t"])
        assert r["fits"] is None  # no memory size given: not checked
    spire = [r for r in rows if r["draft"] == "spire"]
    assert all(r["tau"] == 3.0 and r["tau_source"] == "override" for r in spire)


def test_sum_is_slower_than_max():
    for d in PAPER_DRAFTS:
        assert delta_t(PAPER, d, 64, 512, combine="sum") != delta_t(PAPER, d, 64, 512)


# --- memory capacity (CASES.md 10) --------------------------------------------------------------------


def test_memory_needed_counts_weights_and_both_caches():
    (vanilla, magicdec, spire) = throughput_rows(PAPER, [64], [512])
    N_t, KV_t = 67_117_056, 64 * 512 * 16_384
    assert vanilla["memory_bytes_needed"] == N_t + KV_t + 8_390_656 + 64 * 512 * 4096
    assert spire["memory_bytes_needed"] == N_t + KV_t + 16_779_264 + 64 * (1 + 512 // 8) * 4096
    assert magicdec["memory_bytes_needed"] == N_t + KV_t  # the target reading a view of its own cache
    (doubled, *_) = throughput_rows(PAPER, [64], [512], RowOptions(cost=CostOptions(weight_bytes=2, kv_bytes=2)))
    assert doubled["memory_bytes_needed"] == 2 * vanilla["memory_bytes_needed"]


def test_points_that_do_not_fit_have_no_multiplier():
    free = throughput_rows(PAPER, [1, 64], [512, 8192])
    capped = throughput_rows(PAPER, [1, 64], [512, 8192], RowOptions(memory_bytes=2e9))
    for a, b in zip(free, capped):
        if a["memory_bytes_needed"] <= 2e9:
            assert b["fits"] is True and b["multiplier"] == a["multiplier"]
        else:
            assert b["fits"] is False and b["multiplier"] is None and b["delta_t"] is None
    assert {r["fits"] for r in capped} == {True, False}  # (64, 8192) needs ~8.7 GB
    exact = free[0]["memory_bytes_needed"]
    (row, *_) = throughput_rows(PAPER, [1], [512], RowOptions(memory_bytes=exact))
    assert row["fits"] is True
    (row, *_) = throughput_rows(PAPER, [1], [512], RowOptions(memory_bytes=exact - 1))
    assert row["fits"] is False


# --- verification operational intensity (paper Figure 3) ----------------------------------------------


def test_critical_batch_size():
    target = PAPER.target
    B_crit = critical_batch_size(target, L=32)
    assert B_crit == 182
    OI = verify_operational_intensity
    assert OI(target, B_crit, 32) >= 600 > OI(target, B_crit - 1, 32)
    assert critical_batch_size(target, L=64) is None  # OI never reaches HOI: 2Nk/(Lx) < 600
    assert critical_batch_size(target, L=32, B_max=100) is None


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"Bs": [0]}, "B must be a positive integer"),
        ({"Ls": [-1]}, "L must be a positive integer"),
        ({"Bs": [1.5]}, "B must be a positive integer"),
        ({"Bs": [True]}, "B must be a positive integer"),
        ({"Bs": []}, "at least one B"),
        ({"k": 0}, "k must be a positive integer"),
        ({"hoi": 0}, "hoi must be a positive number"),
        ({"hoi": math.nan}, "hoi must be a positive number"),
        ({"combine": "avg"}, "combine must be one of max, sum"),
        ({"taus": {"eagle": 2.0}}, "unknown draft 'eagle'"),
        ({"taus": {"spire": 0.5}}, r"tau for spire must be a number in \[1, k\+1\]"),
        ({"k": 2}, "tau for magicdec"),  # the paper's τ = 3.891 > k + 1 = 3
        ({"memory_bytes": -1}, "memory_bytes must be a positive number"),
    ],
)
def test_bad_input_raises_config_error(kwargs, match):
    args = {"Bs": [64], "Ls": [512], **kwargs}
    Bs, Ls = args.pop("Bs"), args.pop("Ls")
    with pytest.raises(ConfigError, match=match):
        throughput_rows(PAPER, Bs, Ls, RowOptions(**args))


def test_bad_input_single_point():
    with pytest.raises(ConfigError, match="unknown draft"):
        delta_t(PAPER, "medusa", 1, 1)
    with pytest.raises(ConfigError, match="L must be"):
        delta_t(PAPER, "spire", 1, 0)
    with pytest.raises(ConfigError, match="k must be"):
        verify_operational_intensity(PAPER.target, 1, 1, k=-1)


# --- plots --------------------------------------------------------------------------------------------


def test_plots_write_pngs(tmp_path):
    rows = throughput_rows(PAPER, [1, 64], [8, 512, 8192], RowOptions(memory_bytes=2e9))  # includes points that do not fit
    heat = plot_multiplier_heatmaps(rows, tmp_path / "heat.png", "paper-67m")
    line = plot_multiplier_vs_L(rows, tmp_path / "sub" / "line.png", B=64)
    for path in (heat, line):
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["heat.png", "line.png"]  # no temp files
    with pytest.raises(ConfigError):
        plot_multiplier_vs_L(rows, tmp_path / "none.png", B=3)
