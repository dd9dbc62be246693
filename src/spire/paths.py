"""Where spire keeps what it derives (converted checkpoints, token data, trained drafts)."""

from __future__ import annotations

import os
from pathlib import Path


def spire_cache_dir() -> Path:
    """``$SPIRE_CACHE`` if set, else ``~/.cache/spire``; created on first use."""
    path = Path(os.environ.get("SPIRE_CACHE") or Path.home() / ".cache" / "spire").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write(path: str | os.PathLike, write, text: str | None = None) -> Path:
    """Write a file so that readers see the old file or the whole new one, never a part.

    ``write(f)`` receives a binary file object (or pass ``text`` instead of ``write``). The data go to a
    temporary file in the same folder, are flushed and fsynced, then renamed over ``path`` (mode 0644).
    Returns the path.
    """
    import tempfile

    path = Path(path)
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
