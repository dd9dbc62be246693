"""The main job end to end on the embedded target (tiny budget), and its bad-input behaviour."""

import json
import subprocess
import sys

import pytest

SPIRE = [sys.executable, "-m", "spire.cli"]


def _run(args, env_cache):
    return subprocess.run(SPIRE + args, capture_output=True, text=True, env=env_cache, timeout=900)


@pytest.fixture
def env(tmp_path, monkeypatch):
    import os

    from tests.helpers import scratch_cache

    e = dict(os.environ)
    # reuse the converted model and data of the real cache, but train drafts in a throwaway cache
    e["SPIRE_CACHE"] = str(scratch_cache(tmp_path))
    return e


@pytest.mark.parametrize("args,message", [
    (["--preset", "nope"], "unknown preset"),
    (["-k", "0"], "k must be a positive integer"),
    (["-L", "-5"], "L must be a positive integer"),
    (["--budget", "0"], "budget must be positive"),
    (["-L", "9000"], "exceeds the target's 8192 positions"),
    (["--tau-L", "0,512"], "--tau-L takes positive context lengths"),
])
@pytest.mark.slow  # `spire reproduce` in a subprocess
def test_bad_input_one_line_nothing_written(tmp_path, env, args, message):
    from tests.conftest import smollm2_available

    if "9000" in args and not smollm2_available():
        pytest.skip("needs the embedded target")
    out = tmp_path / "out"
    res = _run(["reproduce", "--out", str(out), *args], env)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists()


@pytest.mark.slow  # `spire reproduce` in a subprocess
def test_missing_checkpoint_for_data(tmp_path, env):
    res = _run(["data", "--target", str(tmp_path / "nowhere")], env)
    assert res.returncode != 0 and res.stderr.strip().splitlines()[-1].startswith("error: checkpoint not found")


