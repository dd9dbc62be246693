"""The held-out split, one job: whole documents go to training or to held-out text (never a position inside one),
per source the lowest ``sha256(seed, source, name)`` among the long documents that share few of their long lines with
another document (:func:`split_documents`), Milton (:data:`TRAIN_ONLY_SOURCES`) always training; deterministic and
independent of the documents' order. Raises :class:`spire.errors.DataError` for a bad fraction or a duplicate
document."""

from __future__ import annotations

import hashlib
from typing import Sequence

from spire.data.sources import Document
from spire.errors import DataError


#: Sources whose documents always go to the training split (other editions / overlapping collections).
TRAIN_ONLY_SOURCES = frozenset({"milton"})

#: Held-out documents are chosen among the documents of a source with at least this many characters (about
#: 5k tokens), so that held-out contexts of 1–4k tokens exist; sources with none that long use all documents.
MIN_HELDOUT_CHARS = 20_000

#: ...and among those sharing less than this fraction of their long lines (≥ 40 characters, stripped) with other
#: documents: near-copies (``distutils/msvccompiler.py`` ~ ``msvc9compiler.py``, ``sunau.py`` ~ ``wave.py``…) train.
MAX_SHARED_LINES = 0.2


def _split_rank(seed: int, doc: Document) -> str:
    return hashlib.sha256(f"{seed}\0{doc.source}\0{doc.name}".encode()).hexdigest()


def _long_lines(text: str) -> set[str]:
    return {s for s in (ln.strip() for ln in text.split("\n")) if len(s) >= 40}


def shared_line_fractions(docs: Sequence[Document]) -> dict[str, float]:
    """Per document key: the fraction of its long lines (≥ 40 characters, stripped) that occur in another
    document of ``docs`` (0 for a document without long lines)."""
    sets = {d.key: _long_lines(d.text) for d in docs}
    count: dict[str, int] = {}
    for lines in sets.values():
        for ln in lines:
            count[ln] = count.get(ln, 0) + 1
    return {k: (sum(count[ln] > 1 for ln in v) / len(v) if v else 0.0) for k, v in sets.items()}


def split_documents(docs: Sequence[Document], heldout_fraction: float = 0.1, seed: int = 0,
                    min_heldout_chars: int = MIN_HELDOUT_CHARS, max_shared_lines: float = MAX_SHARED_LINES
                    ) -> tuple[list[Document], list[Document]]:
    """Split whole documents into ``(train, heldout)``, each in the input order.

    Per source, ``max(1, round(heldout_fraction × n_docs))`` documents are held out (at most ``n_docs − 1`` so a
    source keeps a training document, except a one-document source, which is held out), chosen as the lowest
    ``sha256(seed, source, name)`` among its *eligible* documents: at least ``min_heldout_chars`` characters and
    less than ``max_shared_lines`` of their long lines found in another document of ``docs`` (all of the source's
    documents if none is eligible). Milton (:data:`TRAIN_ONLY_SOURCES`) always trains. Deterministic; never depends
    on the order of ``docs``. Raises :class:`DataError` for a fraction outside [0, 1) or duplicate documents."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction must be in [0, 1) (got {heldout_fraction})")
    seen: set[str] = set()
    for d in docs:
        if d.key in seen:
            raise DataError(f"document {d.key!r} appears twice")
        seen.add(d.key)
    heldout_keys: set[str] = set()
    if heldout_fraction > 0:
        shared = shared_line_fractions(docs)
        by_source: dict[str, list[Document]] = {}
        for d in docs:
            by_source.setdefault(d.source, []).append(d)
        for source, group in by_source.items():
            if source in TRAIN_ONLY_SOURCES:
                continue
            n = max(1, round(heldout_fraction * len(group)))
            if len(group) > 1:
                n = min(n, len(group) - 1)
            eligible = [d for d in group
                        if len(d.text) >= min_heldout_chars and shared[d.key] < max_shared_lines] or group
            ranked = sorted(eligible, key=lambda d: _split_rank(seed, d))
            heldout_keys.update(d.key for d in ranked[:n])
    train = [d for d in docs if d.key not in heldout_keys]
    heldout = [d for d in docs if d.key in heldout_keys]
    return train, heldout
