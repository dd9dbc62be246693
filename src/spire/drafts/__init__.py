"""Drafts behind one protocol (:class:`spire.drafts.base.Draft`): MagicDec, SPIRe, vanilla."""

from __future__ import annotations

from pathlib import Path

from spire.drafts.base import Draft
from spire.errors import CheckpointError, ConfigError

DRAFT_KINDS = ("none", "vanilla", "magicdec", "spire")


def find_trained_spire(target) -> Path | None:
    """The most recently written finished SPIRe draft in the cache that fits ``target``, or None."""
    import json

    from spire.paths import spire_cache_dir
    from spire.drafts.spire import _fingerprint

    want = _fingerprint(target)
    found = []
    for f in (spire_cache_dir() / "drafts").glob("*/draft.safetensors"):
        state = f.parent / "train_state.json"
        try:
            from safetensors import safe_open

            with safe_open(str(f), "pt") as h:
                meta = json.loads(h.metadata()["spire"])
            finished = json.loads(state.read_text()).get("finished", False) if state.is_file() else True
        except Exception:
            continue
        if meta.get("target") == want and finished:
            found.append(f)
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def make_draft(kind: str, target, tokenizer=None, path: str | None = None, sink: int = 1, window: int = 64,
               dtype=None) -> Draft | None:
    """Build a draft by name for ``target``.

    kind: "none" (AD, returns None), "magicdec" (sink/window), "spire" (path: a trained draft .safetensors;
    default the newest finished one in the cache), "vanilla" (path: a .gguf or HF folder sharing the
    target's tokenizer). Raises ConfigError / CheckpointError / TokenizerMismatchError.
    """
    if kind not in DRAFT_KINDS:
        raise ConfigError(f"unknown draft {kind!r}; choose one of {', '.join(DRAFT_KINDS)}")
    if kind == "none":
        return None
    if kind == "magicdec":
        from spire.drafts.magicdec import MagicDecDraft

        return MagicDecDraft(sink, window)
    if kind == "spire":
        from spire.drafts.spire import SpireDraft, SpireDraftModel

        file = Path(path) if path else find_trained_spire(target)
        if file is None:
            raise CheckpointError("no trained SPIRe draft for this target in the cache: run `spire reproduce` "
                                  "(or pass --draft-path)")
        return SpireDraft(SpireDraftModel.load(file, target))
    from spire.drafts.vanilla import VanillaDraft, check_same_vocabulary
    from spire.loading import load_target

    if not path:
        raise ConfigError("--draft vanilla needs --draft-path (a .gguf file or HF folder of a small model "
                          "with the target's tokenizer)")
    model, draft_tok, _ = load_target(path, dtype=dtype or target.dtype, device=str(target.device))
    if tokenizer is not None:
        check_same_vocabulary(tokenizer, draft_tok, "target", f"draft {path}")
    return VanillaDraft(model)
