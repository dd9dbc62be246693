"""Where spire keeps what it derives (converted checkpoints, token data, trained drafts)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from spire.errors import ConfigError


def spire_cache_dir() -> Path:
    """``$SPIRE_CACHE`` if set, else ``~/.cache/spire``; created on first use."""
    path = Path(os.environ.get("SPIRE_CACHE") or Path.home() / ".cache" / "spire").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_output_path(path: str | os.PathLike, option: str, folder: bool = False) -> Path:
    """Refuse, before any work, an output path that cannot be written: a part of its parent path that is a file,
    a nearest existing folder in which no file can be created (tried with a probe file, removed at once), or
    (``folder``) a file where a folder goes / (not ``folder``) a folder where a file goes. ``option`` names it in
    the error. Creates nothing. Returns the path. Raises :class:`spire.errors.ConfigError`."""
    path = Path(path)
    where = None
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{option} {path}: {parent} is a file, not a folder")
            where = parent
            break
    if path.exists() and path.is_dir() != folder:
        kind = "a file, not a folder" if folder else "a folder, not a file"
        raise ConfigError(f"{option} {path} is {kind}: choose another {option}")
    if not folder and path.exists() and not path.is_file():  # a device or a pipe: a rename would replace it
        raise ConfigError(f"{option} {path} is not a regular file (a device or a pipe): choose a file path")
    where = path if folder and path.is_dir() else where
    if where is not None:
        try:
            with tempfile.NamedTemporaryFile(dir=where, prefix=".spire-probe-"):
                pass
        except OSError as e:
            raise ConfigError(f"{option} {path}: cannot write in {where} ({e.strerror or e})") from None
    return path


def atomic_write(path: str | os.PathLike, write, text: str | None = None) -> Path:
    """Write a file so that readers see the old file or the whole new one, never a part.

    ``write(f)`` receives a binary file object (or pass ``text`` instead of ``write``). The data go to a
    temporary file in the same folder, are flushed and fsynced, then renamed over ``path`` (mode 0644).
    Returns the path.
    """
    import tempfile

    path = Path(path)
    if path.exists() and not path.is_file():  # never rename over a device, a pipe or a folder
        raise ConfigError(f"{path} is not a regular file: spire writes only regular files")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if text is not None:
                f.write(text.encode())
            else:
                write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def replace_dir(path: str | os.PathLike, write) -> Path:
    """Replace the folder ``path`` by a new one so that a reader (or a run killed at any point) finds the
    old folder or the whole new one.

    ``write(tmp)`` fills a fresh temporary folder beside ``path``; its files are fsynced, then the old folder
    is renamed to ``<path>.old``, the new one to ``path``, and the old one removed. :func:`existing_dir`
    finds ``<path>.old`` if a crash fell between the two renames. Temporary folders that an interrupted
    earlier call left beside ``path`` are removed once the new folder is in place (one writer per path).
    """
    import shutil
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    old = path.with_name(path.name + ".old")
    try:
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a run killed while writing
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def existing_dir(path: str | os.PathLike) -> Path | None:
    """``path`` if it exists, else the ``<path>.old`` that :func:`replace_dir` left if interrupted, else None."""
    path = Path(path)
    if path.is_dir():
        return path
    old = path.with_name(path.name + ".old")
    return old if old.is_dir() else None
