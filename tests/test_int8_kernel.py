"""Weight-only int8 for drafts (spire.kernels.quantize_int8 / pack_panels_int8, cpu_decode.c "int8 panel matmul",
spire.fastpath.use_int8_weights): the quantization and packed layout, the product against float64 within the
bound its int16 activation rounding allows, rows independent of the rest of the call, the native block and the
SPIRe draft against the float32 path over the same rounded weights, and speculative decoding with an int8 draft
giving the float32 target's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from spire import fastpath, kernels
from spire.errors import ConfigError
from tests.conftest import make_tiny
from tests.helpers import spire_rounds, with_backend

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")


def test_quantize_int8_groups_and_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 150, generator=g)
    w[1, 64:128] = 0.0  # an all-zero group
    q, s = kernels.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (5, 150) and s.shape == (5, 3)
    assert int(q.abs().max()) == 127
    for r, grp in [(0, 0), (3, 2), (4, 1)]:
        lo, hi = 64 * grp, min(150, 64 * grp + 64)
        assert torch.isclose(s[r, grp], w[r, lo:hi].abs().max() / 127)
    assert s[1, 1] == 1 and torch.all(q[1, 64:128] == 0)
    back = kernels.dequantize_int8(q, s)
    err = (back - w).abs() / s.repeat_interleave(64, 1)[:, :150]
    assert float(err.max()) <= 0.5 + 1e-5  # round to nearest: at most half a step
    assert torch.equal(kernels.quantize_int8(back)[0], q)  # quantizing the rounded weight again keeps the values
    with pytest.raises(ValueError, match="2-D float32"):
        kernels.quantize_int8(w.double())


def test_pack_panels_int8_layout():
    """K = 68 (two groups, the second partial), N = 40 (a partial second tile); an odd K is refused."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 68, generator=g)
    p = kernels.pack_panels_int8(w)
    q, s = kernels.quantize_int8(torch.cat([w, w.new_zeros(24, 68)]))
    assert p.dtype == torch.int8 and p.shape == (2, kernels.int8_tile_bytes(68)) == (2, 32 * 68 + 4 * 32 * 2)
    for t, panel, pair, c, e in [(0, 0, 0, 0, 0), (0, 3, 33, 7, 0), (1, 0, 10, 7, 1), (0, 2, 5, 3, 1)]:
        n, k = 32 * t + 8 * panel + c, 2 * pair + e
        assert p[t, (panel * 34 + pair) * 16 + 2 * c + e] == q[n, k]
    assert torch.all(p[1, : 32 * 68].reshape(4, 34, 8, 2)[1:] == 0)  # columns 40..63: padding
    scales = p[:, 32 * 68:].contiguous().view(torch.float32).reshape(2, 2, 32)  # [tile][group][column]
    assert torch.equal(scales.transpose(1, 2).reshape(64, 2), s)
    with pytest.raises(ValueError, match="even number of inputs"):
        kernels.pack_panels_int8(w[:, :67].contiguous())
    with pytest.raises(ValueError, match="2-D float32 CPU"):
        kernels.pack_panels_int8(w.bfloat16())


@pytest.mark.parametrize("N,K", [(3072, 576), (1000, 100), (40, 1536), (5, 4), (33, 66)])
def test_panel_linear_int8_matches_float64(N, K):
    """Against the float64 product with the dequantized weights: the int16 rounding of each activation group
    (half a step of max |x| / 32767) bounds the difference, plus float32 rounding of the per-group sums."""
    g = torch.Generator().manual_seed(N + K)
    w = kernels.dequantize_int8(*kernels.quantize_int8(torch.randn(N, K, generator=g)))
    p = kernels.pack_panels_int8(w)
    for M in (1, 2, 3, 4, 5, 9, 10, 33, 64):
        x = torch.randn(M, K, generator=g)
        x[0, :7] *= 50  # an outlier group
        y = kernels.panel_linear(x, p, N)
        ref = x.double() @ w.double().t()
        ng = -(-K // 64)
        xp = torch.cat([x, x.new_zeros(M, ng * 64 - K)], 1).reshape(M, ng, 64).abs().amax(-1)
        step = (xp / 32767).double().repeat_interleave(64, 1)[:, :K]  # each input's rounding step
        bound = 0.5 * step @ w.double().abs().t() + 1e-6 * (K ** 0.5 + 8) * (x.double().abs() @ w.double().abs().t())
        assert y.shape == (M, N) and y.dtype == torch.float32
        assert bool(((y.double() - ref).abs() <= bound * 1.01 + 1e-30).all()), M


def test_panel_linear_int8_rows_do_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(2)
    N, K = 1000, 576
    p = kernels.pack_panels_int8(torch.randn(N, K, generator=g))
    x = torch.randn(64, K, generator=g)
    alone = torch.cat([kernels.panel_linear(x[i:i + 1], p, N) for i in range(64)])
    for M in (2, 3, 5, 8, 12, 64):
        for lo in (0, 64 - M):
            assert torch.equal(kernels.panel_linear(x[lo:lo + M], p, N), alone[lo:lo + M]), (M, lo)
    assert kernels.panel_linear(x[:1], p, N + 32) is None  # packed shape does not match N
    assert kernels.panel_linear(x[:1, :574].contiguous(), p, N) is None  # nor K


def test_panel_linear_int8_refusals_and_non_finite_inputs():
    """A packed int8 weight with an odd K is refused (None, never an unwritten output); a NaN or inf activation
    gives NaN in every output its group reaches, not a finite number from a clamped integer."""
    assert kernels.panel_linear(torch.ones(1, 5), torch.zeros(1, kernels.int8_tile_bytes(5), dtype=torch.int8),
                                32) is None
    g = torch.Generator().manual_seed(3)
    p = kernels.pack_panels_int8(torch.randn(40, 128, generator=g))
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 128, generator=g)
        x[0, 70] = bad  # group 1 of row 0
        y = kernels.panel_linear(x, p, 40)
        assert bool(torch.isnan(y[0]).all()) and bool(torch.isfinite(y[1]).all())


