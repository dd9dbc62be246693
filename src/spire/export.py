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

import spire.registry as registry
from spire.errors import ConfigError
from spire.formats.draft_file import resolve_draft_path
from spire.integrations import vllm_export as vllm_form
from spire.paths import replace_dir


def _check_out(out: Path, draft_path: Path, src: Path) -> None:
    """Refuse an output folder whose contents the export would destroy: the draft itself or a folder holding
    it, or any non-empty folder that is not an earlier export (config.json with spire_format_version)."""
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


def export_draft(kind: str, draft_path: str | Path, target, name_or_path: str, out: str | Path, k: int = 4,
                 vllm: bool = True, k_table: list[list[int]] | None = None) -> Path:
    """Write the trained ``kind`` draft at ``draft_path`` (as ``--draft-path`` takes it) for ``target`` as the
    folder ``out`` (replaced atomically), in the format its kind declares (:class:`spire.registry.DraftImpl`
    ``export``), with vLLM's ``vllm_speculative_config.json`` beside it (:mod:`spire.integrations.vllm_export`;
    the folder is then the variant vLLM runs, where vLLM cannot run the draft as trained). With ``vllm=False``
    (``spire export --no-vllm``) the folder is spire's form alone, the draft exactly as trained. k_table: vLLM's
    per-batch-size k (:func:`spire.integrations.vllm_export.batch_size_table`), written into its speculative config.
    Returns ``out``.

    Raises:
        ConfigError: k < 1, a kind that is not trained or whose module declares no export, or (``vllm``) a draft
            vLLM cannot run (its kind, its target's family, its layer ids, a SPIRe draft spire's plugin cannot run);
            nothing is written then.
        CheckpointError: a missing or unreadable draft.
        TokenizerMismatchError: a draft trained for another target.
    """
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    if not registry.kind(kind).trains:
        raise ConfigError(f"spire export writes trained drafts: --draft {' or '.join(registry.names(trains=True))}, "
                          f"not {kind!r}")
    exporter = registry.impl(kind).export
    if exporter is None:
        raise ConfigError(f"--draft {kind} declares no export (its module's KIND gives no export writer): spire "
                          "export cannot write it; its run folder is what --draft-path reads")
    if vllm:
        vllm_form.check_target(kind, target)
    src = resolve_draft_path(kind, draft_path)
    out = Path(out)
    _check_out(out, Path(draft_path), src)
    write = exporter(src, target, name_or_path, k)
    write = vllm_form.writer(kind, write, target, k, out, k_table) if vllm else write

    def readable(tmp: Path) -> None:  # an engine may run as another user: files 0644, folders 0755
        write(tmp)
        _check_replaced(out, Path(tmp))
        for p in Path(tmp).rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
    replace_dir(out, readable)
    return out


def _check_replaced(out: Path, new: Path) -> None:
    """Refuse to replace an earlier export ``out`` by the folder ``new`` when ``out`` holds a file no export writes
    there: one this export does not write, outside vLLM's form (its subfolder and speculative config, which an
    export with --no-vllm leaves out). A user's file put in an export folder is then never deleted. Raises
    ConfigError naming the file (nothing is changed: the new folder is still temporary)."""
    if not out.is_dir():
        return
    for f in sorted(out.rglob("*")):
        rel = f.relative_to(out)
        if f.is_dir() or (new / rel).exists() or rel.parts[0] in (vllm_form.VLLM_SUBFOLDER, vllm_form.SPEC_FILE):
            continue
        raise ConfigError(f"--out {out} holds {rel}, which this export does not write; it would be deleted: move it "
                          "or choose another folder")
