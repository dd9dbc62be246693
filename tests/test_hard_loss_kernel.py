"""HardTargetLoss through the native cross-entropy row kernel: equal to torch's F.cross_entropy (loss and
gradient), ignored rows, the fallback, and the vanilla trainer's step."""

import pytest
import torch
import torch.nn.functional as F

from spire import kernels
from spire.training import losses
from spire.training.losses import hard_target_loss

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="native kernels unavailable (no AVX2 or compiler)")


@needs_kernels
@pytest.mark.parametrize("N", [1, 7, 8, 1000, 49152])
def test_cross_entropy_kernel_equals_torch(N):
    g = torch.Generator().manual_seed(N)
    z = (torch.randn(37, N, generator=g) * 4).requires_grad_()
    y = torch.randint(0, N, (37,), generator=g)
    y[[3, 10]] = -100  # ignored, as a draft vocabulary marks tokens outside it
    up = torch.tensor(0.7)
    ref = F.cross_entropy(z, y)
    (ref_grad,) = torch.autograd.grad(ref, z, up)
    got = hard_target_loss(z, y)
    (grad,) = torch.autograd.grad(got, z, up)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=2e-7)
    assert torch.equal(grad[[3, 10]], torch.zeros(2, N))


@needs_kernels
def test_cross_entropy_kernel_rows_and_refusals():
    z = torch.tensor([[0.0, 0.0], [1.0, 3.0]])
    grad, loss = kernels.cross_entropy_rows(z, torch.tensor([1, -100]))
    torch.testing.assert_close(loss, torch.tensor([0.6931471805599453, 0.0], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    assert kernels.cross_entropy_rows(z, torch.tensor([2, 0])) is None  # a column outside: torch raises
    assert kernels.cross_entropy_rows(z.double(), torch.tensor([1, 0])) is None
    assert kernels.cross_entropy_rows(z.t(), torch.tensor([1, 0])) is None  # not contiguous
    with pytest.raises((IndexError, RuntimeError)):
        hard_target_loss(z, torch.tensor([2, 0]))


def test_all_rows_ignored_gives_zero_not_torchs_nan(monkeypatch):
    """A batch without any valid target contributes zero (issue 52; F.cross_entropy gives NaN, which stopped the
    run as a non-finite loss)."""
    z = torch.randn(4, 9, requires_grad=True)
    y = torch.full((4,), -100)
    assert float(hard_target_loss(z, y).detach()) == 0.0 and torch.isnan(F.cross_entropy(z, y))


def test_kernel_off_is_torch(monkeypatch):
    z = torch.randn(5, 11, requires_grad=True)
    y = torch.tensor([1, 2, -100, 4, 10])
    assert torch.equal(hard_target_loss(z, y, kernel=False), F.cross_entropy(z, y))


@needs_kernels
def test_nan_logits_and_all_ignored_rows_behave_as_torch():
    """A NaN logit makes the loss NaN (the trainer's non-finite guard must fire; exp of NaN in the polynomial was
    a huge finite number); every row ignored gives a zero loss and a zero gradient."""
    for N in (16, 13):
        z = torch.randn(2, N)
        z[0, 3] = float("nan")
        zz = z.clone().requires_grad_()
        loss = hard_target_loss(zz, torch.tensor([1, 2]))
        assert torch.isnan(loss) and torch.isnan(F.cross_entropy(z, torch.tensor([1, 2])))
        loss.backward()
        assert torch.isnan(zz.grad[0]).all()
    z = torch.randn(3, 9, requires_grad=True)
    hard_target_loss(z, torch.full((3,), -100)).backward()
    assert torch.equal(z.grad, torch.zeros(3, 9))
