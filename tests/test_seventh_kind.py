"""The registry's promise (issue: the drafts the field uses): a seventh draft kind is its module, its tests and
one registry line. A toy kind (tests/toy_draft.py) is added by one line, and with no other change `spire generate`
decodes with it (greedy = AD), `spire tau` measures it and `spire throughput` prices it (no weights: zero cost)."""

from __future__ import annotations

import json

import pytest

import spire.drafts.registry as registry
from tests.helpers import run_cli


@pytest.fixture
def seventh_kind(monkeypatch):
    line = registry.Kind("repeat", "tests.toy_draft", "the last token again", "none", False,
                         registry.Pricing(weights="none", kv="none", layers=0, training_cost=0.0))
    monkeypatch.setattr(registry, "KINDS", registry.KINDS + (line,))
    monkeypatch.setattr(registry, "_BY_NAME", {**registry._BY_NAME, "repeat": line})
    return line


def test_a_seventh_kind_is_one_registry_line(seventh_kind, capsys, smollm2, tmp_path):
    prompts = ["ab ab ab ab ab ab", "Once upon a time there was a"]
    out = {}
    for draft in ("none", "repeat"):
        code, stdout, err = run_cli(capsys, "generate", *prompts, "--draft", draft, "--max-new-tokens", "12",
                                    "--format", "json")
        assert code == 0, err
        out[draft] = json.loads(stdout)
    assert [o["token_ids"] for o in out["repeat"]["outputs"]] == [o["token_ids"] for o in out["none"]["outputs"]]
    assert out["repeat"]["draft"] == "repeat" and out["repeat"]["tau"] >= 1.0

    code, stdout, err = run_cli(capsys, "tau", "--draft", "repeat", "-L", "64", "-G", "8", "--n-contexts", "2",
                                "--format", "json", "--threads", "1")
    assert code == 0, err
    rows = json.loads(stdout)["rows"]
    assert rows and all(r["draft"] == "repeat" and 1.0 <= r["tau"] <= 5.0 for r in rows)

    code, stdout, err = run_cli(capsys, "throughput", "--preset", "smollm2-135m", "-B", "64", "-L", "512", "--tau",
                                "repeat=1.5", "--format", "json")
    assert code == 0, err
    row = next(r for r in json.loads(stdout)["rows"] if r["draft"] == "repeat")
    assert row["delta_t"] == pytest.approx(1.0) and row["multiplier"] == pytest.approx(1.5)
