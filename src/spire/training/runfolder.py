"""A training run folder is spire's own: what a run may find in it, and the lock a running `spire train` holds.

A new run starts only in a folder that is absent, empty or holds nothing but what a spire run writes
(:func:`check_fresh_folder`): one error line names the first other file, before anything is written, so a run
pointed at a folder of the user's never truncates, replaces or deletes a file it did not write (the failure of
deepinv #525 and torchtune #481). Every file a run replaces or removes is one of :data:`OWN_NAMES` or a
temporary file of :mod:`spire.paths` beside one of them.

While it trains, a run holds ``train.lock`` (:class:`RunLock`): an exclusive ``flock`` on the file, which holds
the process id and host of the holder. A second writer is refused in one line naming them. The kernel releases
the lock when its holder dies (even by SIGKILL), so a lock file left by a dead process is taken over, with a
note naming the process that left it.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import socket
from pathlib import Path

from spire import registry
from spire.errors import ConfigError

LOCK_FILE = "train.lock"
OWN_NAMES = ("checkpoint", "checkpoint.old", "train_log.jsonl", "summary.json", "draft.safetensors", "draft",
             "draft.old", "eagle3", "eagle3.old", LOCK_FILE)
"""What a spire run writes in its folder (the checkpoint, the log, the summary, each kind's export, the lock)."""
OWN_PATTERNS = tuple(f".{name}.*.tmp" for name in OWN_NAMES) + (".spire-probe-*",)
"""Temporary files and folders of :func:`spire.paths.atomic_write` / :func:`spire.paths.replace_dir` beside them
(left by a run killed while writing), and :func:`spire.paths.check_output_path`'s probe."""


def own_names() -> tuple[str, ...]:
    """:data:`OWN_NAMES` and each trained kind's draft in its run folder (:attr:`spire.registry.Kind.run_weights`,
    read from the registry at each call: a kind added at run time is in it), with the ``.old`` that
    :func:`spire.paths.replace_dir` leaves beside a folder (a name without a suffix)."""
    kinds = [k.run_weights for k in registry.KINDS if k.run_weights]
    extra = [n for w in kinds for n in (w, *((f"{w}.old",) if not os.path.splitext(w)[1] else ()))]
    return OWN_NAMES + tuple(n for n in dict.fromkeys(extra) if n not in OWN_NAMES)


def is_own(name: str) -> bool:
    """Whether a name in a run folder is one a spire run writes (:func:`own_names`, and the temporaries beside
    them)."""
    names = own_names()
    return name in names or any(fnmatch.fnmatchcase(name, p)
                                for p in OWN_PATTERNS + tuple(f".{n}.*.tmp" for n in names[len(OWN_NAMES):]))


def foreign_entries(folder: str | os.PathLike) -> list[str]:
    """The names in ``folder`` that a spire run did not write (sorted; [] for a missing folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if not is_own(p.name))


def check_fresh_folder(folder: str | os.PathLike, option: str = "--out") -> None:
    """Refuse, before any write, a folder for a new run that holds anything a spire run does not write. Raises
    ConfigError naming one such file."""
    other = foreign_entries(folder)
    if other:
        more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
        raise ConfigError(f"{option} {folder} holds {other[0]!r}{more}, which is not a spire run's: a new run trains "
                          "only into a new or empty folder (or one of its own); choose another " + option)


def remove_stale_temporaries(folder: str | os.PathLike) -> list[str]:
    """Remove the temporary files and folders that a run killed while writing left in its run folder (names of
    :data:`OWN_PATTERNS` only; the caller holds the folder's :class:`RunLock`, so no writer is using them).
    Returns their names."""
    import shutil

    gone = []
    folder = Path(folder)
    for p in sorted(folder.iterdir()) if folder.is_dir() else ():
        if p.name.endswith(".tmp") and p.name.startswith(".") and is_own(p.name):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


_HELD: dict[str, list] = {}  # resolved folder -> [open lock file, depth]: one process re-enters its own lock


class RunLock:
    """``with RunLock(folder, log):`` holds ``folder/train.lock`` (created; the folder too) for the block.

    Raises ConfigError, in one line naming the holder's pid and host, when another process holds it. A lock file
    whose holder is gone (a run killed) is taken over; ``log`` gets one note naming it. Re-entrant within one
    process (the CLI and the trainer both take it). A folder the lock created and in which nothing else was
    written (a run refused at its start) is removed again at release."""

    def __init__(self, folder: str | os.PathLike, log=print) -> None:
        self.folder, self.log = Path(folder), log
        self.key = str(self.folder.resolve())

    def __enter__(self) -> "RunLock":
        held = _HELD.get(self.key)
        if held is not None:
            held[1] += 1
            return self
        self.created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK_FILE
        f = open(path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            who = _read(f.read())
            f.close()
            raise ConfigError(f"{self.folder} is in use by another `spire train` ({who}; {path}): wait for it to end, "
                              "or train into another --out") from None
        f.seek(0)
        before = f.read()
        if before.strip() and self.log is not None:
            self.log(f"      took over the lock {path} left by {_read(before)}, which no longer holds it "
                     "(a run that was killed)")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        f.flush()
        _HELD[self.key] = [f, 1, self.created]
        return self

    def __exit__(self, *exc) -> None:
        held = _HELD[self.key]
        held[1] -= 1
        if held[1]:
            return
        del _HELD[self.key]
        f = held[0]
        try:
            f.seek(0)
            f.truncate()  # an empty lock file: released cleanly (a later run takes it without a note)
            f.flush()
            if held[2] and [p.name for p in self.folder.iterdir()] == [LOCK_FILE]:  # refused before any write:
                (self.folder / LOCK_FILE).unlink()                                  # leave no folder behind
                self.folder.rmdir()
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()


def _read(text: str) -> str:
    """'pid 123 on host h' from a lock file's text (or what it holds, when it is not spire's JSON)."""
    try:
        d = json.loads(text)
        return f"pid {d['pid']} on host {d['host']}"
    except (ValueError, KeyError, TypeError):
        return f"a holder unknown ({text.strip()[:60]!r})"
