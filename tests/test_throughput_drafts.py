"""The cost model prices EAGLE-3 and n-gram from their declared shape (spire.registry.Pricing), beside the
paper's three drafts whose golden numbers stay exact (tests/test_throughput.py)."""

import pytest

from spire.errors import ConfigError
from spire.throughput import RowOptions, delta_t, get_preset, throughput_rows
from spire.throughput.shapes import TARGET_67M, default_draft_shape

PAPER = get_preset("paper-67m")
HOI = 600


def t(C, N, KV):  # the paper's forward time in FLOP-equivalents (max of compute and memory)
    return max(C, (N + KV) * HOI)


def test_eagle3_shape_is_one_layer_with_the_fc_and_the_2d_attention_input():
    # 67M target: d = 512, 1 query head per KV head, 8 KV heads of 128, d_ff 4096
    s = default_draft_shape(TARGET_67M, "eagle3")
    assert s.n_layers == 1
    block = 2 * 512 + 3 * 8 * 512 * 128 + 8 * 128 * 512 + 3 * 512 * 4096  # the target's block: 8,389,632
    assert block == 67_117_056 // 8
    fc, qkv2, norm = 3 * 512 * 512, 3 * 8 * 512 * 128, 512  # fc 3d -> d, q/k/v over the fused half, its norm
    assert s.body_params() == block + fc + qkv2 + norm == 10_749_440
    assert s.kv_values_per_token() == 2 * 8 * 128  # one layer's KV


@pytest.mark.parametrize("B,L,k", [(64, 512, 4), (1, 4096, 4), (256, 256, 8)])
def test_eagle3_delta_t_by_hand(B, L, k):
    N_t, x_t = 67_117_056, 2 * 8 * 8 * 128
    N_d, x_d = 10_749_440, 2 * 8 * 128
    t_target = t(2 * N_t * B, N_t, B * L * x_t)
    t_verify = t((k + 1) * 2 * N_t * B, N_t, B * L * x_t)
    t_draft = t(2 * N_d * B, N_d, B * L * x_d)  # its KV over the whole context, as EAGLE-3 keeps it
    assert delta_t(PAPER, "eagle3", B, L, k) == pytest.approx((k * t_draft + t_verify) / t_target, rel=1e-12)


@pytest.mark.parametrize("B,L,k", [(64, 512, 4), (256, 64, 8)])
def test_ngram_costs_only_the_verify(B, L, k):
    N_t, x_t = 67_117_056, 2 * 8 * 8 * 128
    want = t((k + 1) * 2 * N_t * B, N_t, B * L * x_t) / t(2 * N_t * B, N_t, B * L * x_t)
    assert delta_t(PAPER, "ngram", B, L, k) == pytest.approx(want, rel=1e-12)
    if (B, L) == (64, 512):  # memory-bound verify: a round costs one AD step
        assert want == 1.0


def test_rows_for_the_new_kinds_only_with_their_tau():
    rows = throughput_rows(PAPER, [64], [512], RowOptions())
    assert [r["draft"] for r in rows] == ["vanilla", "magicdec", "spire"]  # the paper's table, unchanged
    rows = throughput_rows(PAPER, [64], [512], RowOptions(taus={"eagle3": 2.8, "ngram": 1.5}))
    by = {r["draft"]: r for r in rows}
    assert list(by) == ["vanilla", "magicdec", "spire", "eagle3", "ngram"]
    assert by["spire"]["multiplier"] == pytest.approx(2.78, abs=5e-3)  # the paper's golden value stays
    assert by["ngram"]["multiplier"] == pytest.approx(1.5)
    assert by["eagle3"]["multiplier"] == pytest.approx(2.8 / delta_t(PAPER, "eagle3", 64, 512, 4))
    with pytest.raises(ConfigError, match="unknown draft 'medusa'"):
        throughput_rows(PAPER, [64], [512], RowOptions(taus={"medusa": 2.0}))
