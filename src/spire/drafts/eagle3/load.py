"""Finding and loading an EAGLE-3 draft, one job: a speculators folder's weights into an
:class:`~spire.drafts.eagle3.model.Eagle3DraftModel` (:func:`load_speculators`), what ``--draft-path`` names
(:func:`resolve_path`: a speculators folder, a run folder or a checkpoint file), the model there (:func:`load_eagle3`),
and the registry entry's functions: the inference draft (:func:`load_draft`) and ``spire export``'s writer."""

from __future__ import annotations

from pathlib import Path

import torch

from spire.drafts.eagle3.draft import Eagle3Draft
from spire.drafts.eagle3.model import Eagle3DraftModel
from spire.drafts.eagle3.speculators_format import (DraftTargetMismatchError, _same_embedding,
                                                    _speculators_config, speculators_writer)
from spire.formats.draft_file import warn_if_unfinished
from spire.errors import CheckpointError, ConfigError
from spire.loading import check_finite, load_state_dict
from spire.model import Transformer


def load_speculators(folder: str | Path, target: Transformer) -> Eagle3DraftModel:
    """The :class:`Eagle3DraftModel` of a speculators Eagle3 folder (written by speculators or by
    :func:`export_speculators`) for ``target``, in the target's dtype.

    Raises:
        CheckpointError: no or unreadable config.json / weights; another algorithm (speculators_model_type or
            speculators_config.algorithm not "eagle3"); a speculators_version outside :data:`SPECULATORS_READS`;
            a flag or layer spire does not implement (embed_requires_grad, several or sliding-window layers, a
            set key it does not know); inconsistent vocabulary maps; tensors that do not fit; NaN weights.
        DraftTargetMismatchError (a CheckpointError and a TokenizerMismatchError): a draft for another target
            (hidden size, vocabulary size, spire fingerprint, stored embedding).
    """
    folder = Path(folder)
    e3, lc = _speculators_config(folder, target)
    tc = target.cfg
    state = load_state_dict(folder)
    check_finite({k: v for k, v in state.items() if not k.startswith("verifier_")}, f"draft {folder}")
    emb = state.pop("embed_tokens.weight", None)
    if emb is None and tc.embed_scale != 1.0:
        raise CheckpointError(f"{folder} stores no embedding and the target scales its own ({tc.family}): which "
                              "rows the draft was trained on is unknown")
    if emb is not None and not _same_embedding(emb, target):
        raise DraftTargetMismatchError(f"{folder} stores an embedding that is not the target's: a draft for another "
                                       "target (or a trained embedding, which spire does not implement)")
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    for key in [key for key in state if key.startswith("verifier_")]:  # speculators' teacher copies (not saved)
        del state[key]
    N = e3.vocab_columns(tc.vocab_size)
    vocab = None
    if N is not None:
        if d2t is None or t2d is None:
            raise CheckpointError(f"{folder}: a draft vocabulary of {N} tokens needs the d2t and t2d tensors")
        if d2t.dim() != 1 or len(d2t) != N or t2d.dim() != 1 or len(t2d) != tc.vocab_size:
            raise CheckpointError(f"{folder}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit "
                                  f"{N} draft and {tc.vocab_size} target tokens")
        vocab = torch.arange(N) + d2t.to(torch.int64)
        if (len(vocab.unique()) != N or bool((vocab < 0).any() | (vocab >= tc.vocab_size).any())
                or not torch.equal(t2d.to(torch.bool).nonzero().flatten(), vocab.sort().values)):
            raise CheckpointError(f"{folder}: d2t and t2d do not describe the same {N} distinct target tokens")
    try:
        model = Eagle3DraftModel(target, e3, vocab, lc)
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    if vocab is not None:
        state["vocab"] = vocab
    try:
        model.load_state_dict({k: v.to(model.fc.weight.dtype) if v.is_floating_point() else v
                               for k, v in state.items()})
    except RuntimeError as e:
        raise CheckpointError(f"{folder}: its tensors do not fit an EAGLE-3 draft of its config: "
                              f"{' '.join(str(e).split())[:400]}") from None
    return model.to(target.dtype)


def resolve_path(path: str | Path) -> Path:
    """What ``--draft eagle3 --draft-path`` names: a speculators folder (config.json with speculators_model_type),
    a `spire train --draft eagle3` run folder (its ``eagle3/`` export; the run's checkpoint file when the export
    is missing), or a draft .safetensors checkpoint. Raises CheckpointError when nothing is there."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"draft not found: {p}")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise CheckpointError(f"{p} is a file, not an EAGLE-3 draft (give a speculators folder, a `spire train "
                                  "--draft eagle3` run folder or a draft .safetensors)")
        return p
    if (p / "config.json").is_file():
        return p
    for inner in (p / Eagle3DraftModel.export_name, p / "checkpoint" / "draft.safetensors"):
        if inner.exists():
            return inner
    raise CheckpointError(f"{p} holds no EAGLE-3 draft (no config.json, {Eagle3DraftModel.export_name}/ or "
                          "checkpoint/draft.safetensors)")


def load_eagle3(path: str | Path, target: Transformer) -> Eagle3DraftModel:
    """The :class:`Eagle3DraftModel` at ``path`` (:func:`resolve_path`) for ``target``. Raises CheckpointError or
    TokenizerMismatchError."""
    src = resolve_path(path)
    return Eagle3DraftModel.load(src, target) if src.is_file() else load_speculators(src, target)


def load_draft(target: Transformer, path: str | Path | None = None, **_) -> Eagle3Draft:
    """``spire generate --draft eagle3 --draft-path PATH``: the inference draft (:func:`load_eagle3`); a run folder
    that has not finished gets a warning line. Raises ConfigError (no path), CheckpointError or
    TokenizerMismatchError."""
    if not path:
        raise ConfigError("--draft eagle3 needs --draft-path (a speculators folder, a `spire train --draft eagle3` "
                          "run folder or a draft .safetensors)")
    run = Path(path).expanduser()
    if run.is_dir() and (run / "checkpoint").exists():  # a `spire train` run folder
        warn_if_unfinished(run)
    return Eagle3Draft(load_eagle3(run, target).requires_grad_(False))  # frozen: decodes with kept copies


def _export(src: Path, target: Transformer, name_or_path: str, k: int):
    """The writer of ``spire export --draft eagle3``: the draft at ``src`` (:func:`resolve_path`) as a speculators
    folder (:func:`speculators_writer`, the verifier named ``name_or_path``)."""
    model = load_eagle3(src, target)
    return speculators_writer(model, target, k=k, verifier_name_or_path=name_or_path, allow_extensions=True)
