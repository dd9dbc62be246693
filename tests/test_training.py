"""Distillation of a SPIRe draft: losses, learning, resumable runs."""

import pytest
import torch

from spire.drafts.spire import SpireConfig
from spire.errors import ConfigError
from spire.training.distill import TrainConfig, evaluate_alpha, load_state, train_spire
from spire.training.losses import acceptance_alpha, mixed_loss
from tests.train_worker import RepeatingData


def test_mixed_loss_values():
    p_logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    q_logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    terms = mixed_loss(q_logits, p_logits, omega=0.5)
    ce = -(0.5 * torch.log(torch.tensor(0.6)) + 0.3 * torch.log(torch.tensor(0.3)) + 0.2 * torch.log(torch.tensor(0.1)))
    assert terms.alpha == pytest.approx(0.9, abs=1e-6)  # 0.5 + 0.3 + 0.1
    assert terms.distill == pytest.approx(float(ce), abs=1e-5)
    assert terms.loss.item() == pytest.approx(0.5 * float(ce) - 0.5 * 0.9, abs=1e-5)
    assert acceptance_alpha(q_logits, p_logits).item() == pytest.approx(0.9, abs=1e-6)


def test_training_raises_alpha_and_resumes(tmp_path, tiny):
    data = RepeatingData()
    cfg = TrainConfig(budget_s=600.0, max_steps=30, batch_size=4, seq_len=32, k=4, lr=3e-3, bf16=False,
                      checkpoint_every=0.5, spire=SpireConfig(n_draft_layers=2, window=8))
    windows = data.seqs
    from spire.drafts.spire import SpireDraftModel

    before = evaluate_alpha(SpireDraftModel(tiny, cfg.spire), tiny, windows, 4)
    model, state = train_spire(tiny, data, tmp_path, cfg, progress=False)
    after = evaluate_alpha(model, tiny, windows, 4)
    assert state["finished"] and state["step"] == 30
    assert sum(after) / 4 > sum(before) / 4 + 0.05, (before, after)
    # a finished run is reused as it is
    again, state2 = train_spire(tiny, data, tmp_path, cfg, progress=False)
    assert state2["step"] == state["step"]
    # a larger budget resumes from the saved step
    cfg.max_steps = 36
    _, state3 = train_spire(tiny, data, tmp_path, cfg, progress=False)
    assert state3["step"] == 36 and load_state(tmp_path)["step"] == 36
    # other settings in the same folder are refused
    cfg.lr = 1e-4
    with pytest.raises(ConfigError, match="other settings"):
        train_spire(tiny, data, tmp_path, cfg, progress=False)


def test_bad_training_settings(tiny, tmp_path):
    for bad in (dict(budget_s=0), dict(seq_len=30, k=4), dict(omega=2.0)):
        with pytest.raises(ConfigError):
            train_spire(tiny, RepeatingData(), tmp_path, TrainConfig(**bad), progress=False)
