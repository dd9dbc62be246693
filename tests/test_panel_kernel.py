"""The panel matmul (spire.kernels.pack_panels / panel_linear, cpu_decode.c "Panel matmul") and its use by the
decode path (spire.backend.Backend.panel_kernel): the product against float64, the packed layout, bit-identical rows
whatever else shares the call, and the same logits, caches and greedy tokens as the row-major kernels."""

from __future__ import annotations

import pytest
import torch

from spire import fastpath, kernels
from tests.conftest import make_tiny
from tests.helpers import spire_rounds, with_backend

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")


def test_pack_panels_layout_and_padding():
    w = torch.randn(70, 9)
    p = kernels.pack_panels(w)
    assert p.shape == (3, 4, 9, 8) and p.is_contiguous()
    for q, s, k, c in [(0, 0, 0, 0), (0, 3, 8, 7), (1, 2, 4, 5), (2, 0, 3, 5)]:
        assert p[q, s, k, c] == w[32 * q + 8 * s + c, k]
    assert torch.all(p[2, 0, :, 6:] == 0) and torch.all(p[2, 1:] == 0)  # rows 70..95: padding
    assert kernels.pack_panels(w.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="2-D float32 or bfloat16"):
        kernels.pack_panels(w.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(3072, 576), (1000, 100), (40, 1536), (5, 3)])
def test_panel_linear_matches_float64(dtype, N, K):
    """Ragged N (a partial last tile), K not a multiple of the 64-step blocks, M from 1 to 64 (chunks of 3
    rows, the bf16 widening above 9 rows): within float32 rounding of the float64 product with the same
    weight values."""
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).to(dtype)
    p = kernels.pack_panels(w)
    for M in (1, 2, 3, 4, 5, 7, 9, 10, 33, 64):
        x = torch.randn(M, K, generator=g)
        y = kernels.panel_linear(x, p, N)
        ref = x.double() @ w.double().t()
        assert y.shape == (M, N) and y.dtype == torch.float32
        err = ((y.double() - ref).abs() / (x.double().abs() @ w.double().abs().t())).max().item()
        assert err < 1e-6 * (K ** 0.5 + 8), (M, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_rows_do_not_depend_on_the_other_rows(dtype):
    """Each output is summed in one order whatever M: every row of a call with M rows equals, bit for bit,
    the same row computed alone (so a verify pass over k + 1 rows gives the AD step's matmul results)."""
    g = torch.Generator().manual_seed(1)
    N, K = 1000, 576
    w = torch.randn(N, K, generator=g).to(dtype)
    p = kernels.pack_panels(w)
    x = torch.randn(64, K, generator=g)
    alone = torch.cat([kernels.panel_linear(x[i:i + 1], p, N) for i in range(64)])
    for M in (2, 3, 5, 8, 12, 64):
        for lo in (0, 64 - M):
            assert torch.equal(kernels.panel_linear(x[lo:lo + M], p, N), alone[lo:lo + M]), (M, lo)
    xs = torch.randn(5, 2 * K, generator=g)[:, ::2]  # strided rows: not taken
    assert kernels.panel_linear(xs, p, N) is None
    assert kernels.panel_linear(x[:1], p, N + 32) is None  # packed shape does not match N
    assert kernels.panel_linear(torch.randn(65, K), p, N) is None  # more rows than MAX_ROWS
    assert kernels.panel_linear(torch.randn(2, 0), kernels.pack_panels(torch.randn(40, 0)), 40) is None  # K = 0


def _target(heads, bf16):
    H, KV, D = heads
    model = make_tiny(seed=5, d_model=48, n_heads=H, n_kv_heads=KV, d_head=D, d_ff=80)
    if bf16:
        fastpath.use_bf16_weights(model)
    return model


def _layouts(module) -> set[str]:
    return {k for wc in fastpath.weight_copies(module).values() for k in wc._store}


@pytest.mark.parametrize("heads", [(6, 2, 16), (3, 1, 16)])
@pytest.mark.parametrize("bf16", [False, True])
def test_decode_path_with_panels_equals_row_major(heads, bf16, monkeypatch):
    """A decode step and a 5-row verify pass through packed weights give the row-major kernels' logits and
    cache to float32 rounding, and greedy decoding the same tokens (d = 48 and d_ff = 80: ragged tiles)."""
    from tests.oracle import generate

    prompts = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(4)).tolist()
    prompts[1] = prompts[1][:12]
    ids = torch.tensor([prompts[0][:12], prompts[2][:12]])
    runs = []
    for panel in (True, False):
        model = _target(heads, bf16)
        with_backend(monkeypatch, model, panel_kernel=panel)
        res = generate(model, prompts, 20)
        cache = model.new_cache(2, 40)
        with torch.no_grad():
            model(ids[:, :6], torch.arange(6)[None].expand(2, 6), cache)
            a = model(ids[:, 6:7], torch.full((2, 1), 6), cache).logits
            b = model(ids[:, 7:12], torch.arange(7, 12)[None].expand(2, 5), cache).logits
        assert (("PB" if bf16 else "P") in _layouts(model.layers[0].mlp)) == panel
        assert fastpath.native_blocks(model), "the native block did not run"
        runs.append((res.tokens, torch.cat([a, b], 1), torch.stack([cache.k[0][:, :, :12], cache.v[0][:, :, :12]])))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runs[0][2], runs[1][2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(6, 2, 16), (3, 1, 16)])
def test_spire_draft_memory_writes_with_panels_equal_row_major(heads, monkeypatch):
    """The SPIRe draft's steps and memory writes (DecodeBlock.write_kv, which multiplies by the k/v rows of the
    packed q/k/v weight only) give the row-major kernels' draft logits and ring cache, round after round, and
    greedy SD with it equals AD. H D = 48 (3 heads of 16) is not a multiple of the 32-column tiles: the memory
    write then computes the whole q/k/v product."""
    from spire.drafts.spire import SpireConfig, SpireDraftModel
    from tests.oracle import generate

    prompts = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(12)).tolist()
    prompts[0] = prompts[0][:13]
    runs = []
    for panel in (True, False):
        target = _target(heads, False)
        torch.manual_seed(11)
        model = SpireDraftModel(target, SpireConfig(n_draft_layers=2, sink=1, window=5))
        with_backend(monkeypatch, target, model, panel_kernel=panel)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        res, logits, cache = spire_rounds(target, model, prompts)
        assert fastpath.native_blocks(model), "the native block did not run"
        assert ("P" in _layouts(model.layers[0].self_attn)) == panel
        runs.append((res.tokens, generate(target, prompts, 24).tokens, logits, cache))
    assert runs[0][0] == runs[0][1] == runs[1][0] == runs[1][1]
    # the two layouts sum in different orders and the draft feeds its rounding back round after round: on an
    # AVX-512 machine one logit of 16,296 moved 1.5e-5 (4.4e-5 relative); rows read wrongly move them by O(1)
    torch.testing.assert_close(runs[0][2], runs[1][2], atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(runs[0][3], runs[1][3], atol=5e-5, rtol=5e-5)
