"""Beyond the paper: any HF config, hardware and dtypes, attention / embedding FLOPs, mixed batches, best k,
memory capacity (CASES.md 10). Expected values are computed by hand in the comments."""

import json

from dataclasses import replace

import numpy as np

import pytest

from spire.errors import ConfigError
from spire.throughput import ModelShape, get_preset, round_costs, throughput_rows
from spire.throughput import shapes
from spire.throughput.analysis import read_contexts, sample_contexts
from spire.throughput.cost_model import CostOptions, RowOptions, batch_costs, tau_from_alpha
from spire.throughput.hardware import DTYPE_BYTES, HARDWARE, custom_hardware, get_hardware
from spire.throughput.shapes import preset_from_configs, spire_draft_from_config

BYTES2 = CostOptions(weight_bytes=2, kv_bytes=2)  # 2 bytes per weight and KV value

PAPER = get_preset("paper-67m")

QWEN2_05B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
GEMMA_2B = {"model_type": "gemma", "hidden_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 8,
            "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 16384, "vocab_size": 256000}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "tie_word_embeddings": False}


# --- shapes from any HF config ----------------------------------------------------------------------------


def test_hf_configs_give_published_parameter_counts():
    qwen = ModelShape.from_hf_config(QWEN2_05B)
    assert (qwen.d_head, qwen.q_per_kv, qwen.n_kv, qwen.tie_embeddings) == (64, 7, 2, True)
    # published 494,032,768 = body (its q/k/v biases 896 + 2·128 per layer included) + embedding + final norm (896)
    assert qwen.extra_per_layer == 1152
    assert qwen.body_params() + qwen.embedding_params() + 896 == 494_032_768
    gemma = ModelShape.from_hf_config(GEMMA_2B)
    assert (gemma.d_head, gemma.n_kv, gemma.tie_embeddings) == (256, 1, True)  # Gemma ties by default
    assert gemma.body_params() == 18 * 110_104_576  # head_dim 256 ≠ 2048 / 8
    assert gemma.body_params() + gemma.embedding_params() + 2048 == 2_506_172_416  # published Gemma 2B
    mistral = ModelShape.from_hf_config(MISTRAL_7B)
    assert mistral.body_params() + mistral.embedding_params() + 4096 == 7_241_732_096  # published Mistral 7B
    nested = {"model_type": "gemma3", "text_config": {**GEMMA_2B, "model_type": "gemma3_text"}}
    g3 = ModelShape.from_hf_config(nested)  # Gemma 3 adds q/k norms (2·256) and two norms per block (2·2048)
    assert g3.extra_per_layer == 2 * 256 + 2 * 2048 and replace(g3, extra_per_layer=0) == gemma


@pytest.mark.parametrize(
    "config, match",
    [
        ({k: v for k, v in MISTRAL_7B.items() if k != "hidden_size"}, "lacks the key 'hidden_size'"),
        ({**MISTRAL_7B, "num_key_value_heads": 5}, "not a multiple"),
        ({**MISTRAL_7B, "num_hidden_layers": -2}, "num_hidden_layers must be a positive integer"),
        ({**MISTRAL_7B, "intermediate_size": "big"}, "intermediate_size must be a positive integer"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_hf_config(config, match):
    with pytest.raises(ConfigError, match=match):
        ModelShape.from_hf_config(config)


def test_config_files_and_spire_draft_configs(tmp_path):
    folder = tmp_path / "mistral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MISTRAL_7B))
    assert ModelShape.from_hf_config_file(folder) == ModelShape.from_hf_config(MISTRAL_7B)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelShape.from_hf_config_file(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        ModelShape.from_hf_config_file(tmp_path / "missing.json")

    smol = shapes.SMOLLM2_135M
    assert spire_draft_from_config(smol, {"n_draft_layers": 8, "sink": 1, "window": 64}) == (smol.with_layers(8), 1, 64)
    from safetensors.numpy import save_file

    meta = {"spire_config": {"n_draft_layers": 6, "sink": 2, "window": 32, "mix_init": 4.0}}
    save_file({"w": np.zeros(1, np.float32)}, str(tmp_path / "d.safetensors"), metadata={"spire": json.dumps(meta)})
    assert spire_draft_from_config(smol, tmp_path / "d.safetensors") == (smol.with_layers(6), 2, 32)
    with pytest.raises(ConfigError, match="exceeds the target's 30 layers"):
        spire_draft_from_config(smol, {"n_draft_layers": 31})


def test_preset_from_configs_defaults():
    mistral = ModelShape.from_hf_config(MISTRAL_7B)
    p = preset_from_configs(mistral)
    assert p.drafts["vanilla"].n_layers == 4 and p.drafts["spire"].n_layers == 8  # ceil(32/8), ceil(32/4)
    with pytest.raises(ConfigError, match="vocab_size 151936 differs"):
        preset_from_configs(mistral, vanilla=ModelShape.from_hf_config(QWEN2_05B))


# --- hardware, dtypes -----------------------------------------------------------------------------------


def test_hardware_presets():
    assert set(HARDWARE) == {"h100-sxm", "h200", "b200", "a100", "tpu-v5e", "mi300x"}
    assert round(get_hardware("h100-sxm").hoi("fp8")) == 591  # 1979e12 / 3.35e12 ≈ the paper's 600
    assert get_hardware("a100").hoi("bf16") == pytest.approx(312e12 / 2.039e12)
    assert get_hardware("tpu-v5e").hoi("int4") == pytest.approx(394e12 / 819e9)  # int4 at the int8 rate
    with pytest.raises(ConfigError, match="no fp8 peak"):
        get_hardware("a100").hoi("fp8")
    with pytest.raises(ConfigError, match="unknown hardware 'v100'"):
        get_hardware("v100")
    with pytest.raises(ConfigError, match="bandwidth must be a positive number"):
        custom_hardware(1e15, -1)
    assert DTYPE_BYTES["bf16"] == 2 and DTYPE_BYTES["int4"] == 0.5


def test_tokens_per_second():
    # AD step at (64, 512), memory-bound: (N + KV) bytes / 3.35e12 B/s = 603,987,968 / 3.35e12 s
    hw = get_hardware("h100-sxm")
    rows = throughput_rows(PAPER, [64], [512], RowOptions(hoi=hw.hoi("fp8"), flops_per_s=hw.flops_for("fp8")))
    assert rows[2]["ad_tokens_per_s"] == pytest.approx(64 * 3.35e12 / 603_987_968)
    assert rows[2]["sd_tokens_per_s"] == pytest.approx(rows[2]["ad_tokens_per_s"] * rows[2]["multiplier"])


def test_bytes_per_value_scale_memory_time():
    # bf16 weights and KV at HOI 300 take the same time as 1-byte values at HOI 600: same multipliers
    a = throughput_rows(PAPER, [64], [512])
    b = throughput_rows(PAPER, [64], [512], RowOptions(hoi=300, cost=CostOptions(weight_bytes=2, kv_bytes=2)))
    assert [r["multiplier"] for r in a] == pytest.approx([r["multiplier"] for r in b])
    c = round_costs(PAPER.target, PAPER.target, "magicdec", 2, 100, options=CostOptions(weight_bytes=2, kv_bytes=0.5))
    assert (c.target.N, c.target.KV) == (2 * 67_117_056, 0.5 * 2 * 100 * 16_384)


def test_memory_check_with_device_size():
    # Llama 3 70B in bf16 on a 180 GB B200: weights 136.9 GB + 8B draft 14.0 GB; KV 327,680 B/token (target)
    hw = get_hardware("b200")
    p = get_preset("llama3-70b")
    rows = throughput_rows(p, [64], [512, 2048], RowOptions(memory_bytes=hw.memory_bytes, cost=BYTES2))
    vanilla_512 = rows[0]
    assert vanilla_512["memory_bytes_needed"] == 2 * (68_452_352_000 + 6_979_584_000) + 64 * 512 * 2 * (163_840 + 65_536)
    assert vanilla_512["fits"] is True and vanilla_512["multiplier"] > 1
    assert [r["fits"] for r in rows if r["L"] == 2048] == [False, True, False]  # +42.9 GB target KV; MagicDec
    assert all(r["multiplier"] is None for r in rows if r["fits"] is False)
    on_h100 = throughput_rows(p, [1], [8], RowOptions(memory_bytes=80e9, cost=BYTES2))  # 137 GB of weights alone
    assert [r["fits"] for r in on_h100] == [False, False, False]


# --- attention FLOPs and embeddings ---------------------------------------------------------------------


def test_attention_flops_and_embeddings():
    o = CostOptions(attention_flops=True)
    c = round_costs(PAPER.target, PAPER.drafts["spire"], "spire", 1, 512, options=o)
    # target: 2·N + 4·8 layers·8 heads·128·512; draft (2 layers, window 1 + 64 = 65): 2·N_d + proj + 4·2·8·128·65
    assert c.target.C == 2 * 67_117_056 + 4 * 8 * 8 * 128 * 512
    assert c.verify.C == 5 * c.target.C
    assert c.draft.C == 2 * 16_779_264 + 2 * (2 * 2 * 8 * 512 * 128) + 4 * 2 * 8 * 128 * 65
    smol = get_preset("smollm2-135m")
    e = round_costs(smol.target, smol.drafts["spire"], "spire", 4, 100, options=CostOptions(embeddings=True))
    assert e.target.N == smol.target.body_params() + 49_152 * 576
    assert e.target.C == 2 * 4 * (smol.target.body_params() + 49_152 * 576)
    (row,) = [r for r in throughput_rows(smol, [4], [100], RowOptions(cost=CostOptions(embeddings=True))) if r["draft"] == "spire"]
    plain = round_costs(smol.target, smol.drafts["spire"], "spire", 4, 100)
    # tied embedding counted once; the SPIRe draft shares the target's
    assert row["memory_bytes_needed"] == (smol.target.body_params() + plain.target.KV + smol.drafts["spire"].body_params()
                                          + plain.draft.KV + 49_152 * 576)
    with pytest.raises(ConfigError, match="vocab_size"):
        throughput_rows(PAPER, [1], [8], RowOptions(cost=CostOptions(embeddings=True)))  # the paper gives no vocabulary


# --- mixed batches --------------------------------------------------------------------------------------


def test_mixed_batch():
    ctx = [64, 4096, 512, 96]
    c = batch_costs(PAPER.target, PAPER.drafts["spire"], "spire", ctx)
    assert c.target.KV == (64 + 4096 + 512 + 96) * 16_384
    # draft windows 1 + L//8: 9 + 513 + 65 + 13 = 600 = 4·(1 + 1192//8): the same as the uniform batch at the mean
    assert c.draft.KV == 600 * 4096
    rows = throughput_rows(PAPER, options=RowOptions(contexts=ctx))
    assert [(r["B"], r["L"]) for r in rows] == [(4, 1192)] * 3
    assert rows[2]["contexts"] == {"n": 4, "min": 64, "mean": 1192.0, "max": 4096}
    assert rows[2]["multiplier"] == pytest.approx(rows[2]["uniform_multiplier"])
    # with spire's own fixed window of 64 the draft cache saturates: Σ min(L, 65) = 64 + 65 + 65 + 65 = 259
    fixed = batch_costs(PAPER.target, PAPER.drafts["spire"], "spire", ctx, options=CostOptions(window=64))
    assert fixed.draft.KV == 259 * 4096
    with pytest.raises(ConfigError, match="context length must be a positive integer"):
        batch_costs(PAPER.target, PAPER.target, "magicdec", [5, 0])


def test_context_distributions(tmp_path):
    a = sample_contexts("lognormal:median=512,sigma=1", 2000, seed=3)
    assert a == sample_contexts("lognormal:median=512,sigma=1", 2000, seed=3)
    assert 450 < np.median(a) < 580 and min(a) >= 1
    assert max(sample_contexts("lognormal:median=512,sigma=2,max=1000", 500)) == 1000
    u = sample_contexts("uniform:low=10,high=20", 500)
    assert min(u) == 10 and max(u) == 20
    assert sample_contexts("fixed:L=77", 3) == [77, 77, 77]
    for bad, match in [("gauss:mu=1", "unknown context distribution"), ("lognormal:median=512", "takes"),
                       ("lognormal:median=-5,sigma=1", "positive"), ("uniform:low=5,high=1", "high < low"),
                       ("lognormal:median=x,sigma=1", "not key=number")]:
        with pytest.raises(ConfigError, match=match):
            sample_contexts(bad, 4)
    (tmp_path / "c.txt").write_text("100\n200, 300\n")
    assert read_contexts(tmp_path / "c.txt") == [100, 200, 300]
    (tmp_path / "c.json").write_text("[7, 8]")
    assert read_contexts(tmp_path / "c.json") == [7, 8]
    (tmp_path / "neg.txt").write_text("5 -3")
    with pytest.raises(ConfigError, match="must be positive"):
        read_contexts(tmp_path / "neg.txt")


# --- best k from an acceptance rate ---------------------------------------------------------------------


def test_tau_from_alpha():
    assert tau_from_alpha(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2) and round(tau_from_alpha(0.8, 4), 4) == 3.3616
    assert tau_from_alpha(1, 4) == 5.0 and tau_from_alpha(0, 4) == 1.0
    with pytest.raises(ConfigError, match=r"alpha must be a number in \[0, 1\]"):
        tau_from_alpha(1.5, 4)


def test_best_k_by_hand():
    # B = 1, L = 512: every pass memory-bound, so Δt(k) = 1 + k·r with
    # r = (16,779,264 + 65·4,096) / (67,117,056 + 512·16,384) = 17,045,504 / 75,505,664
    r = 17_045_504 / 75_505_664
    by_hand = {k: (1 - 0.8 ** (k + 1)) / 0.2 / (1 + k * r) for k in range(1, 9)}
    (row,) = [r_ for r_ in throughput_rows(PAPER, [1], [512], RowOptions(alphas={"spire": 0.8}, best_k_max=8)) if r_["draft"] == "spire"]
    assert (row["best_k"], row["tau_source"]) == (4, "alpha=0.8")
    assert row["best_k_multiplier"] == pytest.approx(by_hand[4]) and row["multiplier"] == pytest.approx(by_hand[4])
    with pytest.raises(ConfigError, match="not both"):
        throughput_rows(PAPER, [1], [512], RowOptions(taus={"spire": 3.0}, alphas={"spire": 0.8}))
