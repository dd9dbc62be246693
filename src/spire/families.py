"""Reading an HF config.json into :class:`spire.model.ModelConfig` fields, family by family (issue 15).

What a family departs from Llama in becomes a field (biases, q/k norms, sandwich norms, norm offset, embedding
scale, activation, attention scale, per-layer RoPE and sliding window); what spire does not implement is
refused here, at load, with one error naming the feature (never computed wrongly). The dict is best the one
transformers normalizes (``AutoConfig.to_dict()``: class defaults that ``save_pretrained`` leaves out, derived
``layer_types``, current RoPE parameters), as :func:`spire.loading.read_model_config` passes; legacy keys
(``rope_scaling`` + ``rope_theta``, Gemma's ``rope_local_base_freq``) are read too.
"""

from __future__ import annotations

import math

from spire.errors import CheckpointError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "gemma3_text")
"""HF ``model_type`` values spire implements (docs/architecture.md, "Families"): Llama 2/3.x, Mistral, Qwen2/2.5,
Qwen3 (dense), Phi-3, SmolLM3 and Gemma 3 (text)."""

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""HF ``rope_type`` values spire implements; "none" marks a layer without RoPE (SmolLM3's NoPE layers)."""

ACTIVATION_NAMES = ("silu", "swish", "gelu_pytorch_tanh")
"""HF ``hidden_act`` values spire implements (:data:`spire.model.ACTIVATIONS`)."""

_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def require_hf_keys(cfg: dict) -> None:
    """Raise CheckpointError naming the first key an HF config.json needs and lacks (checked on the file as
    written, before transformers fills in its defaults)."""
    for key in _REQUIRED_KEYS:
        if key not in cfg:
            raise CheckpointError(f"config.json lacks the key {key!r}")


def _refuse(feature: str) -> CheckpointError:
    return CheckpointError(f"unsupported checkpoint feature: {feature} (spire would compute wrong logits)")


def _rope_spec(rp: dict, max_positions: int) -> dict:
    """One RoPE variant from an HF ``rope_parameters`` (or legacy ``rope_scaling`` + ``rope_theta``) dict, with
    every parameter the inverse frequencies need resolved as transformers resolves it. Raises CheckpointError
    for a RoPE type or option spire does not implement (dynamic NTK and longrope change the frequencies with the
    sequence length; partial rotary embeddings)."""
    kind = rp.get("rope_type", rp.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise _refuse(f"RoPE scaling {kind!r} (spire implements {', '.join(ROPE_TYPES)})")
    prf = rp.get("partial_rotary_factor")
    if prf is not None and float(prf) != 1.0:
        raise _refuse(f"partial rotary embeddings (partial_rotary_factor={prf})")
    spec = {"rope_type": kind, "rope_theta": float(rp.get("rope_theta", 10000.0))}
    try:
        if kind == "linear":
            spec["factor"] = float(rp["factor"])
        elif kind == "llama3":
            for key in ("factor", "low_freq_factor", "high_freq_factor"):
                spec[key] = float(rp[key])
            spec["original_max_position_embeddings"] = int(rp["original_max_position_embeddings"])
        elif kind == "yarn":  # transformers' _compute_yarn_parameters
            orig = int(rp["original_max_position_embeddings"])
            factor = rp.get("factor")
            factor = float(max_positions / orig if factor is None else factor)
            att = rp.get("attention_factor")
            if att is None:
                def get_mscale(scale: float, m: float = 1.0) -> float:
                    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

                ms, ms_all = rp.get("mscale"), rp.get("mscale_all_dim")
                att = get_mscale(factor, ms) / get_mscale(factor, ms_all) if ms and ms_all else get_mscale(factor)
            spec.update(factor=factor, attention_factor=float(att), beta_fast=float(rp.get("beta_fast") or 32),
                        beta_slow=float(rp.get("beta_slow") or 1), original_max_position_embeddings=orig,
                        truncate=bool(rp.get("truncate", True)))
    except KeyError as e:
        raise CheckpointError(f"RoPE scaling {kind!r} lacks the parameter {e.args[0]!r}") from None
    return spec


def _layer_types(cfg: dict, family: str, n_layers: int) -> list[str]:
    """Per-layer attention kind, "full_attention" or "sliding_attention", as transformers assigns it."""
    types = cfg.get("layer_types")
    if types is None:
        if family in ("mistral", "phi3"):  # every layer slides when sliding_window is set
            types = ["sliding_attention" if cfg.get("sliding_window") else "full_attention"] * n_layers
        elif family in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            first = cfg.get("max_window_layers", n_layers)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        elif family == "gemma3_text":
            every = cfg.get("sliding_window_pattern", 6)
            types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
        else:
            types = ["full_attention"] * n_layers
    types = list(types)
    if len(types) != n_layers:
        raise CheckpointError(f"config.json has {len(types)} layer_types for {n_layers} layers")
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise _refuse(f"layer type {t!r} (spire implements full_attention and sliding_attention)")
    return types


def _family_features(cfg: dict, family: str, d_model: int) -> dict:
    """The :class:`ModelConfig` fields that differ from Llama's for ``family``; refuses what spire lacks."""
    f: dict = {}
    bias = bool(cfg.get("attention_bias"))
    if family in ("llama", "qwen3", "smollm3", "gemma3_text"):
        f.update(qkv_bias=bias, o_bias=bias)
    elif bias:
        raise _refuse(f"attention_bias for model_type {family!r}")
    if family == "qwen2":
        f["qkv_bias"] = True  # Qwen2's q/k/v projections always have biases, its o projection none
    if cfg.get("mlp_bias"):
        if family not in ("llama", "smollm3"):
            raise _refuse(f"mlp_bias for model_type {family!r}")
        f["mlp_bias"] = True
    if family in ("qwen3", "gemma3_text"):
        f["qk_norm"] = True
    act = cfg.get("hidden_activation") if family == "gemma3_text" else cfg.get("hidden_act", "silu")
    act = act or ("gelu_pytorch_tanh" if family == "gemma3_text" else "silu")
    if act not in ACTIVATION_NAMES:
        raise _refuse(f"MLP activation {act!r} (spire implements {', '.join(ACTIVATION_NAMES)})")
    f["act"] = act
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise _refuse(f"logit soft-capping ({key}={cfg[key]})")
    if cfg.get("use_bidirectional_attention"):
        raise _refuse("bidirectional attention (use_bidirectional_attention)")
    if cfg.get("quantization_config"):
        raise _refuse(f"quantized weights ({cfg['quantization_config'].get('quant_method', '?')}): "
                      "give a float checkpoint")
    if family == "gemma3_text":
        f.update(sandwich_norm=True, norm_offset=1.0, embed_scale=d_model ** 0.5,
                 attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5)
    return f


def _layer_ropes(cfg: dict, family: str, types: list[str], max_positions: int) -> list[dict]:
    """Per-layer RoPE spec (see :func:`_rope_spec`; {"rope_type": "none"} for a layer without RoPE)."""
    rp = cfg.get("rope_parameters")
    if rp is None:  # legacy keys: rope_scaling + rope_theta (+ Gemma 3's rope_local_base_freq)
        rp = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 10000.0)}
        if family == "gemma3_text":
            rp = {"full_attention": rp, "sliding_attention": {"rope_type": "default",
                                                                "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}}
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise _refuse(f"partial rotary embeddings (partial_rotary_factor={cfg['partial_rotary_factor']})")
    if set(rp) <= {"full_attention", "sliding_attention"} and rp:  # one RoPE per layer type (Gemma 3)
        specs = {t: _rope_spec(p, max_positions) for t, p in rp.items()}
        try:
            ropes = [specs[t] for t in types]
        except KeyError as e:
            raise CheckpointError(f"rope_parameters has no entry for layer type {e.args[0]!r}") from None
    else:
        spec = _rope_spec(rp, max_positions)
        ropes = [spec] * len(types)
    if family == "smollm3":  # no_rope_layers[i] == 0: layer i has no positional encoding (NoPE)
        use = cfg.get("no_rope_layers")
        if use is None:
            every = cfg.get("no_rope_layer_interval", 4)
            use = [int((i + 1) % every != 0) for i in range(len(types))]
        if len(use) != len(types):
            raise CheckpointError(f"config.json has {len(use)} no_rope_layers for {len(types)} layers")
        ropes = [r if u else {"rope_type": "none"} for r, u in zip(ropes, use)]
    return ropes


def hf_fields(cfg: dict) -> dict:
    """The :class:`spire.model.ModelConfig` keyword arguments of an HF config.json dict. Raises CheckpointError
    for a missing key, an unsupported ``model_type`` or an unsupported feature (named)."""
    family = cfg.get("model_type") or "llama"
    if family not in FAMILIES:
        raise CheckpointError(f"unsupported model_type {family!r}: spire reads {', '.join(FAMILIES)} checkpoints")
    require_hf_keys(cfg)
    n_heads = cfg["num_attention_heads"]
    d_model = cfg["hidden_size"]
    n_layers = cfg["num_hidden_layers"]
    max_positions = cfg.get("max_position_embeddings") or 2048
    types = _layer_types(cfg, family, n_layers)
    window = cfg.get("sliding_window")
    windows = [int(window) if t == "sliding_attention" and window else None for t in types]
    ropes = _layer_ropes(cfg, family, types, max_positions)
    features = _family_features(cfg, family, d_model)
    theta = next((r["rope_theta"] for r, t in zip(ropes, types) if t == "full_attention" and "rope_theta" in r),
                 next((r["rope_theta"] for r in ropes if "rope_theta" in r), 10000.0))
    default = {"rope_type": "default", "rope_theta": theta}
    eos = cfg.get("eos_token_id")
    return dict(
        vocab_size=cfg["vocab_size"], d_model=d_model, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        d_head=cfg.get("head_dim") or d_model // n_heads, d_ff=cfg["intermediate_size"],
        rope_theta=float(theta), rms_eps=float(cfg.get("rms_norm_eps", 1e-5)), max_positions=max_positions,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), bos_id=cfg.get("bos_token_id"),
        eos_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), family=family,
        layer_ropes=None if all(r == default for r in ropes) else ropes,
        layer_windows=None if all(w is None for w in windows) else windows, **features,
    )
