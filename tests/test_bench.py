"""`spire bench` (issue 7): the measured-vs-predicted grid on the tiny random model, the roofline calibration,
the cost model reading a calibration, the skinny-matmul kernel and the decoding fast path against the
reference path."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from spire.bench.calibrate import Calibration, calibrate, load_calibration
import spire.bench.run as bench_run
from spire.bench.report import write_outputs
from spire.throughput import pricing
from spire.throughput.pricing import shape_of
from spire.bench.run import BenchConfig, predict, run_bench, summarize
from spire.cli import main
from spire.drafts.magicdec import MagicDecDraft
from spire.errors import ConfigError
from spire.kv_cache import SinkWindow
from spire.throughput.cost_model import CostOptions, round_costs


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only add synchronization (and long stalls on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _contexts(L: int, n: int) -> torch.Tensor:
    return torch.randint(0, 97, (n, L), generator=torch.Generator().manual_seed(L))


def _t(cost, hoi):  # the paper's forward time, written out: max(C, (N + KV)·HOI)
    return max(cost.C, (cost.N + cost.KV) * hoi)


@pytest.fixture(scope="module")
def tiny_result(tiny):
    from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel

    drafts = {"magicdec": MagicDecDraft(1, 4),
              "spire": SpireDraft(SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, window=4)))}
    cfg = BenchConfig(Bs=[1, 3], Ls=[9, 20], k=3, G=5, reps=1, window=4)
    return run_bench(tiny, _contexts, drafts, cfg, hoi=5.0, flops_per_s=1e10, dtype_name="fp32")


def test_bench_grid_measures_every_cell(tiny, tiny_result):
    rows = tiny_result["rows"]
    assert [(r["B"], r["L"], r["draft"]) for r in rows] == [
        (B, L, d) for L in (9, 20) for B in (1, 3) for d in ("magicdec", "spire")]
    for r in rows:
        for key in ("t_ad_s", "t_verify_s", "t_draft_s", "ad_tokens_per_s", "sd_tokens_per_s"):
            assert 0 < r[key] < math.inf, (key, r)
        assert r["delta_t_measured"] == pytest.approx((3 * r["t_draft_s"] + r["t_verify_s"]) / r["t_ad_s"])
        assert r["delta_t_measured"] > 0
        assert 1 <= r["tau"] <= 4  # k + 1 = 4 at most
        assert r["multiplier_measured"] == pytest.approx(r["sd_tokens_per_s"] / r["ad_tokens_per_s"])
        assert r["identical_to_ad"] is True  # float32 greedy SD is lossless
        assert r["note"].startswith("verify = ")
    # MagicDec with window 4 on the tiny model agrees with the target on some tokens, the random SPIRe draft
    # (untrained) rarely: τ is measured, not assumed
    assert max(r["tau"] for r in rows if r["draft"] == "magicdec") > 1


def test_bench_prediction_is_the_cost_model(tiny, tiny_result):
    """Predicted Δt equals the paper's formula on the same shapes, with real bytes per value (fp32 = 4),
    the unembedding and attention FLOPs counted and the drafts' sink + window."""
    target = shape_of(tiny)
    assert (target.n_layers, target.d_model, target.n_kv, target.q_per_kv) == (4, 48, 2, 2)
    for r in tiny_result["rows"]:
        draft = target if r["draft"] == "magicdec" else target.with_layers(2)
        opts = CostOptions(weight_bytes=4, kv_bytes=4, attention_flops=True, embeddings=True, sink=1, window=4)
        c = round_costs(target, draft, r["kind"], r["B"], r["L"], 3, options=opts)
        expected = (3 * _t(c.draft, 5.0) + _t(c.verify, 5.0)) / _t(c.target, 5.0)
        assert r["delta_t_predicted"] == pytest.approx(expected, rel=1e-12)
        assert r["multiplier_predicted"] == pytest.approx(r["tau"] / expected)
        assert r["delta_t_ratio"] == pytest.approx(expected / r["delta_t_measured"])
        assert r["predicted_t_ad_s"] == pytest.approx(_t(c.target, 5.0) / 1e10)
        assert r["memory_bound"] == ((c.verify.N + c.verify.KV) * 5.0 >= c.verify.C)
    # a SPIRe draft (2 of 4 layers) is predicted cheaper than MagicDec (all 4 layers) in every cell
    by_cell = {(r["B"], r["L"], r["draft"]): r["delta_t_predicted"] for r in tiny_result["rows"]}
    assert all(by_cell[(B, L, "spire")] < by_cell[(B, L, "magicdec")] for B in (1, 3) for L in (9, 20))


