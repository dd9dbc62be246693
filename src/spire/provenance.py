"""Where a measurement came from: the command, the commit, the machine and the date, with no absolute path.

One job: what a benchmark script (benchmarks/) or ``spire reproduce`` records beside its numbers, so that an output
folder describes itself. Torch-free (torch's version is read from the installed package's metadata; a CUDA device
is named only when the caller has loaded torch already)::

    from spire.provenance import write_provenance
    write_provenance(args.out)          # OUT/provenance.json (or FILE.provenance.json beside an output file)

From a shell script: ``python -m spire.provenance OUT -- COMMAND ARGS...`` writes the same file for that command.

Paths are made portable (:func:`portable`): inside the checkout spire runs from → relative to it; the spire cache
(``$SPIRE_CACHE``, else ``~/.cache/spire``) → ``<cache>/...``; the home folder → ``~/...``; the temporary folder →
``<tmp>/...``; any other absolute path ``/a/b/...`` whose ``/a`` is a folder of this machine (not ``/usr``, ``/bin``,
``/etc``, ``/dev``, ``/proc``) → ``<a>/b/...``.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import spire
from spire.paths import atomic_write

FILE_NAME = "provenance.json"


def spire_checkout() -> Path:
    """The folder above ``src/`` of the spire that is imported (the checkout, when spire runs from one). Read from
    the ``spire`` package, not this file, so that benchmarks/_provenance.py records the checkout measured when it
    loads this module beside an older spire."""
    return Path(spire.__file__).resolve().parent.parent.parent

_ABS = re.compile(r"(?<![\w.:/~<>-])/(?:[\w.@+=-]+/)*[\w.@+=-]*")


def _prefixes() -> list[tuple[str, str]]:
    """(absolute prefix, replacement), most specific first."""
    cache = Path(os.environ.get("SPIRE_CACHE") or Path.home() / ".cache" / "spire").expanduser()
    pairs = [(spire_checkout(), "."), (cache, "<cache>"), (Path.home(), "~"), (Path(tempfile.gettempdir()), "<tmp>")]
    out = []
    for p, r in pairs:
        for q in {str(p), str(p.resolve())}:
            if q not in ("/", "") and q.startswith("/"):
                out.append((q.rstrip("/"), r))
    return sorted(out, key=lambda x: -len(x[0]))


def portable(text: str) -> str:
    """``text`` with every absolute path made portable (module docstring). Text without one comes back as it is."""
    pairs = _prefixes()

    def sub(m: re.Match) -> str:
        path = m.group(0)
        for prefix, rep in pairs:
            if path == prefix or path.startswith(prefix + "/"):
                rest = path[len(prefix):].lstrip("/")
                if rep == ".":
                    return rest or "."
                return f"{rep}/{rest}" if rest else rep
        parts = path.lstrip("/").split("/", 1)
        if not parts[0] or not os.path.isdir("/" + parts[0]) or parts[0] in ("usr", "bin", "etc", "dev", "proc"):
            return path  # not a machine's folder (an URL path such as /v1/completions), or a system program's
        return f"<{parts[0]}>" + (f"/{parts[1]}" if len(parts) > 1 else "")

    return _ABS.sub(sub, text)


def command(argv: list[str] | None = None) -> str:
    """The command line that runs now (``sys.argv``; or ``argv``, whose first item is the program or script) as one
    shell line, paths made portable: ``python path/to/x.py ...`` for a script, ``python -m mod ...`` for a module run
    with ``-m``, the program's name for a console script (``spire ...``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None) if argv is None else None
    argv = list(sys.argv if argv is None else argv)
    if argv and spec is not None and getattr(spec, "name", None) and argv[0].endswith(".py"):
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    elif argv and argv[0].endswith(".py"):
        head = ["python", argv[0]]
    elif argv:
        head = [Path(argv[0]).name]
    else:
        head = []
    return portable(shlex.join(head + argv[1:]))


def commit(repo: Path | None = None) -> dict:
    """``{"commit": full hash or None, "dirty": whether tracked files differ from it (None unknown)}`` of the git
    checkout spire runs from (``repo``: another folder); None outside a checkout or without git."""
    repo = spire_checkout() if repo is None else repo

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode:
            return {"commit": None, "dirty": None}
        status = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if not status.returncode else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine: CPU model, logical cores (and those this process may use), torch's version, Python, the OS;
    the CUDA device when torch is loaded and sees one."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch": torch_version, "python": platform.python_version(), "os": f"{platform.system()} {platform.release()}",
            "arch": platform.machine()}
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                info["gpu"] = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - a broken CUDA setup must not stop a measurement from being recorded
            pass
    for var in ("OMP_NUM_THREADS", "SPIRE_BACKEND", "SPIRE_KERNELS"):
        if os.environ.get(var):
            info[var] = os.environ[var]
    return info


def provenance(argv: list[str] | None = None, command_line: str | None = None) -> dict:
    """``{"command", "commit", "dirty", "spire", "machine", "date"}``: what :func:`write_provenance` writes (also
    for a caller that puts it inside its own JSON). ``command_line`` overrides the command read from ``argv``."""
    return {"command": portable(command_line) if command_line is not None else command(argv), **commit(),
            "spire": spire.__version__, "machine": machine(),
            "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()}


def provenance_path(out: str | os.PathLike) -> Path:
    """Where the record of ``out`` goes: ``OUT/provenance.json`` for a folder (or a path without a suffix, taken
    as one), ``FILE.provenance.json`` beside an output file (``bench.json`` → ``bench.provenance.json``)."""
    out = Path(out)
    if out.is_dir() or (not out.exists() and not out.suffix):
        return out / FILE_NAME
    return out.with_name(f"{out.stem}.{FILE_NAME}")


def write_provenance(out: str | os.PathLike, argv: list[str] | None = None, command_line: str | None = None,
                     **extra) -> Path:
    """Write :func:`provenance` (plus ``extra`` fields) for the output ``out`` (:func:`provenance_path`),
    atomically. Returns the path written."""
    path = provenance_path(out)
    record = {**provenance(argv, command_line), **extra}
    atomic_write(path, None, json.dumps(record, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m spire.provenance OUT -- COMMAND ARGS...``: the record of COMMAND for the output OUT."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m spire.provenance OUT -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    print(write_provenance(argv[0], command_line=shlex.join(argv[2:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