@pytest.mark.slow
def test_reproduce_end_to_end_tiny_budget(tmp_path, env, smollm2):
    out = tmp_path / "out"
    res = _run(["reproduce", "--quick", "--out", str(out), "--budget", "8", "--n-contexts", "2", "-L", "64",
                "-G", "8", "--vanilla-budget", "4", "--ablations", "no-feedback,full-kv", "--ablation-budget", "3",
                "--tau-L", "32,96", "--tau-L-contexts", "2"], env)
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    prov = results["provenance"]  # where the numbers came from, with no absolute path
    assert prov["command"].startswith("python -m spire.cli reproduce --quick --out ") and "<tmp>/" in prov["command"]
    assert prov["machine"]["cores"] >= 1 and prov["machine"]["torch"] and prov["date"].startswith("20")
    assert str(tmp_path) not in json.dumps(prov)
    taus = {(t["draft"], t["temperature"]): t for t in results["tau"]}
    kinds = ("vanilla", "magicdec", "spire", "eagle3", "ngram")  # every draft kind, in the registry's order
    drafts = {*kinds, "spire-no-feedback", "spire-full-kv"}
    assert set(taus) == {(d, T) for d in drafts for T in (0.0, 1.0)}
    for t in taus.values():
        assert 1.0 <= t["ci_low"] <= t["tau"] <= t["ci_high"] <= 5.0
    assert {(r["draft"], r["L"]) for r in results["tau_vs_L"]} == {(d, L) for d in kinds for L in (32, 96)}
    assert {(r["draft"], r["k"]) for r in results["tau_vs_k"]} == {(d, k) for d in kinds for k in (1, 4)}
    assert {(r["draft"], r["B"], r["L"]) for r in results["throughput"]["best_k"]} == {
        (d, B, L) for d in kinds for B in (1, 4, 16, 64, 256) for L in (64, 256, 512, 1024, 2048, 4096, 8192)}
    assert all(r["best_k"] in (1, 4) for r in results["throughput"]["best_k"])
    # EAGLE-3 trains for SPIRe's budget (equal training compute by the clock), from the same target cache
    assert results["trainings"]["eagle3"]["draft"] == "eagle3"
    for label in ("spire", "vanilla", "eagle3", "spire-no-feedback", "spire-full-kv"):
        tr = results["trainings"][label]
        assert tr["steps"] >= 1 and len(tr["heldout_alpha_per_position"]) == 4
    assert results["trainings"]["vanilla"]["loss"] == "hard"
    assert results["trainings"]["spire-full-kv"]["ablation"] == "full-kv"
    rows = results["throughput"]["measured"]["T=0"]
    assert {r["draft"] for r in rows} == set(kinds)
    goal = results["throughput"]["goal"]["T=0"]
    at = {r["draft"]: r["multiplier"] for r in rows if r["B"] == 64 and r["L"] == 64}
    assert goal["spire_vs_magicdec"] == pytest.approx(at["spire"] / at["magicdec"])
    variants = {r["variant"] for r in results["throughput"]["ablations"]["T=0"]}
    assert variants == {"SPIRe", "no feedback memory", "full KV cache (no sparse KV)"}
    # the T = 1 diagnosis of every draft but n-gram, on the first contexts, with the same τ as the τ table there
    diag = {r["name"]: r["diagnosis"] for r in results["diagnosis"]}
    assert list(diag) == ["vanilla", "magicdec", "spire", "eagle3"]
    for d in diag.values():
        assert d["temperature"] == 1.0 and len(d["positions"]) == 4 and d["positions"][0]["reached"] >= 2
        assert d["positions"][0]["tv_verified"] == pytest.approx(d["positions"][0]["tv"], abs=1e-4)
    assert diag["spire"]["positions"][0]["outside_mass"] > 0 == diag["magicdec"]["positions"][0]["outside_mass"]
    report = (out / "REPORT.md").read_text()
    assert "Why each draft accepts what it does (T = 1)" in report and "diagnosis_T1.png" in report
    assert "τ (average tokens per round" in report and "2.78 / 1.36 / 2.05" in report
    assert "τ against context length" in report and "Order of importance" in report and "Goal check" in report
    assert "τ against k (greedy)" in report and "SPIRe against EAGLE-3" in report
    assert "By held-out α drop" in report and "Does τ stay flat with L" in report
    for f in results["figures"]:
        assert (out / f).stat().st_size > 1000
    # the same job again, with ablation "none" at the main draft's budget: every draft is found finished, the
    # "none" run is the main run (not trained twice), and every τ comes from the measurement cache unchanged
    res = _run(["reproduce", "--quick", "--out", str(tmp_path / "again"), "--budget", "8", "--n-contexts", "2",
                "-L", "64", "-G", "8", "--vanilla-budget", "4", "--ablations", "none", "--ablation-budget", "8",
                "--tau-L", "32,96", "--tau-L-contexts", "2"], env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "spire-none: the same settings as spire, not trained again" in res.stderr
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["trainings"]["spire-none"]["run_dir"] == results["trainings"]["spire"]["run_dir"]
    taus2 = {(t["draft"], t["temperature"]): t for t in again["tau"]}
    for (draft, T), t in taus.items():
        if draft in kinds:
            assert taus2[(draft, T)].get("cached") and taus2[(draft, T)]["tau"] == t["tau"]
    for T in (0.0, 1.0):
        assert taus2[("spire-none", T)]["tau"] == taus[("spire", T)]["tau"]
    assert all(r.get("cached") for r in again["tau_vs_L"])


def test_reproduce_help_states_the_config_defaults():
    """`spire reproduce --help` writes each default in brackets; they must be ReproduceConfig's own."""
    import inspect
    import re

    from spire import cli
    from spire.pipeline import ReproduceConfig

    c = ReproduceConfig()
    src = inspect.getsource(cli.reproduce)
    expected = {"SPIRe's optimizer steps of 4 x 256 tokens": c.steps, "EAGLE-3's optimizer steps": c.eagle3_steps,
                "Training seconds per ablation": c.ablation_budget_s,
                "Contexts per L in the sweep": c.tau_L_contexts, "Held-out contexts per τ measurement": c.n_contexts,
                "Context length for τ (tokens)": c.L, "Tokens generated per context": c.G,
                "the paper's last layers)": c.first_layers, "the whole vocabulary)": c.draft_vocab,
                "train epochs over": c.cache_steps}
    flat = re.sub(r'"\s*\n\s*"', "", src)  # join implicitly concatenated help strings
    for text, value in expected.items():
        m = re.search(re.escape(text) + r'[^\[]*\[([0-9.]+)\]', flat)
        assert m, text
        assert float(m.group(1)) == float(value), (text, m.group(1), value)


def test_help_keeps_bracketed_defaults(capsys):
    """Help texts are plain text: a bracketed default that starts with a letter ("[bfloat16]") is shown, not
    swallowed as a rich style tag."""
    from spire.cli import main

    with pytest.raises(SystemExit):
        main(["reproduce", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "[bfloat16]" in out and "[one per torch thread on a CPU]" in out


def test_draft_keys_are_stable_and_every_run_is_checked_first(monkeypatch, tmp_path):
    """A finished draft is found by a key over its settings: a setting added later and left off (the hidden-
    state matching term at 0) must not change the key, or every cached draft would be trained again (keys
    pinned from the code before the field existed). With the term on, an ablation without target activations
    trains without it, and settings no run can take are refused before the first run trains."""
    from pathlib import Path

    from spire.errors import ConfigError
    from spire.pipeline import ReproduceConfig, _draft_dir, spire_architecture, training_runs

    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path))
    # the defaults of the code the keys come from (before the bridge, whose "off" leaves the key as it was)
    cfg = ReproduceConfig(budget_s=1500.0, cache_steps=400, vanilla_budget_s=900.0, bridge=False, steps=None,
                          eagle3_steps=None)  # trained by time, as the main job did then
    runs = training_runs(cfg, spire_architecture(cfg, 30, 49152))
    keys = {label: _draft_dir(cfg, tc, Path("/nonexistent/smollm2"), label).name for label, tc in runs}
    assert keys.pop("eagle3").startswith("smollm2-135m-eagle3-")  # a kind added later: its own key
    assert keys == {"spire": "smollm2-135m-spire-20cb574c63", "vanilla": "smollm2-135m-vanilla-b098eef00a"}
    cfg.bridge = True  # a bridged draft is another draft
    bridged = dict(training_runs(cfg, spire_architecture(cfg, 30, 49152)))["spire"]
    assert bridged.draft_config.bridge and _draft_dir(cfg, bridged, Path("/nonexistent/smollm2")).name != keys["spire"]
    cfg = ReproduceConfig(hidden_weight=1.0, ablations=("no-feedback", "no-feedback-no-target"))
    runs = dict(training_runs(cfg, spire_architecture(cfg, 30, 49152)))
    assert runs["spire"].hidden_weight == 1.0 and runs["spire-no-feedback"].hidden_weight == 1.0
    assert runs["spire-no-feedback-no-target"].hidden_weight == 0.0 and runs["vanilla"].hidden_weight == 0.0
    cfg = ReproduceConfig(hidden_weight=1.0, n_draft_layers=1, first_layers=0)
    with pytest.raises(ConfigError, match="at least 2 draft layers"):
        training_runs(cfg, spire_architecture(cfg, 30, 49152))
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ConfigError, match="finite number"):
            ReproduceConfig(hidden_weight=bad).validate()


