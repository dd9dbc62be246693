"""Drafts behind one protocol (:class:`spire.drafts.base.Draft`), one module per kind, listed once in
:mod:`spire.registry` (none, vanilla, magicdec, spire, eagle3, ngram)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spire import backend, defaults
import spire.registry as registry
from spire.errors import ConfigError

if TYPE_CHECKING:
    from spire.drafts.base import Draft

DRAFT_KINDS = registry.names()
"""Every draft kind, in the registry's order (a view of :data:`spire.registry.KINDS`)."""


def make_draft(kind: str, target, tokenizer=None, path: str | None = None, sink: int = defaults.SINK,
               window: int = defaults.WINDOW, dtype=None, **options) -> Draft | None:
    """Build a draft of registered ``kind`` for ``target`` (None for "none": AD).

    path: the --draft-path (a kind with ``path == "none"`` refuses one; "required" kinds need one; the SPIRe
    draft defaults to the newest finished one in the cache). sink / window: MagicDec's view; options: the kind's
    own settings (e.g. n_min / n_max for ngram), those its ``KIND.options`` declares (another is a ConfigError). Raises
    ConfigError / CheckpointError / TokenizerMismatchError.
    """
    entry = registry.kind(kind)
    if path and entry.path == "none":
        takers = ", ".join(registry.names(trains=True))
        raise ConfigError(f"a draft path is for the {takers} drafts; --draft {kind} takes none")
    if not path and entry.path == "required":
        raise ConfigError(f"--draft {kind} needs --draft-path ({entry.summary})")
    impl = registry.impl(kind)
    foreign = sorted(name for name, value in options.items() if value is not None and name not in impl.options)
    if foreign:  # an option of another kind would be dropped silently by this kind's load
        raise ConfigError(f"--draft {kind} takes no option {', '.join(foreign)} (its options: "
                          f"{', '.join(impl.options) or 'none'})")
    draft = impl.load(target, tokenizer=tokenizer, path=path, sink=sink, window=window, dtype=dtype, **options)
    import torch.nn as nn  # this package stays importable without torch (the CLI's parser reads DRAFT_KINDS)

    model = getattr(draft, "model", None)
    if isinstance(model, nn.Module):  # the draft's layers run the way the target does (spire.backend)
        backend.use(model, backend.of(target))
    return draft
