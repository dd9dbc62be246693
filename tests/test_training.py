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


def test_learning_rate_schedule_by_hand():
    """_lr_at: linear warmup over warmup_steps ((step + 1) / warmup), then cosine from lr down to 0.1 lr over
    the run's fraction frac (clipped at 1); worked by hand for lr 1e-3, warmup 4."""
    from spire.training.distill import _lr_at

    cfg = TrainConfig(lr=1e-3, warmup_steps=4)
    assert _lr_at(cfg, 0, 0.0) == pytest.approx(0.25e-3)  # 1/4 of the peak, cosine factor 1
    assert _lr_at(cfg, 2, 0.0) == pytest.approx(0.75e-3)
    assert _lr_at(cfg, 3, 0.0) == pytest.approx(1e-3)  # warmup done
    assert _lr_at(cfg, 10, 0.5) == pytest.approx(0.55e-3)  # 0.1 + 0.9 · (1 + cos(π/2)) / 2
    assert _lr_at(cfg, 10, 0.25) == pytest.approx(1e-3 * (0.1 + 0.45 * (1 + 0.5 ** 0.5)))  # cos(π/4) = √2/2
    assert _lr_at(cfg, 10, 1.0) == pytest.approx(0.1e-3) == _lr_at(cfg, 10, 3.0)  # the floor, and clipped
    assert _lr_at(cfg, 1, 0.5) == pytest.approx(0.5 * 0.55e-3)  # warmup and decay multiply
    assert _lr_at(TrainConfig(lr=2e-3, warmup_steps=0), 0, 0.0) == pytest.approx(2e-3)  # no warmup


def test_logged_learning_rates_follow_the_schedule(tmp_path):
    """A run of 5 steps (peak 3e-3, warmup 2) logs, at step s (1-based), lr = 3e-3 · min(1, s / 2) ·
    (0.1 + 0.45 · (1 + cos(π (s - 1) / 5))): the schedule runs over max_steps."""
    import json
    import math

    from tests.conftest import make_tiny
    from tests.train_worker import config

    train_spire(make_tiny(), RepeatingData(), tmp_path, config("spire", 5, 2), progress=False)
    logged = [json.loads(ln) for ln in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    lrs = {e["step"]: e["lr"] for e in logged if e["event"] == "train"}
    assert sorted(lrs) == [1, 2, 3, 4, 5]
    for s, lr in lrs.items():
        assert lr == pytest.approx(3e-3 * min(1, s / 2) * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - 1) / 5))))
