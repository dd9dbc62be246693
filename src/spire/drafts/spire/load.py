"""Finding and loading a SPIRe draft, one job: the newest finished draft in the cache for a target
(:func:`find_trained_spire`), an exported folder's model (:func:`load_exported_spire`), and the registry entry's
functions: the inference draft of what ``--draft-path`` names (:func:`load_draft`) and ``spire export``'s writer
(``_export``)."""

from __future__ import annotations

import json
from pathlib import Path

from spire.drafts.spire.draft import SpireDraft
from spire.drafts.spire.model import SpireDraftModel
from spire.formats.draft_file import (EXPORT_KINDS, check_export, fingerprint_matches, other_kind_error,
                                     read_draft_file, resolve_draft_path, run_finished, warn_if_unfinished,
                                     write_draft_file)
from spire.formats.speculators import spire_export_config
from spire.errors import CheckpointError
from spire.model import Transformer
from spire.paths import spire_cache_dir


def find_trained_spire(target: Transformer) -> Path | None:
    """The most recently written finished full-method (not ablated) SPIRe draft in the cache that fits
    ``target``, or None."""
    found = []
    for f in (spire_cache_dir() / "drafts").glob("*/draft.safetensors"):
        try:
            meta, _ = read_draft_file(f)
            finished = run_finished(f.parent)
        except Exception:  # an unreadable or foreign file is not a candidate
            continue
        if (fingerprint_matches(meta.get("target", {}), target) and finished
                and meta.get("ablation", "none") == "none"):
            found.append(f)
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def load_exported_spire(folder: str | Path, target: Transformer) -> SpireDraftModel:
    """The :class:`SpireDraftModel` of an exported SPIRe folder (:mod:`spire.export`), checked against ``target``.
    Raises CheckpointError or TokenizerMismatchError."""
    config = check_export(folder, target)
    algorithm = config["speculators_config"].get("algorithm")
    if algorithm != "spire":
        raise other_kind_error(folder, "spire", EXPORT_KINDS.get(algorithm, "vanilla"), exported=True)
    return SpireDraftModel.load(Path(folder) / "model.safetensors", target)


def load_draft(target: Transformer, path: str | Path | None = None, **_) -> SpireDraft:
    """The SPIRe draft at ``path`` (a draft .safetensors, a `spire train` run folder or a `spire export` folder),
    default the newest finished one in the cache for ``target``. Raises CheckpointError (none trained, missing,
    unreadable) or TokenizerMismatchError (trained for another target)."""
    file = resolve_draft_path("spire", path) if path else find_trained_spire(target)
    if file is None:
        raise CheckpointError("no trained SPIRe draft for this target in the cache: pass --draft-path (e.g. the run "
                              "folder of `spire train`), or run the main job (`spire reproduce`), which leaves one "
                              "in the cache")
    if file.is_dir():
        draft = SpireDraft(load_exported_spire(file, target).requires_grad_(False))
    else:
        if path:
            warn_if_unfinished(file.parent)
        draft = SpireDraft(SpireDraftModel.load(file, target).requires_grad_(False))  # frozen: decodes with kept copies
    draft.source = str(file)  # the default (the newest trained in the cache) included
    return draft


def _export(src: Path, target: Transformer, name_or_path: str, k: int):
    """(config.json, writer) of an exported SPIRe folder (:func:`spire.export.export_draft`)."""
    if src.is_dir():  # an exported folder, exported again
        check_export(src, target)
        src = src / "model.safetensors"
    meta, state = read_draft_file(src, target)
    config = spire_export_config(meta, state, target, name_or_path, k)

    def write(tmp: Path) -> None:
        write_draft_file(tmp / "model.safetensors", state, meta)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return write
