"""spire.provenance: what a measurement records of where it came from (the command, the commit, the machine, the
date) with no absolute path, and every benchmark script writing it."""

import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from spire import provenance as pv

ROOT = Path(__file__).resolve().parents[1]
ABSOLUTE = re.compile(r"(?<![\w.:/~<>-])/(root|home|work|tmp|Users|mnt|opt|var|srv|data|scratch|private|media)/")


def test_portable_makes_each_kind_of_path_relative_or_a_placeholder(monkeypatch, tmp_path):
    cache, home, tmp = tmp_path / "cache", tmp_path / "home", tmp_path / "t"
    monkeypatch.setenv("SPIRE_CACHE", str(cache))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    repo = pv.spire_checkout()
    text = (f"python {repo}/benchmarks/x.py --out {tmp}/run-1 --draft {cache}/drafts/abc/draft.safetensors "
            f"--log {home}/logs/a.txt http://127.0.0.1:8000/v1/completions /v1/models /usr/bin/time {repo}")
    assert pv.portable(text) == ("python benchmarks/x.py --out <tmp>/run-1 --draft <cache>/drafts/abc/draft.safetensors "
                                 "--log ~/logs/a.txt http://127.0.0.1:8000/v1/completions /v1/models /usr/bin/time .")
    assert pv.portable("no paths here, 3/4 of 10 tokens/s") == "no paths here, 3/4 of 10 tokens/s"


@pytest.mark.skipif(not Path("/var").is_dir(), reason="no /var on this machine")
def test_a_machine_folder_outside_the_known_ones_becomes_a_placeholder():
    assert pv.portable("cat /var/log/run-3/x.json") == "cat <var>/log/run-3/x.json"


def test_the_record_of_a_folder_and_of_a_file(tmp_path):
    folder = tmp_path / "o"
    path = pv.write_provenance(folder, argv=[str(ROOT / "benchmarks" / "x.py"), "--out", str(folder)], note="tiny")
    assert path == folder / "provenance.json"
    rec = json.loads(path.read_text())
    assert rec["command"].startswith("python benchmarks/x.py --out ") and str(tmp_path) not in rec["command"]
    assert rec["note"] == "tiny" and rec["spire"]
    m = rec["machine"]
    assert m["cores"] == os.cpu_count() and m["cpu"] and m["python"]
    import torch
    assert m["torch"] == torch.__version__
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if git.returncode == 0:
        assert rec["commit"] == git.stdout.strip() and isinstance(rec["dirty"], bool)
    else:
        assert rec["commit"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", rec["date"])
    assert not ABSOLUTE.search(path.read_text()), path.read_text()
    # an output file: the record beside it
    assert pv.write_provenance(tmp_path / "bench.json") == tmp_path / "bench.provenance.json"


def test_command_line_tool_records_another_command(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-m", "spire.provenance", str(tmp_path / "gpu"), "--",
                        "benchmarks/gpu_bench.sh", str(tmp_path / "gpu")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "gpu" / "provenance.json").read_text())
    assert rec["command"].startswith("benchmarks/gpu_bench.sh ") and str(tmp_path) not in rec["command"]
    bad = subprocess.run([sys.executable, "-m", "spire.provenance", str(tmp_path)], capture_output=True, text=True,
                         env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("usage:")


def test_every_benchmark_script_writes_its_provenance():
    """Each script in benchmarks/ records the command, commit, machine and date: a Python script through
    benchmarks/_provenance.py (write_provenance, or write_results, which writes it beside the JSON), a shell script
    through `python -m spire.provenance`."""
    missing = []
    tools = {"gguf_parts.py"}  # a file tool of the GPU run's carry (split / join), which measures nothing
    for f in sorted((ROOT / "benchmarks").glob("*.*")):
        if f.name in tools:
            continue
        text = f.read_text()
        if f.suffix == ".py" and f.name != "_provenance.py":
            if "from _provenance import" not in text or not re.search(r"\b(write_provenance|provenance|write_results)\(", text):
                missing.append(f.name)
        elif f.suffix == ".sh" and "-m spire.provenance" not in text:
            missing.append(f.name)
    assert missing == []


def test_a_benchmark_writes_the_record_beside_its_output(tmp_path):
    """benchmarks/draft_weights.py at tiny shapes: its JSON and the record beside it."""
    main = runpy.run_path(str(ROOT / "benchmarks" / "draft_weights.py"))["main"]
    out = tmp_path / "dw.json"
    assert main(["--rows", "1", "--repeats", "1", "--layers", "1", "--d-model", "64", "--d-ff", "96",
                 "--heads", "2,1,32", "--json", str(out)]) == 0
    rec = json.loads((tmp_path / "dw.provenance.json").read_text())
    assert set(rec) >= {"command", "commit", "machine", "date"}


def test_the_benchmarks_results_and_logs_carry_no_machine_path(tmp_path, monkeypatch):
    """benchmarks/_provenance.py: write_results puts the record beside the JSON; portable_log rewrites a server's log
    (committed beside the numbers) with the cache folder as <cache>."""
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    mod = runpy.run_path(str(ROOT / "benchmarks" / "_provenance.py"))
    mod["write_results"](tmp_path / "out" / "results.json", {"tokens_per_s": 43.3})
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == {"tokens_per_s": 43.3}
    assert set(json.loads((tmp_path / "out" / "provenance.json").read_text())) >= {"command", "commit", "date"}
    log = tmp_path / "spire.log"
    log.write_text(f"spire serve: int8 weights from {tmp_path}/cache/drafts/run/draft.safetensors\n")
    mod["portable_log"](log)
    assert log.read_text() == "spire serve: int8 weights from <cache>/drafts/run/draft.safetensors\n"
