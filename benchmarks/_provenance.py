"""The benchmarks' access to :mod:`spire.provenance` (what each script writes beside its numbers: the command, the
commit, the machine, the date), also when ``PYTHONPATH`` points at an older checkout without it (the before / after
runs): then this checkout's module is loaded by its path, and it records the commit of the spire imported."""

from __future__ import annotations

import importlib.util
from pathlib import Path

try:
    from spire.provenance import portable, provenance, write_provenance
except ImportError:  # an older spire under test
    _spec = importlib.util.spec_from_file_location(
        "_spire_provenance", Path(__file__).resolve().parents[1] / "src" / "spire" / "provenance.py")
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    portable, provenance, write_provenance = _mod.portable, _mod.provenance, _mod.write_provenance



def portable_log(path: Path) -> None:
    """Rewrite a server's log in place with :func:`portable` paths (a log is committed beside the numbers; the
    machine's folders would not mean anything elsewhere). A missing log is left missing."""
    if path.is_file():
        path.write_text(portable(path.read_text(errors="replace")))


def write_results(path: Path, payload: dict) -> None:
    """``payload`` as indented JSON at ``path`` (its folder made), and the provenance beside it."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    write_provenance(path.parent)


__all__ = ["portable", "portable_log", "provenance", "write_provenance", "write_results"]
