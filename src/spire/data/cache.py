"""The on-disk token cache, one job: :func:`prepare_data` (the registry texts) and :func:`prepare_text_files` (the
user's files) load the documents, split them, tokenize them and store the flat arrays and ``manifest.json`` under
``<cache>/data/<key>/`` (``files-<key>`` for user files; written to temporary names, the manifest last), keyed by a
hash of the tokenizer, the EOS id, the sources or files, the split settings and :data:`DATA_VERSION`; a complete
folder is loaded instead (:func:`load_token_data`), and :func:`data_summary_table` prints one for ``spire data``.
Raises :class:`spire.errors.DataError` for a missing, unfinished or inconsistent folder and bad settings."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from spire.data.sources import (PART_CHARS, SDISTS, SOURCES, TEXT_SUFFIXES, Document, _cache_root, _canonical_sources,
                                _file_documents, _text_files, load_documents, stdlib_dir)
from spire.data.split import MAX_SHARED_LINES, MIN_HELDOUT_CHARS, split_documents
from spire.data.tokens import _tokenize_docs, _tokenizer_fingerprint, _vocab_size
from spire.data.windows import TokenData, TokenSplit
from spire.errors import DataError
from spire.paths import atomic_write


#: Bump when the documents or the on-disk format change: old prepared folders are then ignored.
DATA_VERSION = 1


def _save_split(folder: Path, prefix: str, split: TokenSplit) -> None:
    atomic_write(folder / f"{prefix}.npy", lambda f: np.save(f, split.tokens))
    atomic_write(folder / f"{prefix}_offsets.npy", lambda f: np.save(f, split.offsets))


def _build_split(arrays: list[np.ndarray], docs: list[Document], dtype: np.dtype) -> TokenSplit:
    lens = np.array([a.size for a in arrays], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
    tokens = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype)
    return TokenSplit(tokens, offsets, [d.name for d in docs], [d.source for d in docs])


def load_token_data(path: str | os.PathLike) -> TokenData:
    """Load a prepared folder (``<cache>/data/<key>/``). Raises :class:`DataError` if it is missing,
    unfinished (no manifest) or inconsistent."""
    folder = Path(path)
    mpath = folder / "manifest.json"
    if not mpath.is_file():
        raise DataError(f"no prepared token data in {folder} (manifest.json missing): run `spire data`")
    try:
        manifest = json.loads(mpath.read_text())
        splits = {}
        for name in ("train", "heldout"):
            tokens = np.load(folder / f"{name}.npy")
            offsets = np.load(folder / f"{name}_offsets.npy")
            m = manifest["splits"][name]
            split = TokenSplit(tokens, offsets.astype(np.int64), list(m["names"]), list(m["sources"]))
            if (tokens.ndim != 1 or offsets.ndim != 1 or len(offsets) != len(split.names) + 1
                    or int(offsets[0]) != 0 or int(offsets[-1]) != tokens.shape[0]
                    or tokens.shape[0] != int(m["tokens"]) or np.any(np.diff(offsets) < 0)):
                raise ValueError(f"{name} arrays do not match the manifest")
            splits[name] = split
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"prepared token data in {folder} is unreadable or inconsistent ({e}); "
                        "delete the folder and prepare again") from None
    return TokenData(splits["train"], splits["heldout"], manifest, folder)


def prepare_data(tokenizer: Any, cache_dir: str | os.PathLike | None = None, sources: Sequence[str] = SOURCES,
                 heldout_fraction: float = 0.1, seed: int = 0, progress: bool = True, eos_id: int | None = None,
                 max_stdlib_files: int = 400) -> TokenData:
    """Tokenize every document of ``sources``, split by document, store under ``<cache>/data/<key>/`` and
    return the :class:`TokenData`; if that folder is already complete, load it instead (no tokenizing).

    ``tokenizer``: a ``tokenizers.Tokenizer`` (``encode_batch``), a Hugging Face fast tokenizer (its
    ``backend_tokenizer`` is used) or any callable ``tokenizer(texts, add_special_tokens=False)["input_ids"]``.
    ``eos_id``: appended after every document; ``None`` uses ``tokenizer.eos_token_id`` when it has one, else
    nothing is appended. Token arrays are uint16 when the vocabulary has ≤ 65,535 entries, else uint32.
    Files are written to temporary names and renamed; ``manifest.json`` goes last, so an interrupted run is
    redone, never half-used. Raises :class:`DataError` (unknown source, bad fraction, download failure…)."""
    srcs = _canonical_sources(sources)
    if not 0.0 <= heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction must be in [0, 1) (got {heldout_fraction})")
    if eos_id is None:
        eos_id = getattr(tokenizer, "eos_token_id", None)
    eos_id = int(eos_id) if eos_id is not None else None
    cache = _cache_root(cache_dir)
    vocab_size = _vocab_size(tokenizer)
    key_inputs: dict[str, Any] = {
        "data_version": DATA_VERSION,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "eos_id": eos_id,
        "sources": list(srcs),
        "heldout_fraction": float(heldout_fraction),
        "min_heldout_chars": MIN_HELDOUT_CHARS,
        "max_shared_lines": MAX_SHARED_LINES,
        "seed": int(seed),
        "sdists": sorted({f"{SDISTS[s][0]}=={SDISTS[s][1]}" for s in srcs if s in SDISTS}),
    }
    if "stdlib" in srcs:
        key_inputs["stdlib"] = {"max_files": int(max_stdlib_files), "python": sys.version.split()[0],
                                "path": str(stdlib_dir())}
    key = hashlib.sha256(json.dumps(key_inputs, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache / "data" / key
    if (folder / "manifest.json").is_file():
        try:
            return load_token_data(folder)
        except DataError:
            (folder / "manifest.json").unlink(missing_ok=True)  # inconsistent: prepare again

    t0 = time.perf_counter()
    docs = load_documents(srcs, cache, max_stdlib_files)
    train_docs, heldout_docs = split_documents(docs, heldout_fraction, seed)
    if not train_docs:
        raise DataError("no training documents: add sources")
    t1 = time.perf_counter()
    train_arrays, max_train = _tokenize_docs(tokenizer, train_docs, eos_id, progress, "tokenize train")
    held_arrays, max_held = _tokenize_docs(tokenizer, heldout_docs, eos_id, progress, "tokenize held-out")
    t2 = time.perf_counter()
    max_id = max(max_train, max_held)
    n_ids = max(vocab_size or 0, max_id + 1)
    dtype = np.dtype(np.uint16) if n_ids <= 65535 else np.dtype(np.uint32)
    train = _build_split(train_arrays, train_docs, dtype)
    heldout = _build_split(held_arrays, heldout_docs, dtype)

    def split_manifest(split: TokenSplit) -> dict[str, Any]:
        return {"documents": len(split), "tokens": split.n_tokens, "names": split.names, "sources": split.sources,
                "doc_tokens": [int(x) for x in split.lengths]}

    manifest: dict[str, Any] = {
        "key": key, "key_inputs": key_inputs, "vocab_size": vocab_size, "dtype": dtype.name, "eos_id": eos_id,
        "splits": {"train": split_manifest(train), "heldout": split_manifest(heldout)},
        "timing_s": {"load_documents": round(t1 - t0, 3), "tokenize": round(t2 - t1, 3)},
    }
    data = TokenData(train, heldout, manifest, folder)
    manifest["per_source"] = data.summary()["sources"]
    folder.mkdir(parents=True, exist_ok=True)
    _save_split(folder, "train", train)
    _save_split(folder, "heldout", heldout)
    atomic_write(folder / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    return data


def data_summary_table(token_data: TokenData) -> str:
    """A plain-text table of documents and tokens per source and split (for ``spire data``)."""
    s = token_data.summary()
    rows = [("source", "train docs", "train tokens", "held-out docs", "held-out tokens", "longest held-out")]
    for src, e in s["sources"].items():
        rows.append((src, f"{e['train_documents']:,}", f"{e['train_tokens']:,}", f"{e['heldout_documents']:,}",
                     f"{e['heldout_tokens']:,}", f"{e['heldout_max_doc_tokens']:,}"))
    rows.append(("total", f"{s['train']['documents']:,}", f"{s['train']['tokens']:,}",
                 f"{s['heldout']['documents']:,}", f"{s['heldout']['tokens']:,}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0 or k == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    foot = f"vocab {s['vocab_size']}, eos id {s['eos_id']}, key {s['key']}"
    if s["path"]:
        foot += f", {s['path']}"
    return "\n".join(lines + [foot])


def prepare_text_files(tokenizer: Any, paths: Sequence[str | os.PathLike], cache_dir: str | os.PathLike | None = None,
                       heldout_fraction: float = 0.1, seed: int = 0, progress: bool = True,
                       eos_id: int | None = None) -> TokenData:
    """Token data from the user's own text files (folders are searched for :data:`TEXT_SUFFIXES`), split by
    document (files, or parts of long files) and cached under ``<cache>/data/files-<key>/`` keyed by the files'
    paths, sizes and contents (SHA-256; ``manifest["previous_key"]``, in memory only, is the key of spire versions
    that keyed by modification times, which runs saved then recorded). Raises :class:`DataError` for a missing
    path, no text, or a split that leaves no training or no held-out document."""
    files = _text_files(paths)
    if not files:
        raise DataError(f"no text files in {', '.join(map(str, paths))} (looked for {', '.join(TEXT_SUFFIXES)})")
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction must be in (0, 1) (got {heldout_fraction})")
    if eos_id is None:
        eos_id = getattr(tokenizer, "eos_token_id", None)
    tok_fp = _tokenizer_fingerprint(tokenizer)
    # the text's identity is its content: a `touch` or a checkout that rewrites a file unchanged keeps the key, and
    # an edit that keeps the size and the time changes it (a file's path stays part of it: documents are named by it)
    stats = [(str(f.resolve()), f.stat().st_size, _file_sha256(f)) for f in files]
    key_inputs = {"data_version": DATA_VERSION, "tokenizer": tok_fp, "eos_id": eos_id, "identity": "sha256",
                  "files": stats, "heldout_fraction": heldout_fraction, "seed": seed, "part_chars": PART_CHARS}
    key = hashlib.sha256(json.dumps(key_inputs, sort_keys=True).encode()).hexdigest()[:16]
    # the key of before (paths, sizes, modification times), which runs saved before this version recorded
    old_inputs = {**key_inputs, "files": [(p, n, f.stat().st_mtime_ns) for (p, n, _), f in zip(stats, files)]}
    del old_inputs["identity"]
    old_key = "files-" + hashlib.sha256(json.dumps(old_inputs, sort_keys=True).encode()).hexdigest()[:16]
    folder = _cache_root(cache_dir) / "data" / f"files-{key}"
    if (folder / "manifest.json").is_file():
        data = load_token_data(folder)
        data.manifest["previous_key"] = old_key
        return data
    docs = _file_documents(files)
    if not docs:
        raise DataError(f"the data files are empty: {', '.join(map(str, paths))}")
    train_docs, heldout_docs = split_documents(docs, heldout_fraction, seed, min_heldout_chars=0)
    if not train_docs or not heldout_docs:
        raise DataError(f"{len(docs)} document(s) cannot be split into training and held-out text: give more "
                        "files (or longer ones)")
    train_arrays, max_train = _tokenize_docs(tokenizer, train_docs, eos_id, progress, "tokenize train")
    held_arrays, max_held = _tokenize_docs(tokenizer, heldout_docs, eos_id, progress, "tokenize held-out")
    n_ids = max(_vocab_size(tokenizer) or 0, max(max_train, max_held) + 1)
    dtype = np.dtype(np.uint16) if n_ids <= 65535 else np.dtype(np.uint32)
    train, heldout = _build_split(train_arrays, train_docs, dtype), _build_split(held_arrays, heldout_docs, dtype)
    manifest: dict[str, Any] = {
        "key": f"files-{key}", "key_inputs": key_inputs, "vocab_size": _vocab_size(tokenizer), "dtype": dtype.name,
        "eos_id": eos_id,
        "splits": {name: {"documents": len(s), "tokens": s.n_tokens, "names": s.names, "sources": s.sources,
                          "doc_tokens": [int(x) for x in s.lengths]} for name, s in (("train", train),
                                                                                     ("heldout", heldout))},
    }
    folder.mkdir(parents=True, exist_ok=True)
    _save_split(folder, "train", train)
    _save_split(folder, "heldout", heldout)
    atomic_write(folder / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    return TokenData(train, heldout, {**manifest, "previous_key": old_key}, folder)


def _file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