def _tiny():
    return make_tiny(seed=5, d_model=48, n_heads=6, n_kv_heads=2, d_head=16, d_ff=80)


def test_use_int8_weights_rounds_linears_and_streams_int8(monkeypatch):
    """Every linear weight holds its int8 value (the tiny model's embedding is its tied head's); decode steps and a verify pass stream
    the packed int8 copies and give the float32 path's logits over the same rounded weights."""
    model, plain = _tiny(), _tiny()
    emb = model.model.embed_tokens.weight.clone()
    w0 = model.layers[0].mlp.down_proj.weight.clone()
    assert fastpath.use_int8_weights(model) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert fastpath.int8_weights(model) and not fastpath.int8_weights(plain)
    tied = model.model.embed_tokens.weight is model.lm_head.weight  # a tied head rounds its embedding too
    assert tied and torch.equal(model.model.embed_tokens.weight, kernels.dequantize_int8(*kernels.quantize_int8(emb)))
    assert torch.equal(model.layers[0].mlp.down_proj.weight, kernels.dequantize_int8(*kernels.quantize_int8(w0)))
    with torch.no_grad():
        for a, b in zip(plain.parameters(), model.parameters()):
            a.copy_(b)
    ids = torch.randint(0, 97, (2, 14), generator=torch.Generator().manual_seed(3))
    outs = []
    for m in (model, plain):
        cache = m.new_cache(2, 20)
        with torch.no_grad():
            m(ids[:, :6], torch.arange(6)[None].expand(2, 6), cache)
            a = m(ids[:, 6:7], torch.full((2, 1), 6), cache).logits
            b = m(ids[:, 7:12], torch.arange(7, 12)[None].expand(2, 5), cache).logits
        outs.append(torch.cat([a, b], 1))
    assert fastpath.native_blocks(model)[0][1]._keep[2].dtype == torch.int8
    # the int16 activations (2^-16 of each group's largest value) compound over 4 blocks: 1e-4 of the logit scale
    # measured; a wrong layout or scale is off by the logits' own size
    assert float((outs[0] - outs[1]).abs().max()) <= 3e-4 * float(outs[1].abs().max())
    with pytest.raises(ConfigError, match="float32 model on the CPU"):
        fastpath.use_int8_weights(_tiny().to(torch.bfloat16))
    with pytest.raises(ConfigError, match="even number of inputs"):
        fastpath.use_int8_weights(torch.nn.Linear(7, 4))


@pytest.mark.parametrize("vocab", [False, True])
def test_int8_spire_draft_is_lossless_and_matches_the_float32_path(vocab, monkeypatch):
    """A SPIRe draft with int8 weights (and its vocabulary head rounded the same way): its step logits and ring
    cache equal, to the activation rounding, the float32 row-major path over the same weights, and greedy SD
    with it gives the float32 target's AD tokens."""
    from spire.drafts.spire import SpireConfig, SpireDraftModel
    from tests.oracle import generate

    prompts = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(12)).tolist()
    prompts[0] = prompts[0][:13]
    runs = []
    for panel in (True, False):
        target = _tiny()
        torch.manual_seed(11)
        ids = torch.arange(0, 97, 2) if vocab else None
        model = SpireDraftModel(target, SpireConfig(n_draft_layers=2, sink=1, window=5,
                                                    vocab_size=None if ids is None else len(ids)), vocab=ids)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        fastpath.use_int8_weights(model)
        with_backend(monkeypatch, target, model, panel_kernel=panel)
        if vocab:
            rows = target.lm_head.weight[ids]
            assert torch.equal(model.head().weight, kernels.dequantize_int8(*kernels.quantize_int8(rows)))
        res, logits, cache = spire_rounds(target, model, prompts)
        assert fastpath.native_blocks(model), "the native block did not run"
        runs.append((res.tokens, generate(target, prompts, 24).tokens, logits, cache))
    assert runs[0][0] == runs[0][1] == runs[1][0] == runs[1][1]
    finite = torch.isfinite(runs[1][2])
    assert torch.equal(finite, torch.isfinite(runs[0][2]))  # q = 0 outside the draft vocabulary on both paths
    for a, b in ((runs[0][2][finite], runs[1][2][finite]), (runs[0][3], runs[1][3])):
        assert float((a - b).abs().max()) <= 3e-4 * float(b.abs().max())


def test_draft_weights_benchmark_runs_and_reports_every_format(tmp_path):
    """benchmarks/draft_weights.py at tiny shapes: one row per M with all three formats and their ratios."""
    import json
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "draft_weights.py"
    main = runpy.run_path(str(script))["main"]
    out = tmp_path / "dw.json"
    assert main(["--rows", "1,3", "--repeats", "3", "--layers", "2", "--d-model", "64", "--d-ff", "96",
                 "--heads", "2,1,32", "--vocab", "100", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["M"] for r in res["rows"]] == [1, 3]
    assert res["bytes"]["fp32"] == 4 * (2 * (128 * 64 + 64 * 64 + 192 * 64 + 64 * 96) + 128 * 64)  # 100 -> 128 rows
    assert all(r["int8_ms"] > 0 and r["bf16_over_int8"] > 0 for r in res["rows"])
    assert main(["--d-ff", "95"]) == 2
