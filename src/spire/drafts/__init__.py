"""Drafts behind one protocol (:class:`spire.drafts.base.Draft`): MagicDec, SPIRe, vanilla."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from spire import defaults
from spire.drafts.base import Draft
from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.spire import SpireDraft, SpireDraftModel, _fingerprint_matches, read_draft_file
from spire.drafts.vanilla import VanillaDraft, check_same_vocabulary
from spire.errors import CheckpointError, ConfigError
from spire.export import check_export, load_exported_spire, read_export
from spire.loading import load_target
from spire.paths import existing_dir, spire_cache_dir

DRAFT_KINDS = ("none", "vanilla", "magicdec", "spire")


def _run_state(run_dir: Path) -> dict | None:
    """The training state of the run in run_dir (new layout: checkpoint/train_state.json; older runs:
    train_state.json beside the draft), or None for a draft saved by hand."""
    ckpt = existing_dir(run_dir / "checkpoint")
    for state in ([ckpt / "train_state.json"] if ckpt else []) + [run_dir / "train_state.json"]:
        if state.is_file():
            return json.loads(state.read_text())
    return None


def _finished(run_dir: Path) -> bool:
    """Whether the training run in run_dir finished (a draft without any state was saved by hand and counts as
    finished)."""
    state = _run_state(run_dir)
    return state is None or bool(state.get("finished", False))


def _warn_if_unfinished(run_dir: Path) -> None:
    """One ``warning:`` line on stderr when run_dir is a training run that has not finished: its draft is an
    intermediate checkpoint (an interrupted or still running `spire train`)."""
    state = _run_state(run_dir)
    if state is not None and not state.get("finished", False):
        print(f"warning: {run_dir} is an unfinished training run (stopped at step {state.get('step', '?')}): its "
              f"draft is an intermediate checkpoint; `spire train --resume --out {run_dir}` finishes it",
              file=sys.stderr)


def find_trained_spire(target) -> Path | None:
    """The most recently written finished full-method (not ablated) SPIRe draft in the cache that fits
    ``target``, or None."""
    found = []
    for f in (spire_cache_dir() / "drafts").glob("*/draft.safetensors"):
        try:
            meta, _ = read_draft_file(f)
            finished = _finished(f.parent)
        except Exception:  # an unreadable or foreign file is not a candidate
            continue
        if (_fingerprint_matches(meta.get("target", {}), target) and finished
                and meta.get("ablation", "none") == "none"):
            found.append(f)
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_draft_path(kind: str, path: str | Path) -> Path:
    """A draft path as given, or the draft inside a `spire train` run folder (``draft.safetensors`` for
    SPIRe, ``draft/`` for vanilla). Raises CheckpointError when nothing is there."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"draft not found: {p}")
    if p.is_dir():
        if kind == "spire" and read_export(p) is not None:  # a `spire export` folder
            return p
        inner = p / ("draft.safetensors" if kind == "spire" else "draft")
        if inner.exists():
            return inner
        if kind == "spire" and not (p / "config.json").is_file() and (p / "draft").is_dir():
            raise CheckpointError(f"{p} is a vanilla draft run (it has draft/, no draft.safetensors): give it as "
                                  "the vanilla draft (--draft vanilla, --vanilla-draft)")
        if kind == "spire":
            hf = (p / "config.json").is_file()
            raise CheckpointError(f"{p} holds no SPIRe draft (draft.safetensors)"
                                  + (": it is an HF model folder; give it as the vanilla draft" if hf else ""))
        if kind == "vanilla" and not (p / "config.json").is_file() and (p / "draft.safetensors").is_file():
            raise CheckpointError(f"{p} is a SPIRe draft run (it has draft.safetensors, no draft/): give it as "
                                  "the SPIRe draft (--draft spire, --spire-draft)")
    elif kind == "vanilla" and p.suffix == ".safetensors":
        raise CheckpointError(f"{p} is a single .safetensors file (a SPIRe draft?): --draft vanilla takes an HF "
                              "folder, a .gguf file or a `spire train --draft vanilla` run folder")
    return p


def make_draft(kind: str, target, tokenizer=None, path: str | None = None, sink: int = defaults.SINK,
               window: int = defaults.WINDOW, dtype=None) -> Draft | None:
    """Build a draft by name for ``target``.

    kind: "none" (AD, returns None), "magicdec" (sink/window), "spire" (path: a trained draft .safetensors,
    a `spire train` run folder or a `spire export` folder; default the newest finished one in the cache), "vanilla" (path: a .gguf,
    an HF folder sharing the target's tokenizer, or a `spire train --draft vanilla` run folder). Raises ConfigError / CheckpointError / TokenizerMismatchError.
    """
    if kind not in DRAFT_KINDS:
        raise ConfigError(f"unknown draft {kind!r}; choose one of {', '.join(DRAFT_KINDS)}")
    if path and kind in ("none", "magicdec"):
        raise ConfigError(f"a draft path is for the spire and vanilla drafts; --draft {kind} takes none")
    if kind == "none":
        return None
    if kind == "magicdec":
        return MagicDecDraft(sink, window)
    if kind == "spire":
        file = resolve_draft_path(kind, path) if path else find_trained_spire(target)
        if file is None:
            raise CheckpointError("no trained SPIRe draft for this target in the cache: run `spire reproduce` "
                                  "(or pass --draft-path)")
        if file.is_dir():
            return SpireDraft(load_exported_spire(file, target))
        if path:
            _warn_if_unfinished(file.parent)
        return SpireDraft(SpireDraftModel.load(file, target))

    if not path:
        raise ConfigError("--draft vanilla needs --draft-path (a .gguf file or HF folder of a small model "
                          "with the target's tokenizer)")
    path = resolve_draft_path(kind, path)
    if path.is_dir():
        if read_export(path) is not None:  # a `spire export` folder: refuse one exported for another target
            algorithm = check_export(path, target)["speculators_config"].get("algorithm")
            if algorithm == "spire":
                raise CheckpointError(f"{path} is an exported SPIRe draft: give it as the SPIRe draft (--draft spire, "
                                      "--spire-draft)")
        elif path.name == "draft":  # a `spire train --draft vanilla` run's draft/
            _warn_if_unfinished(path.parent)
    model, draft_tok, _ = load_target(path, dtype=dtype or target.dtype, device=str(target.device))
    if tokenizer is not None:
        check_same_vocabulary(tokenizer, draft_tok, "target", f"draft {path}")
    return VanillaDraft(model)
