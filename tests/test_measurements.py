"""measurements/ describes itself: every folder has a README.md with its command (or says it was not recorded), no
committed file holds an absolute path of the machine that ran it, and every JSON file there still parses."""

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "measurements"
# an absolute path of a machine: a root folder where runs, homes, caches and scratch space live (/usr/bin/time, a
# program, and URL paths such as /v1/completions are not)
ABSOLUTE = re.compile(r"(?<![\w.:/~<>$-])/(root|home|work|tmp|Users|mnt|opt|var|srv|data|scratch|private|media"
                      r"|workspace|content|gpfs|lustre)/")


def _files() -> list[Path]:
    """The committed files under measurements/ (every file when this is not a git checkout)."""
    r = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "measurements"], capture_output=True)
    if r.returncode == 0 and r.stdout:
        return [ROOT / p for p in r.stdout.decode().split("\0") if p]
    return [p for p in MEASUREMENTS.rglob("*") if p.is_file()]


def _text(path: Path) -> str | None:
    raw = path.read_bytes()
    if b"\0" in raw:
        return None  # binary (PNG, .pt)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def test_no_committed_measurement_holds_an_absolute_path():
    found = []
    for f in _files():
        text = _text(f) if f.is_file() else None
        for n, line in enumerate((text or "").splitlines(), 1):
            if ABSOLUTE.search(line):
                found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert found == [], f"{len(found)} lines with an absolute path, e.g.\n" + "\n".join(found[:10])


def test_the_absolute_path_check_sees_one():
    assert ABSOLUTE.search('"checkpoint": "/root/.cache/spire/models/x"')
    assert ABSOLUTE.search("--out /tmp/w/goal3") and ABSOLUTE.search("PYTHONPATH=/work/wt-fee/src")
    assert not ABSOLUTE.search('"checkpoint": "<cache>/models/x", /usr/bin/time, http://h:8000/v1/completions')


def test_every_json_file_parses():
    bad = []
    for f in _files():
        if f.suffix == ".json" and f.is_file():
            try:
                json.loads(f.read_text())
            except ValueError as e:
                bad.append(f"{f.relative_to(ROOT)}: {e}")
    assert bad == []


def test_every_folder_has_a_readme_with_its_command():
    """Each folder directly under measurements/ has a README.md that gives the command that made it (a line that
    runs spire, python, make, bash or a script) or says plainly that the command was not recorded."""
    runs = re.compile(r"(spire |python|make |bash |torchrun|benchmarks/|\.sh\b)")
    missing, commandless = [], []
    for d in sorted(p for p in MEASUREMENTS.iterdir() if p.is_dir()):
        readme = d / "README.md"
        if not readme.is_file():
            missing.append(d.name)
            continue
        text = readme.read_text()
        if not (runs.search(text) or "command not recorded" in text.lower()):
            commandless.append(d.name)
    assert missing == [], f"folders under measurements/ without a README.md: {missing}"
    assert commandless == [], f"READMEs that give no command: {commandless}"
