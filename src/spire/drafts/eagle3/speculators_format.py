"""The speculators Eagle3 folder format, one job: config.json and model.safetensors written from a draft
(:func:`speculators_state`, :func:`speculators_writer`, :func:`export_speculators`) and a folder's config.json read
back and checked against a target (:func:`_speculators_config`, the speculators versions of :data:`SPECULATORS_READS`,
:class:`DraftTargetMismatchError`); the format is described in :mod:`spire.drafts.eagle3`. The weights are read
into a model by :func:`spire.drafts.eagle3.load.load_speculators` (model.py imports this module for ``export``, so
the model class is not imported here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from spire import __version__, defaults
from spire.drafts.eagle3.config import LAYER_TYPES, Eagle3Config
from spire.formats.draft_file import EXPORT_KINDS, FORMAT_VERSION, other_kind_error
from spire.formats.draft_file import fingerprint as _fingerprint
from spire.formats.draft_file import fingerprint_matches as _fingerprint_matches
from spire.formats.speculators import verifier_config
from spire.errors import CheckpointError, ConfigError, TokenizerMismatchError
from spire.model import ModelConfig, Transformer
from spire.paths import replace_dir

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose Eagle3 format :func:`export_speculators` writes (and tests/test_eagle3.py checks
against)."""

SPECULATORS_READS = ((0, 1), (0, 9))
"""speculators_version range (major, minor), both ends included, whose Eagle3 folders :func:`load_speculators`
reads; another version is refused (its format has not been checked)."""


class DraftTargetMismatchError(TokenizerMismatchError, CheckpointError):
    """An EAGLE-3 draft made for another target (hidden size, vocabulary, embedding or fingerprint): both a
    :class:`TokenizerMismatchError` (as spire reports a draft of another target) and a :class:`CheckpointError`."""



def _layer_hf_config(layer_cfg: ModelConfig) -> dict:
    """``transformer_layer_config`` of the draft layer: an HF LlamaConfig (Qwen3Config with q/k norms) as
    speculators serializes it (``to_diff_dict``)."""
    import transformers as tf

    c = layer_cfg
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=1,
              num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.d_head,
              rms_norm_eps=c.rms_eps, max_position_embeddings=c.max_positions, tie_word_embeddings=False,
              bos_token_id=c.bos_id, eos_token_id=(c.eos_ids[0] if len(c.eos_ids) == 1 else (c.eos_ids or None)),
              rope_parameters=dict(c.rope_of(0)), hidden_act="silu")
    if c.family == "qwen3":
        if c.qkv_bias or c.mlp_bias:
            raise ConfigError("a Qwen3 draft layer with biases has no speculators equivalent")
        return tf.Qwen3Config(**kw, attention_bias=False).to_diff_dict()
    return tf.LlamaConfig(**kw, attention_bias=bool(c.qkv_bias), mlp_bias=bool(c.mlp_bias)).to_diff_dict()


def speculators_state(model: Eagle3DraftModel, target: Transformer | None = None, embed_tokens: bool = True
                      ) -> dict[str, torch.Tensor]:
    """The draft's tensors under speculators' names (float32, contiguous): its state without ``vocab``, plus
    ``d2t`` / ``t2d`` for a draft vocabulary and, when ``embed_tokens``, ``embed_tokens.weight``: the target's
    embedding rows as the draft reads them (times the target's embedding scale, Gemma's sqrt(d), so that a reader's
    plain nn.Embedding gives the same vectors)."""
    target = model.target if target is None else target
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items() if k != "vocab"}
    maps = model.d2t_t2d()
    if maps is not None:
        sd["d2t"], sd["t2d"] = maps
    if embed_tokens:
        sd["embed_tokens.weight"] = _embedding_rows(target).contiguous()
    return sd


def _embedding_rows(target: Transformer) -> torch.Tensor:
    """(V, d) float32: the target's embedding of every token, scale included."""
    emb = target.model.embed_tokens
    with torch.no_grad():
        return emb(torch.arange(emb.num_embeddings, device=emb.weight.device)).detach().float().cpu()


def speculators_writer(model: Eagle3DraftModel, target: Transformer | None = None, *, k: int = defaults.K,
                       verifier_name_or_path: str | None = None, meta: dict | None = None, embed_tokens: bool = True,
                       allow_extensions: bool = False):
    """The writer ``write(folder)`` of :func:`export_speculators` (config.json and model.safetensors into an empty
    folder), the form :func:`spire.export.export_draft` takes from a kind. Arguments and errors as
    :func:`export_speculators` (but for ``out_dir``)."""
    target = model.target if target is None else target
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    if model.view is not None and not allow_extensions:
        raise ConfigError("this EAGLE-3 draft reads a sink + window view of its cache (beyond EAGLE-3): "
                          "speculators has no such draft (allow_extensions=True writes it anyway)")
    if target.cfg.embed_scale != 1.0 and not embed_tokens:
        raise ConfigError(f"the target scales its embedding (x {target.cfg.embed_scale:g}, {target.cfg.family}) and "
                          "speculators' Eagle3 embedding has no scale: export the scaled rows (embed_tokens=True)")
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        tf_version = None
    c, lc = model.cfg, model.layer_cfg
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier_config(target, verifier_name_or_path)},
        "transformer_layer_config": _layer_hf_config(lc),
        "draft_vocab_size": model.n_vocab,
        "target_hidden_size": target.cfg.d_model,
        "eagle_aux_hidden_state_layer_ids": list(model.layer_ids),
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "transformers_version": tf_version,
        "spire_format_version": FORMAT_VERSION,
        "spire": {"spire_version": __version__, "k": k, "eagle3_config": c.to_dict(), "layer_config": lc.to_dict(),
                  "training": meta or {}},
    }
    tensors = speculators_state(model, target, embed_tokens)

    def write(tmp: Path) -> None:
        save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    return write


