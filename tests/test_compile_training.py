"""`spire train --compile`: the draft's training forward and backward through torch.compile. The compiled run
trains the same draft as the eager one (float32, to rounding), the compile is logged and kept outside the training
clock, evaluation stays eager, a failing compile falls back to eager training, and a run may resume with or
without it."""

import json
import dataclasses

import pytest
import torch

from spire.training import distill
from spire.training.distill import train_draft
from tests.test_target_cache import TokenLikeData
from tests.test_trainer import one_thread  # noqa: F401  (the fixture)
from tests.train_worker import RepeatingData, config

pytestmark = pytest.mark.slow  # torch.compile builds C++ kernels: minutes on 2 cores (not in make test-fast)


@pytest.fixture(scope="module")
def inductor():
    """Skip where torch.compile cannot build kernels (no C++ compiler or Python headers): the fallback tests below
    still run there."""
    try:
        torch.compile(lambda x: x.sin() + 1, dynamic=False)(torch.ones(3))
    except Exception as e:  # inductor's toolchain errors
        pytest.skip(f"torch.compile cannot build kernels on this machine ({type(e).__name__})")


def _log(run):
    return [json.loads(ln) for ln in (run / "train_log.jsonl").read_text().splitlines() if ln.strip()]


def _losses(run):
    return [e["loss"] for e in _log(run) if e["event"] == "train"]


@pytest.mark.parametrize("draft", ["spire", "vanilla"])
def test_compiled_training_equals_eager_training(tmp_path, tiny, draft, one_thread, inductor):
    """Six float32 steps, eager and compiled, on the same batches: every step's loss and the final weights
    agree to float32 rounding (the compiled kernels sum in other orders); the held-out evaluation of the
    compiled run is eager (one graph is built: none for the no-grad forward); the returned draft is plain."""
    data = RepeatingData()
    eager_cfg = config(draft, 6, 4)
    eager, _ = train_draft(tiny, data, tmp_path / "eager", eager_cfg, heldout=data.seqs[:2], progress=False)
    compiled_cfg = dataclasses.replace(config(draft, 6, 4), compile=True)
    counter = torch._dynamo.utils.counters
    counter.clear()
    model, state = train_draft(tiny, data, tmp_path / "compiled", compiled_cfg, heldout=data.seqs[:2],
                               progress=False)
    events = [e for e in _log(tmp_path / "compiled") if e["event"] == "compile"]
    assert len(events) == 1 and events[0]["compiled"] is True and events[0]["step"] == 0
    assert counter["stats"]["unique_graphs"] == 1  # the training graph only: evaluation ran eagerly
    assert "train_logits" not in model.__dict__
    assert state["step"] == 6
    a, b = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert len(a) == len(b) == 6
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-4, atol=0)
    w0 = torch.cat([p.detach().flatten() for p in eager.parameters()])
    w1 = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (w1 - w0).abs().max() < 1e-4 * w0.abs().max()


def _raising_at_call(error):
    def broken(fn, **kw):
        def call(*a, **k):
            raise error
        return call
    return broken


def _raising_at_compile(fn, **kw):
    raise RuntimeError("torch.compile is not supported on Python 3.15+")


@pytest.mark.parametrize("broken,line", [
    (_raising_at_call(RuntimeError("inductor: no working C++ compiler\nmore detail")),
     "torch.compile failed here (RuntimeError: inductor: no working C++ compiler)"),
    (_raising_at_call(AssertionError()), "torch.compile failed here (AssertionError: )"),
    (_raising_at_compile, "torch.compile failed here (RuntimeError: torch.compile is not supported on Python 3.15+)")])
def test_a_failing_compile_trains_eagerly(tmp_path, tiny, monkeypatch, one_thread, broken, line):
    """torch.compile failing (at the first call: no C++ compiler; with an empty message; or refusing to compile at
    all, as torch does on some interpreters): the run says so in one line, naming inductor's cache folder, and
    trains eagerly, bit for bit as a run without --compile; the log says "compiled": false."""
    monkeypatch.setattr(torch, "compile", broken)
    data = RepeatingData()
    train_draft(tiny, data, tmp_path / "eager", config("spire", 4, 4), progress=False)
    lines = []
    train_draft(tiny, data, tmp_path / "run", dataclasses.replace(config("spire", 4, 4), compile=True),
                progress=False, log=lines.append)
    failed = [m for m in lines if "torch.compile failed" in m]
    assert len(failed) == 1 and line in failed[0] and "delete inductor's cache folder" in failed[0]
    events = [e for e in _log(tmp_path / "run") if e["event"] == "compile"]
    assert [e["compiled"] for e in events] == [False]
    assert _losses(tmp_path / "run") == _losses(tmp_path / "eager")


def test_a_run_resumes_with_or_without_compile(tmp_path, tiny, monkeypatch, one_thread):
    """compile is not part of a run's identity: a run started eagerly resumes compiled (and back); the
    saved settings check does not refuse it."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the plumbing, not inductor: fast
    data = RepeatingData()
    train_draft(tiny, data, tmp_path, config("spire", 2, 4), progress=False)
    _, state = train_draft(tiny, data, tmp_path, dataclasses.replace(config("spire", 4, 4), compile=True),
                           resume=True, progress=False)
    assert state["step"] == 4
    _, state = train_draft(tiny, data, tmp_path, config("spire", 5, 4), resume=True, progress=False)
    assert state["step"] == 5
    assert [e["step"] for e in _log(tmp_path) if e["event"] == "compile"] == [2]



def test_the_warm_up_compiles_everything_under_bf16(tmp_path, tiny, monkeypatch, one_thread, inductor):
    """Under bf16 autocast with a draft vocabulary the first compiled pass keeps bf16 weight copies that the
    graph's guards read, so the second pass recompiles parts of it: the warm-up runs both, and no training step
    compiles anything (in a cold 2-process run that recompile used to take ~2 minutes of step 1)."""
    from spire.drafts.spire import SpireConfig

    counter = torch._dynamo.utils.counters
    counter.clear()
    after_warm_up = []
    real = distill.Trainer.warm_up

    def warm_up(self):
        real(self)
        after_warm_up.append(counter["stats"]["unique_graphs"])
    monkeypatch.setattr(distill.Trainer, "warm_up", warm_up)
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    cfg = dataclasses.replace(config("spire", 4, 4), bf16=True, compile=True, data_steps=4, target_cache="bfloat16",
                              draft_config=SpireConfig(n_draft_layers=2, window=8, vocab_size=60))
    _, state = train_draft(tiny, TokenLikeData(), tmp_path, cfg, progress=False)
    assert state["step"] == 4 and [e["compiled"] for e in _log(tmp_path) if e["event"] == "compile"] == [True]
    assert after_warm_up[0] >= 1
    assert counter["stats"]["unique_graphs"] == after_warm_up[0]