def test_bench_outputs(tmp_path, tiny_result):
    summary = summarize(tiny_result)
    j, m = write_outputs({**tiny_result, "target": "tiny"}, summary, tmp_path)
    data = json.loads(j.read_text())
    assert len(data["rows"]) == 8 and data["summary"]["memory_bound_cells"] == sum(
        r["memory_bound"] for r in tiny_result["rows"])
    assert data["hoi"] == 5.0 and data["dtype"] == "fp32"
    text = m.read_text()
    assert "| B | L | draft |" in text and "## Goals" in text and text.count("\n| ") >= 9
    assert "(16, 4096)" in text and "not measured in this run" in text
    assert summary["long_context_batch_goal"] is None


def test_summary_long_context_goal():
    row = dict(memory_bound=True, delta_t_ratio=1.1, B=16, L=4096)
    result = {"rows": [{**row, "draft": "spire", "multiplier_measured": 1.6, "sd_tokens_per_s": 160.0},
                       {**row, "draft": "magicdec", "multiplier_measured": 1.2, "sd_tokens_per_s": 120.0,
                        "delta_t_ratio": 1.5}]}
    s = summarize(result)
    assert s["memory_bound_cells"] == 2 and s["within_tolerance"] == 1
    assert s["long_context_batch_goal"] == {"spire_multiplier": 1.6, "magicdec_multiplier": 1.2, "met": True}
    result["rows"][0]["multiplier_measured"] = 1.4
    assert summarize(result)["long_context_batch_goal"]["met"] is False


def test_bench_config_errors(tiny):
    with pytest.raises(ConfigError):
        BenchConfig(Bs=[0]).validate()
    with pytest.raises(ConfigError):
        BenchConfig(Ls=[]).validate()
    with pytest.raises(ConfigError):
        BenchConfig(k=0).validate()
    with pytest.raises(ConfigError, match="positions"):  # L + G + k + 1 beyond the tiny model's 1024
        run_bench(tiny, _contexts, {}, BenchConfig(Bs=[1], Ls=[1020], G=8, reps=1))


@pytest.mark.slow
def test_bench_refuses_a_long_L_before_drafts_and_calibration(monkeypatch):
    """L beyond the target's positions is refused as soon as the target is known: before the drafts load and the
    hardware is calibrated (it used to come after both)."""
    import spire.commands.bench as bench_command

    def unexpected(*a, **k):
        raise AssertionError("reached past the positions check")

    monkeypatch.setattr(bench_command, "get_calibration", unexpected)
    monkeypatch.setattr(bench_command, "load_drafts", unexpected)
    for random_weights in (True, False):
        args = bench_command.BenchArgs(Bs=[1], Ls=[9000], random_weights=random_weights, device="cpu", out=None)
        with pytest.raises(ConfigError, match="L=9000 .* exceeds the target's 8192 positions"):
            bench_command.run(args, log=lambda m: None)


def test_calibrate_quick_and_roundtrip(tmp_path):
    cal = calibrate(["fp32"], "cpu", quick=True)
    d = cal.dtypes["fp32"]
    assert d["matmul_flops"] > 1e6 and d["bandwidth"] > 1e6 and d["copy_bandwidth"] > 1e6
    assert d["matmul_size"] in (64, 128) and cal.quick and cal.device == "cpu"
    path = cal.save(tmp_path / "cal.json")
    back = load_calibration(path)
    hw = back.hardware("fp32")
    assert hw.flops_for("fp32") == pytest.approx(d["matmul_flops"])
    assert hw.hoi("fp32") == pytest.approx(d["matmul_flops"] / d["bandwidth"])
    assert json.loads(path.read_text())["hoi"]["fp32"] == pytest.approx(hw.hoi("fp32"))
    with pytest.raises(ConfigError, match="no bf16"):
        back.hardware("bf16")
    with pytest.raises(ConfigError, match="cannot calibrate"):
        calibrate(["fp64"], "cpu", quick=True)
    (tmp_path / "bad.json").write_text(json.dumps({"device": "cpu", "dtypes": {"fp32": {"matmul_flops": -1}}}))
    with pytest.raises(ConfigError):
        load_calibration(tmp_path / "bad.json")


