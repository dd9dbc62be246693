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
ADD_THE_LINE = """
import sys
import spire.registry as registry
line = registry.Kind("repeat", "tests.toy_draft", "the last token again", "none", False,
                     registry.Pricing(weights="none", kv="none", layers=0, training_cost=0.0))
registry.KINDS = registry.KINDS + (line,)
registry._BY_NAME["repeat"] = line
from spire.cli import main
main(sys.argv[1:])
"""


def _spire(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ADD_THE_LINE, *args], capture_output=True, text=True, cwd=ROOT,
                         env={**__import__("os").environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
                              "OMP_NUM_THREADS": "1"},
                         timeout=600)
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
