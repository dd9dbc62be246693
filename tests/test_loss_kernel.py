"""The native MixedLoss row kernel (spire.kernels.mixed_loss_rows) against the torch implementation, and a
guard that the kernel library builds wherever it can (a C file that fails to compile would otherwise turn every
kernel test into a skip)."""

import os
import shutil

import pytest
import torch

from spire import kernels
from spire.training import losses


def test_kernels_build_where_a_compiler_and_avx2_exist():
    if os.environ.get("SPIRE_KERNELS", "1") in ("0", "off", "false", "no"):
        pytest.skip("kernels disabled by SPIRE_KERNELS")
    if not (shutil.which("cc") or shutil.which("gcc") or os.environ.get("CC")):
        pytest.skip("no C compiler")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2")
    assert kernels.available(), kernels.unavailable_reason()


def _both(z, logp, omega):
    assert kernels.mixed_loss_rows(z, logp, omega) is not None  # the kernel applies to these inputs
    out = {}
    for flag in (True, False):
        zz = z.clone().requires_grad_(True)
        terms = losses.mixed_loss_logp(zz, logp, omega, kernel=flag)
        (terms.loss * 3.0).backward()  # an upstream gradient other than 1
        out[flag] = (terms, zz.grad)
    return out


@pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")
@pytest.mark.parametrize("n, N", [(1, 1), (3, 7), (5, 8), (17, 1000), (64, 16384)])
@pytest.mark.parametrize("omega", [0.0, 0.5, 1.0])
def test_mixed_loss_kernel_equals_torch(n, N, omega):
    g = torch.Generator().manual_seed(n * 1000 + N)
    z = torch.randn(n, N, generator=g) * 4
    logp = torch.log_softmax(torch.randn(n, N + 5, generator=g) * 4, -1)[:, :N].contiguous()  # sums to < 1
    logp[0, 0] = -200.0  # far below exp's float range: p = 0
    out = _both(z, logp, omega)
    (tk, gk), (tt, gt) = out[True], out[False]
    assert tk.distill == pytest.approx(tt.distill, rel=1e-5, abs=1e-6)
    assert tk.alpha == pytest.approx(tt.alpha, rel=1e-5, abs=1e-7)
    assert float(tk.loss) == pytest.approx(float(tt.loss), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(gk, gt, rtol=1e-4, atol=1e-6 * float(gt.abs().max()) + 1e-12)


@pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")
def test_mixed_loss_kernel_ties_and_the_reference():
    """A draft equal to the target (q = p up to the kernel's own exp): alpha = 1 and the same loss as torch's;
    where q and p tie only to rounding the kernel takes one of min's one-sided derivatives (both valid), so the
    gradient is checked by what holds either way: every row's sums to 0 (softmax). Then the kernel against the
    autograd reference of the trainer's loss."""
    logp = torch.log_softmax(torch.randn(6, 40, generator=torch.Generator().manual_seed(1)), -1)
    out = _both(logp.clone(), logp, 0.5)
    (tk, gk), (tt, gt) = out[True], out[False]
    assert tk.alpha == pytest.approx(1.0, abs=1e-5) and tk.alpha == pytest.approx(tt.alpha, abs=1e-6)
    assert tk.distill == pytest.approx(tt.distill, rel=1e-6)
    assert torch.isfinite(gk).all() and float(gk.sum(-1).abs().max()) < 1e-6
    z = torch.randn(9, 333, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    target = (logp[:1, :1].expand(9, 333) - 6.0).contiguous()
    ref = losses.mixed_loss_logp_reference(z, target, 0.5)
    ref.loss.backward()
    zz = z.detach().clone().requires_grad_(True)
    fused = losses.mixed_loss_logp(zz, target, 0.5)
    fused.loss.backward()
    assert fused.distill == pytest.approx(ref.distill, rel=1e-5)
    torch.testing.assert_close(zz.grad, z.grad, rtol=1e-4, atol=1e-7)


def test_mixed_loss_kernel_refuses_what_it_does_not_handle():
    z = torch.randn(4, 8)
    assert kernels.mixed_loss_rows(z.double(), z.double(), 0.5) is None
    assert kernels.mixed_loss_rows(z, z[:, :4], 0.5) is None
    assert kernels.mixed_loss_rows(z.t(), z.t(), 0.5) is None  # not contiguous
    assert kernels.mixed_loss_rows(z[None], z[None], 0.5) is None


@pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")
def test_mixed_loss_kernel_sums_hold_at_a_full_vocabulary():
    """Over a 49,152-token row (SmolLM2's whole vocabulary) the row sums keep float64-level digits (float32
    lanes flushed into doubles): distill and alpha within 2e-6 of a float64 computation; and the loss-only
    call (no_grad, evaluation) gives the same values without a gradient."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 49152, generator=g) * 3
    logp = torch.log_softmax(torch.randn(4, 49152, generator=g) * 3, -1)
    z64, p64 = z.double(), logp.double().exp()
    q64 = torch.softmax(z64, -1)
    distill64 = float(-(p64 * torch.log_softmax(z64, -1)).sum(-1).mean())
    alpha64 = float(torch.minimum(p64, q64).sum(-1).mean())
    terms = losses.mixed_loss_logp(z.clone().requires_grad_(True), logp, 0.5)
    assert terms.distill == pytest.approx(distill64, rel=2e-6) and terms.alpha == pytest.approx(alpha64, rel=2e-6)
    with torch.no_grad():
        again = losses.mixed_loss_logp(z, logp, 0.5)
    assert (again.distill, again.alpha) == (terms.distill, terms.alpha)
    grad, d_rows, a_rows = kernels.mixed_loss_rows(z, logp, 0.5, grad=False)
    assert grad is None and float(d_rows.mean()) == pytest.approx(distill64, rel=2e-6)


def test_teacher_head_rows_are_gathered_once_per_weight_version():
    from spire.training.sources import vocab_rows

    from tests.conftest import make_tiny

    target, ids = make_tiny(), torch.tensor([3, 1, 4, 9])
    w = target.lm_head.weight
    first = vocab_rows(target, ids)
    assert torch.equal(first, w[ids]) and vocab_rows(target, ids) is first
    with torch.no_grad():
        w.mul_(2.0)  # an in-place change (a load, bf16 rounding) bumps the version: gathered anew
    assert torch.equal(vocab_rows(target, ids), w[ids])
    other = torch.tensor([0, 2])
    assert torch.equal(vocab_rows(target, other), w[other])
    assert vocab_rows(make_tiny(seed=1), other) is not vocab_rows(target, other)  # kept per target