def test_get_calibration_keeps_the_other_dtypes(tmp_path, monkeypatch):
    """A bench in a dtype the saved calibration lacks measures it and saves both: the saved fp32 entry is kept
    (it was overwritten before, losing a calibration that took minutes)."""
    import spire.commands.bench as bench_cmd

    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path))
    saved = Calibration("cpu", bench_cmd.cached_calibration.__globals__["device_name"](torch.device("cpu")),
                        {"fp32": {"matmul_flops": 1e11, "bandwidth": 2e10}}, created="2026-01-01T00:00:00")
    saved.save()
    fresh = Calibration("cpu", saved.device_name, {"bf16": {"matmul_flops": 3e11, "bandwidth": 2e10}})
    monkeypatch.setattr(bench_cmd, "calibrate", lambda dtypes, device, quick, log: fresh)
    cal = bench_cmd.get_calibration(None, torch.device("cpu"), "bf16", False, lambda m: None)
    assert set(cal.dtypes) == {"fp32", "bf16"} and cal.notes["kept_from"] == {"fp32": "2026-01-01T00:00:00"}
    again = bench_cmd.cached_calibration(torch.device("cpu"))
    assert again.dtypes["fp32"]["matmul_flops"] == 1e11 and again.dtypes["bf16"]["matmul_flops"] == 3e11


def _cal_file(tmp_path):
    cal = Calibration("cpu", "test chip", {"fp32": {"matmul_flops": 1e11, "bandwidth": 2e10},
                                           "bf16": {"matmul_flops": 4e11, "bandwidth": 2e10}}, memory_bytes=64e9)
    return cal.save(tmp_path / "cal.json")