def test_the_main_job_trains_fixed_step_counts_by_default_and_by_time_only_with_budget():
    """Issue 52: what the main job trains is the recipe's (the step counts of the committed results: SPIRe 671,
    EAGLE-3 969, vanilla half of SPIRe's tokens with no time cap), not the machine's speed; --budget alone trains
    SPIRe and EAGLE-3 by time, the vanilla draft then at most 1100 s."""
    from spire.commands.reproduce import overrides
    from spire.pipeline import ReproduceConfig, spire_architecture, training_runs

    cfg = ReproduceConfig()
    runs = dict(training_runs(cfg, spire_architecture(cfg, 30, 49152)))
    assert (runs["spire"].max_steps, runs["eagle3"].max_steps) == (671, 969)
    assert runs["spire"].max_steps * runs["spire"].batch_size * runs["spire"].seq_len == 687_104
    assert runs["spire"].budget_s == runs["eagle3"].budget_s == runs["vanilla"].budget_s == 1e9  # no clock decides
    timed = ReproduceConfig(**overrides({"budget": 600.0}, None, None, None, None, None))
    runs = dict(training_runs(timed, spire_architecture(timed, 30, 49152)))
    assert runs["spire"].max_steps is None and runs["eagle3"].max_steps is None
    assert (runs["spire"].budget_s, runs["eagle3"].budget_s, runs["vanilla"].budget_s) == (600.0, 600.0, 1100.0)
    both = ReproduceConfig(**overrides({"budget": 600.0, "steps": 50}, None, None, None, None, None))
    assert both.steps == 50 and both.eagle3_steps is None  # EAGLE-3 then follows SPIRe's steps
    assert dict(training_runs(both, spire_architecture(both, 30, 49152)))["eagle3"].max_steps == 50


@pytest.mark.parametrize("args,line", [
    (["--first-layers", "9"], "--first-layers must be in [0, --n-draft-layers 8], got 9"),  # (first_layers ... =8)
    (["--train-processes", "3"], "--train-processes must divide the training batch of 4 rows, got 3"),
    (["--diagnose-contexts", "-1"], "--diagnose-contexts must be >= 0, got -1"),
    (["--tau-k-contexts", "0"], "--tau-k-contexts must be >= 1, got 0"),  # (it said "--tau-k takes positive k")
    (["--steps", "0"], "--steps, --vanilla-steps, --ablation-steps and --eagle3-steps must be >= 1"),
    (["--eagle3-budget", "0"], "--eagle3-budget must be positive, got 0 s"),
    (["--tau-L-contexts", "0"], "--tau-L-contexts must be a positive integer, got 0"),
])
def test_impossible_settings_name_their_flags(tmp_path, capsys, args, line):
    """`spire reproduce`'s settings it cannot run are one line naming the flag as the user wrote it (not the
    ReproduceConfig field), exit 2, before anything is loaded or written."""
    from tests.helpers import run_cli

    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "reproduce", "--out", str(out), *args)
    assert (code, err.splitlines()) == (2, [f"error: {line}"]) and not out.exists()
