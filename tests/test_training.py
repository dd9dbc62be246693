"""Distillation of a SPIRe draft: losses, learning, resumable runs."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from spire.drafts.spire import SpireConfig
from spire.errors import ConfigError
from spire.training.distill import TrainConfig, evaluate_heldout, load_state, train_draft
from spire.training.losses import acceptance_alpha_logp
from tests.helpers import mixed_loss, with_backend
from tests.train_worker import RepeatingData


@torch.no_grad()
def acceptance_alpha(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """sum_i min(p_i, q_i) per position: (..., V) -> (...). Expected acceptance at temperature 1."""
    return acceptance_alpha_logp(draft_logits, F.log_softmax(target_logits.float(), -1))


@torch.no_grad()
def evaluate_alpha(model, target, windows: torch.Tensor, k: int, bf16: bool = False,
                   batch_size: int = 4) -> list[float]:
    """Expected acceptance alpha = E[sum min(p, q)] per drafted position j = 1..k on held-out windows.

    windows: (N, T) token ids with T a multiple of k. Returns k floats (position 1 = first drafted token).
    """
    cfg = TrainConfig(k=k, bf16=bf16, seq_len=windows.shape[1] - windows.shape[1] % k or k)
    return evaluate_heldout(model, target, windows, cfg, batch_size)["alpha_per_position"]


def test_mixed_loss_values():
    p_logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    q_logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    terms = mixed_loss(q_logits, p_logits, omega=0.5)
    ce = -(0.5 * torch.log(torch.tensor(0.6)) + 0.3 * torch.log(torch.tensor(0.3)) + 0.2 * torch.log(torch.tensor(0.1)))
    assert terms.alpha == pytest.approx(0.9, abs=1e-6)  # 0.5 + 0.3 + 0.1
    assert terms.distill == pytest.approx(float(ce), abs=1e-5)
    assert terms.loss.item() == pytest.approx(0.5 * float(ce) - 0.5 * 0.9, abs=1e-5)
    assert acceptance_alpha(q_logits, p_logits).item() == pytest.approx(0.9, abs=1e-6)


@pytest.mark.slow
def test_training_raises_alpha_and_resumes(tmp_path, tiny):
    data = RepeatingData()
    cfg = TrainConfig(budget_s=600.0, max_steps=30, batch_size=4, seq_len=32, k=4, lr=3e-3, bf16=False,
                      checkpoint_every=0.5, draft_config=SpireConfig(n_draft_layers=2, window=8))
    windows = data.seqs
    from spire.drafts.spire import SpireDraftModel

    before = evaluate_alpha(SpireDraftModel(tiny, cfg.draft_config), tiny, windows, 4)
    model, state = train_draft(tiny, data, tmp_path, cfg, progress=False)
    after = evaluate_alpha(model, tiny, windows, 4)
    assert state["finished"] and state["step"] == 30
    assert sum(after) / 4 > sum(before) / 4 + 0.05, (before, after)
    # a finished run is reused as it is
    again, state2 = train_draft(tiny, data, tmp_path, cfg, progress=False)
    assert state2["step"] == state["step"]
    # a larger budget resumes from the saved step
    cfg.max_steps = 36
    _, state3 = train_draft(tiny, data, tmp_path, cfg, progress=False)
    assert state3["step"] == 36 and load_state(tmp_path)["step"] == 36
    # other settings in the same folder are refused
    cfg.lr = 1e-4
    with pytest.raises(ConfigError, match="other settings"):
        train_draft(tiny, data, tmp_path, cfg, progress=False)


def test_bad_training_settings(tiny, tmp_path):
    for bad in (dict(budget_s=0), dict(seq_len=30, k=4), dict(omega=2.0)):
        with pytest.raises(ConfigError):
            train_draft(tiny, RepeatingData(), tmp_path, TrainConfig(**bad), progress=False)


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

    train_draft(make_tiny(), RepeatingData(), tmp_path, config("spire", 5, 2), progress=False)
    logged = [json.loads(ln) for ln in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    lrs = {e["step"]: e["lr"] for e in logged if e["event"] == "train"}
    assert sorted(lrs) == [1, 2, 3, 4, 5]
    for s, lr in lrs.items():
        assert lr == pytest.approx(3e-3 * min(1, s / 2) * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - 1) / 5))))


@pytest.mark.parametrize("omega", [0.5, 1.0, 0.0])
def test_fused_mixed_loss_equals_autograd(omega, monkeypatch):
    """The hand-written gradient of MixedLoss equals autograd's on the reference formula, with p normalized
    over a larger vocabulary than the draft's (Σ p < 1, as with a draft vocabulary) and with exact ties
    p_i = q_i (torch.minimum's gradient gives each side half there). The torch implementation: the native row
    kernel computes q with its own exp, so a tie is not exact there (tests/test_loss_kernel.py)."""
    import torch.nn.functional as F

    from spire.training.losses import mixed_loss_logp, mixed_loss_logp_reference

    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 40, generator=g, dtype=torch.float64) * 2
    logp = F.log_softmax(torch.randn(3, 5, 50, generator=g, dtype=torch.float64) * 2, -1)[..., :40]
    logp[0, 0] = F.log_softmax(z[0, 0], -1)  # a row where p = q everywhere: every entry a tie
    grads, terms = [], []
    for fn in (partial(mixed_loss_logp, kernel=False), mixed_loss_logp_reference):
        zz = z.clone().float().double().requires_grad_()
        t = fn(zz.float(), logp.float(), omega)
        t.loss.backward()
        grads.append(zz.grad)
        terms.append(t)
    assert terms[0].loss.item() == pytest.approx(terms[1].loss.item(), rel=1e-6, abs=1e-7)
    assert terms[0].alpha == pytest.approx(terms[1].alpha, rel=1e-6)
    assert terms[0].distill == pytest.approx(terms[1].distill, rel=1e-6)
    scale = float(grads[1].abs().max())
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5 * scale), (grads[0] - grads[1]).abs().max()
    # and the values by hand on the first test's numbers
    p_logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    q_logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).requires_grad_()
    t = mixed_loss_logp(q_logits, p_logits, omega)
    ce = -(0.5 * torch.log(torch.tensor(0.6)) + 0.3 * torch.log(torch.tensor(0.3)) + 0.2 * torch.log(torch.tensor(0.1)))
    assert t.alpha == pytest.approx(0.9, abs=1e-6) and t.distill == pytest.approx(float(ce), abs=1e-5)
    t.loss.backward()
    q, p = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.5, 0.3, 0.2])
    m = torch.tensor([0.0, 0.5, 1.0])  # q > p, a tie, q < p
    by_hand = omega * (q * p.sum() - p) - (1 - omega) * (m * q - q * (m * q).sum())
    assert torch.allclose(q_logits.grad[0], by_hand, atol=1e-6)


def test_optimizer_is_fused_and_resumes_either_way(tiny):
    """The trainer's AdamW is torch's fused kernel; its state loads into the for-loop AdamW (and back), so a
    checkpoint of either resumes in the other; one step of each from the same state agrees to float32 rounding."""
    import copy

    from spire.training import distill

    ps = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3))]
    fused = distill.make_optimizer(ps, TrainConfig(lr=1e-2))
    assert fused.defaults.get("fused") is True
    for p in ps:
        p.grad = torch.ones_like(p)
    fused.step()
    loop = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2, betas=(0.9, 0.95))
    loop.load_state_dict(copy.deepcopy(fused.state_dict()))  # (a state dict shares its tensors)
    loop.param_groups[0].update(fused=None, foreach=False)  # the loaded group says fused: the for-loop step
    for p, q in zip(ps, loop.param_groups[0]["params"]):
        p.grad = q.grad = torch.full_like(p, 0.5)
    fused.step()
    loop.step()
    for p, q in zip(ps, loop.param_groups[0]["params"]):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)


def test_resume_of_a_for_loop_checkpoint_keeps_the_fused_kernel(tmp_path, monkeypatch):
    """A checkpoint written with the for-loop AdamW (a run from before the fused kernel) resumes into the fused
    one: a loaded optimizer state must not carry the old implementation's setting over."""
    from spire.training import distill
    from tests.conftest import make_tiny
    from tests.train_worker import config

    target, data = make_tiny(), RepeatingData()
    with_backend(monkeypatch, target, fused_adamw=False)
    train_draft(target, data, tmp_path, config("spire", 2, 2, checkpoint_every=0.0), progress=False)
    with_backend(monkeypatch, target, fused_adamw=True)
    trainer = distill.Trainer(target, data, tmp_path, config("spire", 3, 2, checkpoint_every=0.0), None, True,
                              None, None)
    assert trainer.state["step"] == 2
    assert all(g["fused"] is True for g in trainer.opt.param_groups)


def test_an_optimizer_step_never_meets_a_kept_inference_copy(tiny):
    """The fused AdamW kernel does not bump version counters: weight copies keyed by version went stale after the
    first no-grad forward (held-out α during training, and a draft used in the process that trained it, measured
    the weights of the first evaluation). Copies are now kept for frozen weights only: after make_optimizer's
    steps a no-grad forward equals that of a fresh copy, nothing was kept while training, and once frozen the
    kept copies give the same logits."""
    import copy

    from spire.drafts.spire import SpireConfig, SpireDraftModel
    from spire.training.distill import TrainConfig, make_optimizer
    from spire.training.sources import run_target
    model = SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, window=8))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, TrainConfig(lr=1e-2))
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    tb = run_target(tiny, tokens, model.target_layers(), True)
    with torch.no_grad():
        before = model.train_logits(tokens, tb.hidden, 4)  # builds the kept copies
    for _ in range(3):
        loss = model.train_logits(tokens, tb.hidden, 4).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = model.train_logits(tokens, tb.hidden, 4)
        fresh = copy.deepcopy(model).train_logits(tokens, tb.hidden, 4)
    assert not torch.allclose(after, before, atol=1e-3)  # the steps moved the draft
    torch.testing.assert_close(after, fresh, rtol=0, atol=1e-5)
    from spire import fastpath

    kept = [wc._store for m in model.modules() for wc in fastpath.weight_copies(m).values() if wc._store]
    assert not kept  # nothing kept for weights in training: the trainer has no inference cache to refresh
    model.requires_grad_(False)  # finished: frozen, its copies are kept from the first use
    with torch.no_grad():
        frozen = model.train_logits(tokens, tb.hidden, 4)
    assert any(wc._store for m in model.modules() for wc in fastpath.weight_copies(m).values())
    torch.testing.assert_close(frozen, fresh, rtol=0, atol=1e-5)
