"""Drafts behind one protocol (:class:`spire.drafts.base.Draft`), one module per kind, listed once in
:mod:`spire.registry` (none, vanilla, magicdec, spire, eagle3, ngram)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spire import backend
import spire.registry as registry
from spire.errors import ConfigError

if TYPE_CHECKING:
    from spire.drafts.base import Draft

DRAFT_KINDS = registry.names()
"""Every draft kind, in the registry's order (a view of :data:`spire.registry.KINDS`)."""


def make_draft(kind: str, target, tokenizer=None, path: str | None = None, dtype=None, **options) -> Draft | None:
    """Build a draft of registered ``kind`` for ``target`` (None for "none": AD).

    path: the --draft-path (a kind with ``path == "none"`` refuses one; "required" kinds need one; the SPIRe
    draft defaults to the newest finished one in the cache). options: the kind's own options, those its registry
    line declares (:attr:`spire.registry.Kind.options`: MagicDec's sink and window, n-gram's n_min and n_max; None
    means not given). Raises ConfigError (an option of another kind, or a value its check refuses, named by its
    flag) / CheckpointError / TokenizerMismatchError.
    """
    entry = registry.kind(kind)
    if path and entry.path == "none":
        takers = ", ".join(registry.names(trains=True))
        raise ConfigError(f"a draft path is for the {takers} drafts; --draft {kind} takes none")
    if not path and entry.path == "required":
        raise ConfigError(f"--draft {kind} needs --draft-path ({entry.summary})")
    options = registry.check_options(kind, options)
    draft = registry.impl(kind).load(target, tokenizer=tokenizer, path=path, dtype=dtype, **options)
    import torch.nn as nn  # this package stays importable without torch (the CLI's parser reads DRAFT_KINDS)

    model = getattr(draft, "model", None)
    if isinstance(model, nn.Module):  # the draft's layers run the way the target does (spire.backend)
        backend.use(model, backend.of(target))
    if draft is not None and path and getattr(draft, "source", None) is None:
        draft.source = str(path)  # what it was loaded from, as given (a kind's load may name the file it read)
    return draft
