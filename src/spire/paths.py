"""Where spire keeps what it derives (converted checkpoints, token data, trained drafts)."""

from __future__ import annotations

import os
from pathlib import Path


def spire_cache_dir() -> Path:
    """``$SPIRE_CACHE`` if set, else ``~/.cache/spire``; created on first use."""
    path = Path(os.environ.get("SPIRE_CACHE") or Path.home() / ".cache" / "spire").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path
