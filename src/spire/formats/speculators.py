"""The speculators-layout ``config.json`` of an exported draft (vllm-project/speculators'
docs/architecture/model_formats.md): the builders the kinds' exporters call. The layout is described in
:mod:`spire.export`. Below the kinds: it imports the draft file's fingerprint and nothing of the drafts.
"""

from __future__ import annotations

from spire import __version__
from spire.errors import CheckpointError
from spire.formats.draft_file import FORMAT_VERSION, fingerprint

SPIRE_MODEL_TYPE = "spire_draft"


def verifier_config(target, name_or_path: str) -> dict:
    """``speculators_config.verifier``: the target folder, its HF architecture and shape keys, and spire's
    fingerprint of its embedding (:func:`~spire.formats.draft_file.fingerprint`)."""
    c = target.cfg
    return {"name_or_path": name_or_path, "architectures": [_ARCH.get(c.family, "LlamaForCausalLM")],
            "model_type": c.family, "hidden_size": c.d_model, "intermediate_size": c.d_ff,
            "num_hidden_layers": c.n_layers, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_positions,
            "bos_token_id": c.bos_id, "eos_token_id": c.eos_ids, "spire_fingerprint": fingerprint(target)}


_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
         "gemma3_text": "Gemma3ForCausalLM"}


def speculators_config(algorithm: str, k: int, verifier: dict) -> dict:
    """``speculators_config``: the algorithm, greedy and sample proposals of k tokens, the verifier."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k},
                                 {"proposal_type": "sample", "speculative_tokens": k}],
            "default_proposal_method": "greedy", "verifier": verifier}


def spire_export_config(meta: dict, state: dict, target, name_or_path: str, k: int) -> dict:
    """The config.json of an exported SPIRe draft (module docstring) from the draft file's spire metadata and
    tensors. Raises CheckpointError for a draft file without a SPIRe configuration."""
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        tf_version = None
    if "spire_config" not in meta:
        raise CheckpointError("the draft file holds no SPIRe configuration (a vanilla draft? use --draft vanilla)")
    sc = dict(meta["spire_config"])
    c = target.cfg
    n = c.n_layers
    source = list(sc["layers"]) if sc.get("layers") else list(range(n - sc["n_draft_layers"], n))
    # the draft vocabulary: SpireDraftModel's "vocab" buffer, draft column -> absolute target token id (not
    # EAGLE-3's d2t offsets; config.json says which)
    vocab = next(((name, int(t.shape[0])) for name, t in state.items() if name == "vocab" or name.endswith("d2t")),
                 None)
    # the weights' dtype: the first floating tensor (the vocab buffer, first when present, holds int64 ids)
    dtype = next((str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()), "float32")
    return {
        "architectures": ["SpireDraftModel"], "model_type": SPIRE_MODEL_TYPE, "torch_dtype": dtype,
        "transformers_version": tf_version, "spire_version": __version__, "spire_format_version": FORMAT_VERSION,
        "hidden_size": c.d_model, "num_hidden_layers": len(source), "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head, "intermediate_size": c.d_ff,
        "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_eps,
        "inputs": ["input_ids"] + [f"hidden_states.layer.{j}" for j in source],
        "speculators_model_type": "spire",
        "speculators_config": speculators_config("spire", k, verifier_config(target, name_or_path)),
        "spire": {"source_layers": source, "sink": sc.get("sink"), "window": sc.get("window"), "k": k,
                  "feedback_memory": sc.get("feedback_memory", True),
                  "target_activations": sc.get("target_activations", True),
                  "self_attend": sc.get("self_attend", True),
                  "feature_input": sc.get("feature_input", False),
                  "bridge": sc.get("bridge", False),
                  "draft_vocab": None if vocab is None else {
                      "tensor": vocab[0], "size": vocab[1], "holds": "target_ids",
                      "note": "the target token id of each draft column (EAGLE-3's d2t holds the offset "
                              "target_id - column instead)"},
                  "spire_config": sc, "training": {key: v for key, v in meta.items()
                                                   if key not in ("spire_config", "target")}},
    }


def independent_config(config: dict, target, name_or_path: str, k: int) -> dict:
    """An independent (vanilla) draft's HF config.json with spire's format version and ``speculators_config``
    (algorithm "independent") added."""
    return {**config, "spire_format_version": FORMAT_VERSION, "speculators_model_type": "independent",
            "speculators_config": speculators_config("independent", k, verifier_config(target, name_or_path))}
