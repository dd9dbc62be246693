"""The few-row matmul of spire.kernels (cpu_decode.c) against torch, for M = 1..8 activation rows (a decode
step, a verify pass over k + 1 = 5 rows, B = 8 decode) and beyond, float32 and bf16 weights, at SmolLM2-135M's
shapes (fused q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536, a 1024-row slice of the
unembedding) and at odd sizes (K not a multiple of 16 or 8, N not a multiple of the tile), through the AVX-512
path where the CPU has it and through the AVX2 path."""

from __future__ import annotations

import pytest
import torch

from spire import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")

SMOL = [(960, 576), (576, 576), (3072, 576), (576, 1536), (1024, 576)]
ODD = [(1, 7), (5, 13), (7, 17), (13, 33), (25, 100), (9, 250)]


@pytest.fixture(params=["avx512", "avx2"])
def path(request):
    want = request.param == "avx512"
    got = kernels.set_avx512(want)
    if want and not got:
        pytest.skip("CPU without AVX-512F/BW/VL/DQ")
    yield request.param
    kernels.set_avx512(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_few_rows_match_torch(path, dtype, M):
    g = torch.Generator().manual_seed(M)
    for N, K in SMOL + ODD:
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
        x = torch.randn(M, K, generator=g)
        y = kernels.skinny_linear(x, [w])
        ref = x.double() @ w.double().t()
        assert y is not None and y.shape == (M, N)
        torch.testing.assert_close(y.double(), ref, atol=2e-5 * K ** 0.5 / 24, rtol=1e-5, msg=f"{path} {N}x{K}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [3, 5, 8])
def test_few_rows_several_weights_and_strided_rows(path, dtype, M):
    """Several weights concatenated (the fused q/k/v call) and activation rows at a row stride > K."""
    g = torch.Generator().manual_seed(7)
    K = 576
    ws = [(torch.randn(n, K, generator=g) / K ** 0.5).to(dtype) for n in (576, 190, 190, 3)]
    base = torch.randn(M, K + 40, generator=g)
    x = base[:, 8: 8 + K]
    y = kernels.skinny_linear(x, ws)
    ref = torch.cat([x.double() @ w.double().t() for w in ws], -1)
    torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=1e-5)


def test_paths_agree_to_float32_rounding():
    """The AVX-512 and AVX2 paths compute the same product (different summation order)."""
    if not kernels.set_avx512(True):
        pytest.skip("CPU without AVX-512F/BW/VL/DQ")
    try:
        g = torch.Generator().manual_seed(3)
        w = torch.randn(3072, 576, generator=g) / 24
        x = torch.randn(5, 576, generator=g)
        a = kernels.skinny_linear(x, [w])
        kernels.set_avx512(False)
        b = kernels.skinny_linear(x, [w])
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    finally:
        kernels.set_avx512(True)
