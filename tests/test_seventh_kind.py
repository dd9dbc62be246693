"""The registry's promise (issue: the drafts the field uses): a seventh draft kind is its module, its tests and
one registry line. A toy kind (tests/toy_draft.py) is added as one more line of ``registry.KINDS`` before anything
else of spire is imported (as a line in the source would be), and with no other change `spire generate` decodes
with it (greedy = AD), `spire tau` measures it and `spire throughput` prices it (no weights: zero cost). Each
command runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # each test runs spire's commands on the embedded target in subprocesses
ADD_THE_LINE = """
import sys
import spire.registry as registry
line = registry.Kind("repeat", "tests.toy_draft", "the last token again", "none", False,
                     registry.Pricing(weights="none", kv="none", layers=0, training_cost=0.0), None,
                     (registry.DraftOption("min_run", int, "propose a token once seen this often in a row", 1,
                                           lambda v: None if v >= 1 else f"must be >= 1, got {v}"),))
registry.KINDS = registry.KINDS + (line,)
registry._BY_NAME["repeat"] = line
from spire.cli import main
main(sys.argv[1:])
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ADD_THE_LINE, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
                               "OMP_NUM_THREADS": "1"},
                          timeout=600)


def _spire(*args: str) -> dict:
    out = _run(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_a_seventh_kind_is_one_registry_line(smollm2):
    prompts = ["ab ab ab ab ab ab", "Once upon a time there was a"]
    out = {d: _spire("generate", *prompts, "--draft", d, "--max-new-tokens", "12", "--format", "json")
           for d in ("none", "repeat")}
    assert [o["token_ids"] for o in out["repeat"]["outputs"]] == [o["token_ids"] for o in out["none"]["outputs"]]
    assert out["repeat"]["draft"] == "repeat" and out["repeat"]["tau"] >= 1.0

    rows = _spire("tau", "--draft", "repeat", "-L", "64", "-G", "8", "--n-contexts", "2", "--format", "json",
                  "--threads", "1")["rows"]
    assert rows and all(r["draft"] == "repeat" and 1.0 <= r["tau"] <= 5.0 for r in rows)

    rows = _spire("throughput", "--preset", "smollm2-135m", "-B", "64", "-L", "512", "--tau", "repeat=1.5",
                  "--format", "json")["rows"]
    row = next(r for r in rows if r["draft"] == "repeat")
    assert row["delta_t"] == pytest.approx(1.0) and row["multiplier"] == pytest.approx(1.5)


def test_a_kinds_option_is_a_flag_of_every_command_that_builds_drafts(smollm2):
    """The kind's one declared option (``min_run``) becomes ``--repeat-min-run`` in generate, serve, tau, bench and
    compare with no change to a command: it reaches the kind's load (at min_run 99 the toy proposes token 0 only,
    so nothing is accepted and τ is exactly 1; at 1 it repeats the last token and, on repetitive text, τ > 1),
    greedy output stays AD's, and a value its check refuses is one error line naming the flag, in every command."""
    prompt = "ab ab ab ab ab ab ab ab ab ab ab ab"
    ad = _spire("generate", prompt, "--draft", "none", "--max-new-tokens", "16", "--format", "json")
    runs = {n: _spire("generate", prompt, "--draft", "repeat", "--repeat-min-run", str(n), "--max-new-tokens", "16",
                      "--format", "json") for n in (1, 99)}
    for n, out in runs.items():
        assert [o["token_ids"] for o in out["outputs"]] == [o["token_ids"] for o in ad["outputs"]], n
    assert runs[99]["tau"] == 1.0 < runs[1]["tau"]
    taus = {n: _spire("tau", "--draft", "repeat", "--repeat-min-run", str(n), "-L", "64", "-G", "8", "--n-contexts",
                      "2", "--temperature", "0", "--format", "json", "--threads", "1")["rows"][0]["tau"]
            for n in (1, 99)}
    assert taus[99] == 1.0 < taus[1]
    compared = _run("compare", prompt, "--draft", "repeat", "--repeat-min-run", "2", "--max-new-tokens", "8",
                    "--dtype", "float32")
    assert compared.returncode == 0 and "identical to AD" in compared.stdout, compared.stderr[-2000:]
    for command in (["generate", prompt, "--draft", "repeat"], ["serve", "--draft", "repeat"],
                    ["tau", "--draft", "repeat"], ["bench", "--quick"], ["compare", prompt, "--draft", "repeat"]):
        bad = _run(*command, "--repeat-min-run", "0")  # refused before any model loads
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and lines[-1] == "error: --repeat-min-run must be >= 1, got 0", (command, bad.stderr)
