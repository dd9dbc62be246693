"""The negative log-acceptance loss (LK^α, arXiv 2602.23881), spire train --loss lk (issue 53, item 7)."""

import math

import pytest
import torch

from spire.training.losses import log_acceptance_loss_logp


def test_value_gradient_and_one_hot_limit():
    """Hand-computed value: p = (0.5, 0.3, 0.2), q = softmax(0, log 2, 0) = (0.25, 0.5, 0.25):
    α = 0.25 + 0.3 + 0.2 = 0.75, loss = −log 0.75; its gradient equals −(1/α)·∇α computed by autograd on α; at a
    one-hot p the loss is the cross-entropy of q at that token; at p = q it is 0."""
    p = torch.tensor([[0.5, 0.3, 0.2]])
    z = torch.tensor([[0.0, math.log(2.0), 0.0]], requires_grad=True)
    terms = log_acceptance_loss_logp(z, p.log())
    assert terms.loss.item() == pytest.approx(-math.log(0.75), abs=1e-6) and terms.alpha == pytest.approx(0.75)
    assert terms.distill == pytest.approx(-(0.5 * math.log(0.25) + 0.3 * math.log(0.5) + 0.2 * math.log(0.25)))
    terms.loss.backward()
    z2 = z.detach().clone().requires_grad_(True)
    alpha = torch.minimum(p, torch.softmax(z2, -1)).sum()
    alpha.backward()
    assert torch.allclose(z.grad, -z2.grad / 0.75, atol=1e-6)
    onehot = torch.tensor([[1e-30, 1.0, 1e-30]]).log()
    assert float(log_acceptance_loss_logp(z.detach(), onehot).loss) == pytest.approx(-math.log(0.5), abs=1e-6)
    same = torch.randn(4, 7)
    assert float(log_acceptance_loss_logp(same, same.log_softmax(-1)).loss) == pytest.approx(0.0, abs=1e-6)
    # no overlap: finite (α floored at 1e-8)
    far = log_acceptance_loss_logp(torch.tensor([[50.0, -50.0]]), torch.tensor([[-1e4, 0.0]]))
    assert math.isfinite(float(far.loss)) and float(far.loss) == pytest.approx(-math.log(1e-8), rel=1e-3)


def test_step_loss_uses_it(tiny):
    """TrainConfig(loss="lk") trains SPIRe on it: step_loss's value equals the loss on the same logits."""
    import numpy as np
    import types

    from spire.drafts.spire import SpireConfig
    from spire.training.distill import TrainConfig, _build_model, step_loss
    from spire.training.sources import run_target

    tc = TrainConfig(batch_size=2, seq_len=16, bf16=False, loss="lk", draft_config=SpireConfig(n_draft_layers=2))
    data = types.SimpleNamespace(train=types.SimpleNamespace(tokens=np.arange(97)))
    model = _build_model(tiny, tc, data)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    tb = run_target(tiny, tokens, model.target_layers(), True, False)
    loss, alpha = step_loss(model, tiny, tb, tc)
    want = log_acceptance_loss_logp(model.train_logits(tokens, tb.hidden, tc.k), tb.target_logp(tiny, model.vocab))
    assert loss.item() == pytest.approx(want.loss.item(), rel=1e-5) and alpha == pytest.approx(want.alpha, rel=1e-5)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