def test_throughput_accepts_calibration(tmp_path, capsys):
    """`spire throughput --calibration FILE`: HOI = measured FLOP/s ÷ bytes/s, real bytes per value."""
    path = _cal_file(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["throughput", "--preset", "smollm2-135m", "-B", "1", "-L", "512", "--calibration", str(path),
              "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert (e.value.code or 0) == 0
    assert out["hoi"] == pytest.approx(5.0) and out["weight_bytes"] == 4 and out["kv_bytes"] == 4
    assert out["hardware"] == "calibrated cpu" and out["memory_bytes"] == 64e9
    assert out["rows"][0]["sd_tokens_per_s"] > 0
    with pytest.raises(SystemExit):
        main(["throughput", "--preset", "smollm2-135m", "-B", "1", "-L", "512", "--calibration", str(path),
              "--dtype", "bf16", "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert out["hoi"] == pytest.approx(20.0) and out["weight_bytes"] == 2
    with pytest.raises(SystemExit) as e:
        main(["throughput", "--calibration", str(path), "--hardware", "h100-sxm"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: give --calibration or")


def test_bench_cli_errors(capsys):
    for args, message in ((["bench", "-B", "0"], "B must be a positive integer"),
                          (["bench", "--device", "tpu"], "device"),
                          (["bench", "calibrate", "--dtype", "fp64", "--quick"], "cannot calibrate dtype")):
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err[-1].startswith("error:") and message in err[-1], (args, err)


def test_predict_memory_bound_regime():
    """At B = 1 a verify pass over k + 1 = 5 tokens reads N bytes for 5·2·N FLOPs: memory-bound when HOI > 10/4
    (fp32), compute-bound below."""
    from spire.throughput.shapes import SMOLLM2_135M

    opts = CostOptions(weight_bytes=4, kv_bytes=4)
    assert predict(SMOLLM2_135M, SMOLLM2_135M, "magicdec", 1, 8, 4, 600, None, opts)["verify_memory_bound"]
    assert not predict(SMOLLM2_135M, SMOLLM2_135M, "magicdec", 1, 8, 4, 2.0, None, opts)["verify_memory_bound"]


# ------------------------------------------------------------------------------------ decoding fast path

def test_skinny_kernel_matches_torch():
    from spire import kernels

    if not kernels.available():
        pytest.skip(f"kernel unavailable: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(37, 72, generator=g), torch.randn(8, 72, generator=g), torch.randn(3, 72, generator=g)]
    for M in (1, 2, 3, 5, 8, 17, 32):
        x = torch.randn(M, 72, generator=g)
        y = kernels.skinny_linear(x, ws)
        torch.testing.assert_close(y, torch.cat([F.linear(x, w) for w in ws], -1), atol=1e-5, rtol=1e-5)
    w = torch.randn(6, 70, generator=g)
    for M in (1, 2, 4):  # K not a multiple of 8: scalar tail (M <= 2: the split-accumulator pass)
        x = torch.randn(M, 70, generator=g)
        torch.testing.assert_close(kernels.skinny_linear(x, [w]), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert kernels.skinny_linear(x.double(), [w.double()]) is None  # not float32: caller falls back
    assert kernels.skinny_linear(torch.randn(65, 70), [w]) is None  # too many rows for the kernel


def test_fast_path_equals_reference_path(tiny):
    """Batched decode with per-row positions, with and without a sink + window view (gathered), equals the
    reference path (autograd on: plain projections, full mask over the dense cache)."""
    import copy

    ref = copy.deepcopy(tiny).requires_grad_(True)  # autograd through weights -> reference path everywhere
    g = torch.Generator().manual_seed(3)
    lens = [30, 12, 47]
    ids = torch.randint(0, 97, (3, 60), generator=g)
    for view in (None, SinkWindow(1, 6), SinkWindow(2, 3)):
        outs = []
        for model, grad in ((tiny, False), (ref, True)):
            cache = model.new_cache(3, 64)
            with torch.set_grad_enabled(grad):
                model(ids[:, :47], torch.arange(47)[None].expand(3, 47), cache)
                steps = []
                for t in range(4):  # rows at different positions: per-row writes, masks, gathers
                    pos = torch.tensor(lens)[:, None] + t
                    tok = ids.gather(1, pos)
                    steps.append(model(tok, pos, cache, view=view).logits.detach())
                pos = torch.tensor(lens)[:, None] + torch.arange(4, 9)  # a verify-sized block
                steps.append(model(ids.gather(1, pos), pos, cache, view=view).logits.detach())
            outs.append(torch.cat(steps, 1))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_lazy_logits_and_weight_cache_invalidation(tiny):
    import copy

    model = copy.deepcopy(tiny)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6)[None]
    with torch.no_grad():
        out = model(ids, pos)
        assert "lazy" in repr(out)
        before = out.logits.clone()
        one = model(ids[:, :1], pos[:, :1]).logits  # M = 1: builds the transposed weight copies
        model.layers[0].mlp.up_proj.weight.mul_(0.5)  # in-place update: the fused copies must be rebuilt
        after_update = model(ids[:, :1], pos[:, :1]).logits
        model.layers[0].mlp.up_proj.weight.mul_(2.0)
        restored = model(ids[:, :1], pos[:, :1]).logits
    assert before.shape == (1, 6, 97)
    torch.testing.assert_close(restored, one)
    assert not torch.allclose(after_update, one, atol=1e-3)


def test_autograd_flows_through_a_frozen_model(tiny):
    """Frozen weights but an input that requires grad: the reference path runs, so gradients reach the input
    (the fast path's native kernel would cut the graph)."""
    from spire.rope import rope_cos_sin

    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(5)[None].expand(2, 5)
    x = tiny.model.embed_tokens(ids).detach().requires_grad_(True)
    cos, sin = rope_cos_sin(pos, tiny.cfg.d_head, tiny.cfg.rope_theta, x.dtype)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool).expand(1, 1, 5, 5).tril()
    y = tiny.layers[0](x, cos, sin, lambda k, v: (k, v), mask)
    tiny.logits(y).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    with torch.no_grad():
        fast = tiny.logits(tiny.layers[0](x, cos, sin, lambda k, v: (k, v), mask))
    torch.testing.assert_close(fast, tiny.logits(y).detach(), atol=1e-5, rtol=1e-5)


def test_bench_cli_smoke(tmp_path, monkeypatch, capsys, tiny):
    """`spire bench` end to end (calibration, drafts, grid, bench.json, BENCH.md, the JSON on stdout) with
    --random-weights, the random SmolLM2-shaped target swapped for the tiny model to stay fast."""
    import spire.bench.run as bench_run

    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))  # no calibration from the user's cache
    monkeypatch.setattr(bench_run, "random_target", lambda dtype, device, seed=0: tiny)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--random-weights", "--quick", "-B", "1,2", "-L", "12", "-G", "3", "--reps", "1",
              "--window", "4", "--device", "cpu", "--threads", "1", "--clock", "cpu", "--out",
              str(tmp_path / "out"), "--format", "json"])
    captured = capsys.readouterr()
    assert (e.value.code or 0) == 0, captured.err
    data = json.loads(captured.out)
    assert [(r["B"], r["draft"]) for r in data["rows"]] == [(1, "magicdec"), (1, "ngram"), (1, "spire"),
                                                              (2, "magicdec"), (2, "ngram"), (2, "spire")]
    for r in data["rows"]:  # n-gram: its measured draft step is the lookup; the cost model prices it at nothing
        if r["draft"] == "ngram":
            assert r["t_draft_s"] > 0 and r["predicted_t_draft_s"] == 0
            assert r["delta_t_predicted"] == pytest.approx(r["predicted_t_verify_s"] / r["predicted_t_ad_s"])
    assert data["calibration"]["quick"] and data["hoi"] == pytest.approx(data["calibration"]["hoi"]["fp32"])
    assert data["config"]["clock"] == "cpu" and data["threads"] == 1
    assert all(r["delta_t_measured"] > 0 and r["identical_to_ad"] for r in data["rows"])
    assert (tmp_path / "out" / "bench.json").is_file() and "## Goals" in (tmp_path / "out" / "BENCH.md").read_text()


def _tiny_bench_json(out, capsys, *flags) -> dict:
    """`spire bench --random-weights` at B = 1, L = 12 (random_target patched by the caller) with ``flags``:
    the JSON it prints."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--random-weights", "--quick", "-B", "1", "-L", "12", "-G", "3", "--reps", "1", "--window", "4",
              "--device", "cpu", "--threads", "1", *flags, "--out", str(out), "--format", "json"])
    captured = capsys.readouterr()
    assert (e.value.code or 0) == 0, captured.err
    return json.loads(captured.out)


def test_bench_cli_bf16_weights(tmp_path, monkeypatch, capsys, tiny):
    """`spire bench --weights bf16`: the target is rounded to bf16 weights, SD stays identical to AD, and the
    prediction counts 2 bytes per weight value (a smaller predicted t_AD than with 4)."""
    import copy

    import spire.bench.run as bench_run

    model = copy.deepcopy(tiny)
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench_run, "random_target", lambda dtype, device, seed=0: model)
    outs = {w: _tiny_bench_json(tmp_path / w, capsys, "--weights", w) for w in ("fp32", "bf16")}
    assert (outs["fp32"]["weight_bytes"], outs["bf16"]["weight_bytes"]) == (4, 2)
    assert all(r["identical_to_ad"] for r in outs["bf16"]["rows"])
    t32, t16 = outs["fp32"]["rows"][0]["predicted_t_ad_s"], outs["bf16"]["rows"][0]["predicted_t_ad_s"]
    assert t16 < t32
    up = model.layers[0].mlp.up_proj.weight
    assert torch.equal(up, up.bfloat16().float()) and not torch.equal(up, tiny.layers[0].mlp.up_proj.weight)
    assert "weight-only bf16" in (tmp_path / "bf16" / "BENCH.md").read_text()


def _recording_bench(tmp_path, monkeypatch, tiny):
    """`spire bench --random-weights` on a copy of ``tiny``, recording every SPIRe draft model it builds: (the
    target copy, the list the draft models go to, the real SpireDraft class)."""
    import copy

    from spire.commands import bench as bench_cmd

    model = copy.deepcopy(tiny)
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench_run, "random_target", lambda dtype, device, seed=0: model)
    drafts: list = []
    real_draft = bench_cmd.SpireDraft
    monkeypatch.setattr(bench_cmd, "SpireDraft", lambda m: drafts.append(m) or real_draft(m))
    return model, drafts, real_draft


def test_bench_cli_bf16_draft_weights(tmp_path, monkeypatch, capsys, tiny):
    """`spire bench --draft-weights bf16` beside a float32 target: only the SPIRe draft's own weights are
    rounded, SD stays identical to AD, the draft step is predicted at 2 bytes per weight value (MagicDec's,
    the target's weights, and verify at 4), and BENCH.md says so; without such a draft the option does nothing;
    bad values are refused."""
    model, drafts, real_draft = _recording_bench(tmp_path, monkeypatch, tiny)
    outs = {w: _tiny_bench_json(tmp_path / w, capsys, "--draft-weights", w) for w in ("fp32", "bf16")}
    assert (outs["fp32"]["draft_weight_bytes"], outs["bf16"]["draft_weight_bytes"]) == (4, 2)
    assert outs["bf16"]["weight_bytes"] == 4
    assert all(r["identical_to_ad"] for r in outs["bf16"]["rows"])
    rows = {(dw, r["draft"]): r for dw, o in outs.items() for r in o["rows"]}
    full = pricing.draft_kind_and_shape(real_draft(drafts[-1]), tiny)[1]  # full vocabulary: the target's head
    body, head = full.body_params(), full.unembedding_params()
    assert rows["bf16", "spire"]["draft_weight_bytes"] == pytest.approx((2 * body + 4 * head) / (body + head))
    assert rows["bf16", "magicdec"]["draft_weight_bytes"] == 4
    # the prediction: only the draft forward of a draft with its own weights is costed at 2 bytes
    from spire.bench.run import predict, predict_split
    from spire.throughput.cost_model import CostOptions
    shape = shape_of(tiny)
    d_shape = pricing.draft_kind_and_shape(real_draft(drafts[0]), tiny)[1]
    opts = CostOptions(weight_bytes=4, kv_bytes=4, attention_flops=True, embeddings=True, window=4)
    same = predict(shape, d_shape, "spire", 1, 64, 4, 5.0, 1e10, opts)
    assert predict_split(shape, d_shape, "spire", 1, 64, 4, 5.0, 1e10, opts, opts) == same
    half = predict_split(shape, d_shape, "spire", 1, 64, 4, 5.0, 1e10, opts, CostOptions(
        weight_bytes=2, kv_bytes=4, attention_flops=True, embeddings=True, window=4))
    assert (half["t_ad_s"], half["t_verify_s"]) == (same["t_ad_s"], same["t_verify_s"])
    assert half["t_draft_s"] < same["t_draft_s"]
    assert half["delta_t"] == pytest.approx((4 * half["t_draft_s"] + half["t_verify_s"]) / half["t_ad_s"])
    up = model.layers[0].mlp.up_proj.weight
    assert torch.equal(up, tiny.layers[0].mlp.up_proj.weight)  # the target stays float32
    dup = drafts[-1].layers[0].mlp.up_proj.weight
    assert torch.equal(dup, dup.bfloat16().float()) and not torch.equal(dup, drafts[0].layers[0].mlp.up_proj.weight)
    assert "draft's own weights at 2 bytes per value" in (tmp_path / "bf16" / "BENCH.md").read_text()
    # a draft vocabulary's head (not a submodule) is rounded too: every path, any number of rows, the same model
    from spire.drafts.spire import SpireConfig, SpireDraftModel
    from spire.fastpath import use_bf16_weights
    small = SpireDraftModel(tiny, SpireConfig(n_draft_layers=1, vocab_size=20), vocab=torch.arange(20) * 3)
    before = small.head().weight.clone()
    use_bf16_weights(small)
    head = small.head().weight
    assert torch.equal(head, before.bfloat16().float()) and not torch.equal(head, before)
    assert torch.equal(tiny.lm_head.weight[small.vocab], before)  # the target's head stays float32
    # no draft with weights of its own: nothing rounded, nothing priced at 2 bytes
    none = _tiny_bench_json(tmp_path / "none", capsys, "--no-spire", "--draft-weights", "bf16")
    assert none["draft_weight_bytes"] == 4 and [r["draft"] for r in none["rows"]] == ["magicdec", "ngram"]
    with pytest.raises(SystemExit) as e:  # Typer refuses a value outside the choices (its usage block, exit 2)
        main(["bench", "--random-weights", "--quick", "--draft-weights", "int4"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["bench", "--random-weights", "--quick", "--dtype", "bf16", "--draft-weights", "fp32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: --draft-weights applies to --dtype fp32")


def test_bench_cli_int8_draft_weights(tmp_path, monkeypatch, capsys, tiny):
    """`spire bench --draft-weights int8`: only the SPIRe draft's linear weights take their group-wise int8 values,
    SD stays identical to AD, the draft step is priced at 1 + 4/64 bytes per value and the run says int8; a
    draft vocabulary's head is priced at its own N rows; int8 is refused beside --dtype bf16."""
    from spire import kernels

    model, drafts, real_draft = _recording_bench(tmp_path, monkeypatch, tiny)
    out = _tiny_bench_json(tmp_path / "int8", capsys, "--draft-weights", "int8")
    assert out["draft_weight_bytes"] == 1.0625 and out["draft_weights"] == "int8" and out["weight_bytes"] == 4
    assert all(r["identical_to_ad"] for r in out["rows"])
    rows = {r["draft"]: r for r in out["rows"]}
    assert rows["magicdec"]["draft_weight_bytes"] == 4
    shape = pricing.draft_kind_and_shape(real_draft(drafts[-1]), tiny)[1]
    up = drafts[-1].layers[0].mlp.up_proj.weight
    assert torch.equal(up, kernels.dequantize_int8(*kernels.quantize_int8(up)))
    assert not torch.equal(up, tiny.layers[drafts[-1].source_layers[0]].mlp.up_proj.weight)
    assert torch.equal(model.layers[0].mlp.up_proj.weight, tiny.layers[0].mlp.up_proj.weight)  # target untouched
    assert "draft's own weights at 1.0625 bytes per value (int8)" in (tmp_path / "int8" / "BENCH.md").read_text()
    from spire.drafts.spire import SpireConfig, SpireDraftModel
    small = SpireDraftModel(tiny, SpireConfig(n_draft_layers=1, vocab_size=20), vocab=torch.arange(20) * 3)
    kind, small_shape, _, _ = pricing.draft_kind_and_shape(real_draft(small), tiny)
    assert (kind, small_shape.vocab_size, small_shape.n_layers) == ("spire", 20, 1)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--random-weights", "--quick", "--dtype", "bf16", "--draft-weights", "int8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: --draft-weights applies to --dtype fp32")
    # a full-vocabulary SPIRe draft's head is the target's unembedding: its draft step is priced at the mean
    # bytes of an int8 body and a float32 head
    body, head = shape.body_params(), shape.unembedding_params()
    assert shape.vocab_size == tiny.cfg.vocab_size
    assert rows["spire"]["draft_weight_bytes"] == pytest.approx((body * 1.0625 + head * 4) / (body + head))
    # without the kernels nothing streams fewer bytes: priced at 4, and said so
    monkeypatch.setattr(kernels, "available", lambda: False)
    plain = _tiny_bench_json(tmp_path / "nokernels", capsys, "--draft-weights", "int8")
    assert plain["draft_weight_bytes"] == 4 and all(r["identical_to_ad"] for r in plain["rows"])


def test_bench_json_names_the_drafts_dtype(tmp_path, monkeypatch, capsys, tiny):
    """--dtype bf16: every draft runs in bf16, and bench.json says so (it said fp32: --weights' default)."""
    _recording_bench(tmp_path, monkeypatch, tiny)
    out = _tiny_bench_json(tmp_path / "b", capsys, "--dtype", "bf16")
    assert out["draft_weights"] == "bf16" and out["dtype"] == "bf16"


def test_skinny_kernel_bf16_weights():
    """bf16 weights are widened exactly: the product equals float32 arithmetic on the bf16 values."""
    from spire import kernels

    if not kernels.available():
        pytest.skip(f"kernel unavailable: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(37, 72, generator=g).bfloat16(), torch.randn(5, 72, generator=g).bfloat16()]
    for M in (1, 2, 5, 32):
        x = torch.randn(M, 72, generator=g)
        ref = torch.cat([F.linear(x.double(), w.double()) for w in ws], -1).float()
        torch.testing.assert_close(kernels.skinny_linear(x, ws), ref, atol=1e-5, rtol=1e-5)
    x = torch.randn(3, 70, generator=g)  # scalar tail
    w = torch.randn(6, 70, generator=g).bfloat16()
    torch.testing.assert_close(kernels.skinny_linear(x, [w]), F.linear(x, w.float()), atol=1e-5, rtol=1e-5)
    assert kernels.skinny_linear(x, [w, w.float()]) is None  # mixed weight dtypes: caller falls back


def test_bf16_weights_model_is_the_rounded_model(tiny):
    """use_bf16_weights rounds every matmul weight to bf16 (and nothing else); decoding through the bf16
    kernel path equals the reference path on those rounded weights, and greedy SD stays identical to AD."""
    import copy

    from spire.drafts.magicdec import MagicDecDraft
    from spire.errors import ConfigError
    from spire.fastpath import use_bf16_weights
    from tests.oracle import generate

    model = copy.deepcopy(tiny)
    norm_before = model.layers[0].input_layernorm.weight.clone()
    n = use_bf16_weights(model)
    assert n == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer + the tied embedding / head
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            assert torch.equal(m.weight, m.weight.bfloat16().float())
    assert not torch.equal(model.layers[0].mlp.up_proj.weight, tiny.layers[0].mlp.up_proj.weight)
    assert torch.equal(model.layers[0].input_layernorm.weight, norm_before)  # norms stay float32
    ref = copy.deepcopy(model).requires_grad_(True)  # autograd -> plain F.linear on the same rounded weights
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    outs = []
    for m, grad in ((model, False), (ref, True)):
        cache = m.new_cache(2, 48)
        with torch.set_grad_enabled(grad):
            m(ids[:, :30], torch.arange(30)[None].expand(2, 30), cache)
            steps = [m(ids[:, 30 + t: 31 + t], torch.full((2, 1), 30 + t), cache).logits.detach() for t in range(3)]
            pos = torch.arange(33, 38)[None].expand(2, 5)
            steps.append(m(ids[:, 33:38], pos, cache).logits.detach())
        outs.append(torch.cat(steps, 1))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    from spire import backend, fastpath, kernels

    if kernels.available():  # the decode matmuls really streamed the bf16 copies
        layout = "PB" if backend.of(model).panel_kernel else "B"  # the packed bf16 copy, or the row-major one
        assert fastpath.weight_copies(model.layers[0].mlp)["gu"]._store[layout][1].dtype == torch.bfloat16
    prompts = ids[:, :20].tolist()
    ad = generate(model, prompts, 24)
    sd = generate(model, prompts, 24, draft=MagicDecDraft(1, 4), k=3)
    assert sd.tokens == ad.tokens
    with pytest.raises(ConfigError, match="float32 model on the CPU"):
        use_bf16_weights(copy.deepcopy(tiny).to(torch.bfloat16))


def test_rms_norm_kernel_matches_reference():
    import spire.model as model_mod
    from spire import kernels

    if not kernels.available():
        pytest.skip(f"kernel unavailable: {kernels.unavailable_reason()}")
    norm = model_mod.RMSNorm(70, 1e-5).requires_grad_(False)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 9, 70, generator=torch.Generator().manual_seed(1))[:, 2:7]  # strided rows, d % 8 != 0
    fast = norm(x)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    assert kernels.rms_norm(x.double(), norm.weight.double(), 1e-5) is None


def test_hf_compare_checks_lengths_before_running(tiny):
    """A prompt plus new tokens past the target's positions is one ConfigError before any model runs (the HF
    model is not even touched: None here)."""
    from spire.bench.hf_compare import HFCompareConfig, compare
    from spire.errors import ConfigError

    contexts = torch.zeros(1, 1000, dtype=torch.long)
    with pytest.raises(ConfigError, match="need 1069 positions; the target has 1024"):
        compare(tiny, None, contexts, HFCompareConfig(Bs=[1], L=1000, G=64, k=4))


def test_bench_contexts_total_tau_over_groups_of_contexts(tiny):
    """--contexts n: the SD and AD runs go over n groups of B contexts and τ is total tokens / total rounds,
    i.e. the same as the per-context runs added up (greedy decoding is deterministic); SD stays identical to
    AD in every group; the timed forwards are taken once; too few contexts is a ConfigError."""
    from tests.oracle import decode, prefill, start_draft

    draft = MagicDecDraft(1, 4)
    cfg = BenchConfig(Bs=[1], Ls=[12], k=3, G=6, reps=1, window=4, contexts=3)
    res = run_bench(tiny, _contexts, {"magicdec": draft}, cfg, hoi=5.0, flops_per_s=1e10, dtype_name="fp32")
    row = res["rows"][0]
    assert row["contexts"] == 3 and res["ad"][0]["contexts"] == 3 and row["identical_to_ad"]
    tokens = rounds = 0
    for ctx in _contexts(12, 3)[:, :12]:
        state = prefill(tiny, ctx[None], 12 + 6 + 4)
        cache = state.clone_cache()
        start_draft(draft, tiny, 3, cache, state)
        sd = decode(tiny, state, 6, draft, 3, cache=cache)
        tokens, rounds = tokens + sum(sd.emitted), rounds + sum(sd.rounds)
    assert tokens == 18 and row["tau"] == pytest.approx(tokens / rounds)
    with pytest.raises(ConfigError, match="contexts"):
        BenchConfig(contexts=0).validate()
    with pytest.raises(ConfigError, match="needed"):
        run_bench(tiny, lambda L, n: _contexts(L, n)[:2], {}, BenchConfig(Bs=[1], Ls=[12], G=4, reps=1, contexts=3))
