"""Beyond the paper: SPIRe's hidden-state matching term (TrainConfig.hidden_weight, `spire train --hidden-loss`)."""

import json

import pytest
import torch

from spire.drafts.spire import SpireConfig, SpireDraftModel
from spire.errors import ConfigError
from spire.training.distill import LOG_FILE, TrainConfig, load_state, step_loss, train_draft
from spire.training.sources import run_target
from tests.train_worker import RepeatingData


def test_mismatch_values():
    t = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])  # (1, 2, 2): |t|^2 = 25 and 1
    assert float(SpireDraftModel.hidden_mismatch(t, t)) == 0.0
    assert float(SpireDraftModel.hidden_mismatch(torch.zeros_like(t), t)) == pytest.approx(1.0)
    x = torch.tensor([[[3.0, 9.0], [1.0, 1.0]]])  # |x - t|^2 = 25 and 1: ratios 1 and 1
    assert float(SpireDraftModel.hidden_mismatch(x, t)) == pytest.approx(1.0)
    x = torch.tensor([[[3.0, 4.0], [3.0, 0.0]]])  # ratios 0 and 4: mean 2
    assert float(SpireDraftModel.hidden_mismatch(x, t)) == pytest.approx(2.0)


def _batch(tiny, layers, T=32):
    torch.manual_seed(1)
    tokens = torch.randint(0, tiny.cfg.vocab_size, (2, T))
    return tokens, run_target(tiny, tokens, layers, teacher=True)


def test_zero_where_the_draft_computes_what_the_target_does(tiny):
    """Draft layers (0, 1) copied from the target's first two, with a full KV cache and no feedback memory: a
    drafted position's layer 0 reads exactly what the target's layer 0 reads (every earlier embedding), so the
    residual entering draft layer 1 is the target's entering layer 1 and the term is 0 up to float32 rounding.
    Skipping target layer 1 (draft layers 0, 2) makes it clearly positive."""
    same = SpireDraftModel(tiny, SpireConfig(layers=(0, 1), window=None, feedback_memory=False))
    tokens, tb = _batch(tiny, same.source_layers)
    logits, mismatch = same.forward_train(tokens, tb.hidden, 4, match_hidden=True)
    assert float(mismatch.detach()) < 1e-10
    assert torch.equal(logits, same.forward_train(tokens, tb.hidden, 4))  # the logits do not change
    skip = SpireDraftModel(tiny, SpireConfig(layers=(0, 2), window=None, feedback_memory=False))
    tokens, tb = _batch(tiny, (0, 1, 2))
    _, mismatch = skip.forward_train(tokens, tb.hidden, 4, match_hidden=True)
    by_hand = SpireDraftModel.hidden_mismatch(tb.hidden[1], tb.hidden[2])  # layer 0's output is target's input 1
    assert float(mismatch.detach()) == pytest.approx(float(by_hand), rel=1e-4) and float(by_hand) > 0.01


@pytest.mark.slow
def test_loss_adds_the_weighted_term_and_trains_it_down(tiny, tmp_path):
    cfg = TrainConfig(batch_size=4, seq_len=32, k=4, bf16=False, draft_config=SpireConfig(layers=(0, 3), window=8))
    model = SpireDraftModel(tiny, cfg.draft_config)
    tokens, tb = _batch(tiny, model.source_layers)
    base, alpha = step_loss(model, tiny, tb, cfg)
    cfg.hidden_weight = 0.5
    parts = {}
    with_term, alpha2 = step_loss(model, tiny, tb, cfg, parts)
    _, mismatch = model.forward_train(tokens, tb.hidden, 4, match_hidden=True)
    assert alpha2 == alpha and float(with_term - base) == pytest.approx(0.5 * float(mismatch), rel=1e-5)
    assert parts["hidden"] == pytest.approx(float(mismatch), rel=1e-5)
    # training with a large weight lowers the term on held-in data
    cfg = TrainConfig(max_steps=40, batch_size=4, seq_len=32, k=4, lr=3e-3, bf16=False, hidden_weight=5.0,
                      draft_config=SpireConfig(layers=(0, 3), window=8))
    data = RepeatingData()
    trained, state = train_draft(tiny, data, tmp_path, cfg, progress=False)
    seq = data.seqs[:2]
    tb = run_target(tiny, seq, trained.source_layers, teacher=True)
    fresh = SpireDraftModel(tiny, cfg.draft_config)
    before = float(fresh.forward_train(seq, tb.hidden, 4, match_hidden=True)[1])
    after = float(trained.forward_train(seq, tb.hidden, 4, match_hidden=True)[1])
    assert state["finished"] and after < 0.7 * before, (before, after)
    assert load_state(tmp_path)["config"]["hidden_weight"] == 5.0
    # the log carries the term on its own (unweighted), and it goes down with the loss
    logged = [json.loads(ln) for ln in (tmp_path / LOG_FILE).read_text().splitlines()]
    mism = [r["hidden_mismatch"] for r in logged if r.get("event") == "train"]
    assert len(mism) == 40 and all(m > 0 for m in mism) and sum(mism[-5:]) < 0.7 * sum(mism[:5])


@pytest.mark.parametrize("bad,match", [(dict(hidden_weight=-1.0), "hidden-loss"),
                                       (dict(hidden_weight=float("inf")), "finite number"),
                                       (dict(hidden_weight=1.0, draft="vanilla"), "SPIRe draft only")])
def test_bad_settings(bad, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**bad).validate()


def test_needs_target_activations(tiny):
    model = SpireDraftModel(tiny, SpireConfig(layers=(0, 3), feedback_memory=False, target_activations=False))
    tokens, tb = _batch(tiny, (0, 3))
    with pytest.raises(ConfigError, match="target activations"):
        model.forward_train(tokens, tb.hidden, 4, match_hidden=True)