def export_speculators(model: Eagle3DraftModel, out_dir: str | Path, target: Transformer | None = None, *,
                       k: int = defaults.K, verifier_name_or_path: str | None = None, meta: dict | None = None,
                       embed_tokens: bool = True, allow_extensions: bool = False) -> Path:
    """Write ``model`` as a speculators Eagle3 folder (:mod:`spire.drafts.eagle3`) at ``out_dir``, replaced atomically
    (:func:`spire.paths.replace_dir`): config.json and model.safetensors (float32), loadable by speculators'
    ``Eagle3DraftModel.from_pretrained``, vLLM and :func:`load_speculators`. config.json also holds
    ``spire_format_version`` (so spire's tools see a spire export), the verifier's spire fingerprint
    (``speculators_config.verifier.spire_fingerprint``) and a ``spire`` section (the Eagle3Config, the layer's
    ModelConfig, k, ``meta``).

    Args:
        model: the draft; target: its target (default ``model.target``).
        k: speculative_tokens of the greedy proposal method (speculators knows no other proposal type).
        verifier_name_or_path: the verifier's HF id or folder (speculators loads it when set), else null.
        embed_tokens: also store the target's embedding rows, scale included (speculators' own saves do; optional
            for readers that load the verifier's, required for a target that scales its embedding).
        allow_extensions: write a draft with spire's sink + window view too (speculators and vLLM would run it with
            a full cache; spire reads the view back); otherwise such a draft is refused.
    Returns: ``out_dir``.
    Raises:
        ConfigError: k < 1; a draft beyond the format (a view without allow_extensions; a target whose embedding
            is scaled, Gemma, without embed_tokens); ``out_dir`` is a file or a non-empty folder that is not a
            speculators folder.
    """
    out = Path(out_dir)
    if out.is_file():
        raise ConfigError(f"{out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()):
        try:
            ours = "speculators_model_type" in json.loads((out / "config.json").read_text())
        except (OSError, ValueError):
            ours = False
        if not ours:
            raise ConfigError(f"{out} is a non-empty folder that is not a speculators folder; it would be replaced: "
                              "choose an empty or new folder")
    write = speculators_writer(model, target, k=k, verifier_name_or_path=verifier_name_or_path, meta=meta,
                               embed_tokens=embed_tokens, allow_extensions=allow_extensions)
    replace_dir(out, write)
    return out


_KNOWN_KEYS = {"architectures", "auto_map", "speculators_model_type", "speculators_version", "speculators_config",
               "transformer_layer_config", "draft_vocab_size", "target_hidden_size",
               "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
               "embed_requires_grad", "tie_word_embeddings", "dtype", "torch_dtype", "transformers_version",
               "spire_format_version", "spire", "model_type", "has_no_defaults_at_init"}
"""Top-level config.json keys of a speculators Eagle3 folder that :func:`load_speculators` reads or may ignore
(with PretrainedConfig's own keys); any other key that is set (not false, null, 0 or empty) is refused."""


_BASE_KEYS: set[str] | None = None


def _base_config_keys() -> set[str]:
    """The keys of transformers' PretrainedConfig.to_dict() (speculators' config is one)."""
    global _BASE_KEYS
    if _BASE_KEYS is None:
        from transformers import PretrainedConfig

        _BASE_KEYS = set(PretrainedConfig().to_dict())
    return _BASE_KEYS


def _check_version(folder: Path, version) -> None:
    m = re.match(r"^(\d+)\.(\d+)", str(version or ""))
    if m is None:
        raise CheckpointError(f"{folder}: config.json has no speculators_version (not written by speculators?)")
    have = (int(m.group(1)), int(m.group(2)))
    lo, hi = SPECULATORS_READS
    if not lo <= have <= hi:
        raise CheckpointError(f"{folder} was written by speculators {version}; spire reads Eagle3 folders of "
                              f"speculators {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}.x")


def _layer_config(folder: Path, tl: dict) -> ModelConfig:
    """The ModelConfig of a ``transformer_layer_config``, normalized by transformers' AutoConfig as spire reads
    a target's config.json. Raises CheckpointError for what spire's EAGLE-3 layer does not implement."""
    from transformers import AutoConfig

    if not isinstance(tl, dict):
        raise CheckpointError(f"{folder}: transformer_layer_config must be an object")
    family = tl.get("model_type") or "llama"
    if family not in LAYER_TYPES:
        raise CheckpointError(f"{folder}: a {family!r} draft layer is not implemented (spire reads "
                              f"{', '.join(LAYER_TYPES)}, as speculators' Eagle3)")
    if tl.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{folder}: {tl.get('num_hidden_layers')} draft decoder layers (num_hidden_layers); "
                              "spire's EAGLE-3 draft has one")
    try:
        raw = {**AutoConfig.for_model(family, **{k: v for k, v in tl.items() if k != "model_type"}).to_dict(),
               "model_type": family}
        cfg = ModelConfig.from_hf(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: its draft layer: {e}") from None
    except Exception as e:  # transformers validates the values
        raise CheckpointError(f"{folder}: transformers cannot read its transformer_layer_config: "
                              f"{type(e).__name__}: {e}".splitlines()[0]) from None
    if cfg.layer_windows is not None:
        raise CheckpointError(f"{folder}: a sliding-window draft layer (sliding_window {tl.get('sliding_window')}) "
                              "is not implemented")
    return cfg


def _same_embedding(stored: torch.Tensor, target: Transformer) -> bool:
    """Whether an embedding stored with a draft is the target's (rows times its scale), to bf16 rounding of either
    side."""
    w = _embedding_rows(target)
    s = stored.detach().float().cpu()
    if s.shape != w.shape:
        return False
    return bool(((s - w).abs() <= 2.0 ** -7 * w.abs().maximum(s.abs()) + 1e-6).all())


def _speculators_config(folder: Path, target: Transformer) -> tuple[Eagle3Config, ModelConfig]:
    """(draft settings, decoder layer config) of the speculators Eagle3 folder ``folder`` for ``target``, every
    config check of :func:`load_speculators` done (same errors)."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} holds no config.json (not a speculators folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{folder} is not a speculators folder (its config.json is not an object)")
    if "speculators_model_type" not in config:  # an HF model: what --draft vanilla reads
        raise other_kind_error(folder, "eagle3", "vanilla", "an HF model folder")
    kind = config["speculators_model_type"]
    algorithm = (config.get("speculators_config") or {}).get("algorithm", kind)
    if kind == algorithm and EXPORT_KINDS.get(kind, "eagle3") != "eagle3":  # another kind's `spire export`
        raise other_kind_error(folder, "eagle3", EXPORT_KINDS[kind], exported=True)
    if kind != "eagle3" or algorithm != "eagle3":
        raise CheckpointError(f"{folder} holds a draft of algorithm {algorithm!r} (speculators_model_type "
                              f"{kind!r}), not an EAGLE-3 one")
    _check_version(folder, config.get("speculators_version"))
    base_keys = _base_config_keys()
    unknown = sorted(key for key, v in config.items()
                     if key not in _KNOWN_KEYS and key not in base_keys and not key.startswith("_")
                     and v not in (None, False, 0, "", [], {}))
    if unknown:
        raise CheckpointError(f"{folder}: config.json sets {', '.join(unknown)}, which spire's EAGLE-3 draft does not "
                              "implement")
    if config.get("embed_requires_grad"):
        raise CheckpointError(f"{folder}: embed_requires_grad (a trained draft embedding) is not implemented: spire's "
                              "EAGLE-3 draft reads the target's embedding")
    tc = target.cfg
    lc = _layer_config(folder, config.get("transformer_layer_config"))
    th = config.get("target_hidden_size")
    if lc.d_model != tc.d_model or th not in (None, tc.d_model):
        raise DraftTargetMismatchError(f"{folder} is a draft for a target of hidden size "
                                       f"{th if th not in (None, lc.d_model) else lc.d_model}; the target has "
                                       f"{tc.d_model}")
    if lc.vocab_size != tc.vocab_size:
        raise DraftTargetMismatchError(f"{folder} is a draft for a target vocabulary of {lc.vocab_size} tokens; the "
                                       f"target has {tc.vocab_size}")
    fp = ((config.get("speculators_config") or {}).get("verifier") or {}).get("spire_fingerprint")
    if isinstance(fp, dict) and not _fingerprint_matches(fp, target):
        raise DraftTargetMismatchError(f"{folder} was exported for target {fp}, but the target is "
                                       f"{_fingerprint(target)}")
    spire_section = config.get("spire") if isinstance(config.get("spire"), dict) else {}
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    try:
        base = Eagle3Config.from_dict(spire_section["eagle3_config"]) if "eagle3_config" in spire_section else None
        flags = {f: bool(config.get(f, False)) for f in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                           "norm_output")}
        e3 = Eagle3Config(**{**(base.to_dict() if base is not None else {}), **flags,
                             "layers": None if ids is None else tuple(int(j) for j in ids),
                             "draft_vocab": int(config.get("draft_vocab_size", tc.vocab_size))})
        e3.validate(tc.n_layers, tc.vocab_size)
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    return e3, lc
