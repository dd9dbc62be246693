"""``spire export``: a trained draft as a folder a serving engine can read (issue 15, part 5).

The folder follows vllm-project/speculators' model format (its docs/architecture/model_formats.md): an HF-style
``config.json`` whose ``speculators_config`` names the algorithm, the proposal methods and the verifier, and
the weights in ``model.safetensors``::

    out/
    ├── config.json         spire_format_version, inputs, speculators_model_type, speculators_config, spire
    └── model.safetensors   the draft's tensors (for SPIRe with spire's JSON metadata, so spire reads it back)

For a SPIRe draft ``config.json`` holds:

- ``architectures`` ["SpireDraftModel"], ``model_type`` "spire_draft", ``torch_dtype``, the draft body's shape in
  HF keys (``hidden_size``, ``num_hidden_layers`` = draft layers, heads, ``head_dim``, ``intermediate_size``,
  ``vocab_size``, ``rms_norm_eps``);
- ``spire_format_version`` (:data:`FORMAT_VERSION`; a reader refuses a version it does not know);
- ``inputs``: ``input_ids`` and, per draft layer, ``hidden_states.layer.<j>``: the verifier's residual stream
  entering its layer j (the SPIRe paper's "target activations", read for every verified position);
- ``speculators_model_type`` "spire" and ``speculators_config``: ``algorithm`` "spire", ``proposal_methods``
  (greedy and sample, each with ``speculative_tokens`` = k), ``default_proposal_method``, ``verifier``
  (``name_or_path``, ``architectures``, ``model_type`` and shape keys, and spire's fingerprint of its
  embedding, which a reader compares with the verifier it is given);
- ``spire``: ``source_layers`` (target layer of each draft layer), ``sink``, ``window``, ``k``, the draft's
  ablation switches, and ``draft_vocab`` (the name and size of a draft-to-target vocabulary map tensor when the
  draft has one, else null).

A vanilla draft (an independent small model) is exported as its HF folder with ``speculators_config``
(``algorithm`` "independent") added to its config.json, which transformers and spire load as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

from spire.drafts.draft_file import FORMAT_VERSION, check_export, fingerprint, read_export  # noqa: F401 (re-exported)
from spire.errors import CheckpointError, TokenizerMismatchError
from spire.integrations import vllm_export as vllm_form

SPIRE_MODEL_TYPE = "spire_draft"


def _verifier(target, name_or_path: str) -> dict:
    c = target.cfg
    return {"name_or_path": name_or_path, "architectures": [_ARCH.get(c.family, "LlamaForCausalLM")],
            "model_type": c.family, "hidden_size": c.d_model, "intermediate_size": c.d_ff,
            "num_hidden_layers": c.n_layers, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_positions,
            "bos_token_id": c.bos_id, "eos_token_id": c.eos_ids, "spire_fingerprint": fingerprint(target)}


_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
         "gemma3_text": "Gemma3ForCausalLM"}


def _speculators(algorithm: str, k: int, verifier: dict) -> dict:
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k},
                                 {"proposal_type": "sample", "speculative_tokens": k}],
            "default_proposal_method": "greedy", "verifier": verifier}


def spire_export_config(meta: dict, state: dict, target, name_or_path: str, k: int) -> dict:
    """The config.json of an exported SPIRe draft (module docstring) from the draft file's spire metadata and
    tensors. Raises CheckpointError for a draft file without a SPIRe configuration."""
    from spire import __version__

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
        "speculators_config": _speculators("spire", k, _verifier(target, name_or_path)),
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


def _check_out(out: Path, draft_path: Path, src: Path) -> None:
    """Refuse an output folder whose contents the export would destroy: the draft itself or a folder holding
    it, or any non-empty folder that is not an earlier export (config.json with spire_format_version)."""
    from spire.errors import ConfigError

    o = out.resolve()
    for p in {draft_path.resolve(), src.resolve()}:
        if o == p or o in p.parents:
            raise ConfigError(f"--out {out} holds the draft being exported ({p}); choose another folder")
    if o.is_file():
        raise ConfigError(f"--out {out} is a file; give a folder")
    if o.is_dir() and any(o.iterdir()):
        try:
            earlier = "spire_format_version" in json.loads((o / "config.json").read_text())
        except (OSError, ValueError):
            earlier = False
        if not earlier:
            raise ConfigError(f"--out {out} is a non-empty folder that is not an earlier spire export; it would be "
                              "replaced: choose an empty or new folder")


def independent_config(config: dict, target, name_or_path: str, k: int) -> dict:
    """An independent (vanilla) draft's HF config.json with spire's format version and ``speculators_config``
    (algorithm "independent") added."""
    return {**config, "spire_format_version": FORMAT_VERSION, "speculators_model_type": "independent",
            "speculators_config": _speculators("independent", k, _verifier(target, name_or_path))}


def export_draft(kind: str, draft_path: str | Path, target, name_or_path: str, out: str | Path, k: int = 4) -> Path:
    """Write the trained ``kind`` draft at ``draft_path`` (as ``--draft-path`` takes it) for ``target`` as the
    folder ``out`` (replaced atomically), in the format its kind declares (:class:`spire.drafts.registry.DraftImpl`
    ``export``), with vLLM's ``vllm_speculative_config.json`` beside it (:mod:`spire.integrations.vllm_export`).
    Returns ``out``.

    Raises:
        ConfigError: k < 1, a kind with nothing to export, or a draft vLLM cannot run (its kind, its target's
            family, its layer ids); nothing is written then.
        CheckpointError: a missing or unreadable draft.
        TokenizerMismatchError: a draft trained for another target.
    """
    import spire.drafts.registry as registry
    from spire.drafts.draft_file import resolve_draft_path
    from spire.errors import ConfigError
    from spire.paths import replace_dir

    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    exporter = registry.impl(kind).export if registry.kind(kind).trains else None
    if exporter is None:
        raise ConfigError(f"spire export writes trained drafts: --draft {' or '.join(registry.names(trains=True))}, "
                          f"not {kind!r}")
    vllm_form.check_target(kind, target)
    src = resolve_draft_path(kind, draft_path)
    out = Path(out)
    _check_out(out, Path(draft_path), src)
    replace_dir(out, vllm_form.writer(kind, exporter(src, target, name_or_path, k), target, k, out))
    return out
