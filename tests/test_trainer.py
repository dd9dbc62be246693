"""The trainer: exact resume, crash safety (SIGKILL mid-run), NaN stop, vanilla baseline, ablation configs,
data-parallel runs under torchrun, and bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spire.drafts.spire import SpireConfig, SpireDraftModel
from spire.drafts.vanilla import VanillaDraft
from spire.errors import CheckpointError, ConfigError, DataError, TokenizerMismatchError, TrainingError
from spire.loading import load_state_dict
from spire.model import ModelConfig, Transformer
from spire.speculative import generate
from spire.training import distill
from spire.training.distill import (ABLATIONS, TrainConfig, ablation_config, evaluate_heldout, load_state,
                                    train_draft)
from tests.conftest import make_tiny
from tests.train_worker import RepeatingData, config

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "train_worker.py"


def _train_losses(run: Path) -> dict[int, float]:
    lines = [json.loads(ln) for ln in (run / "train_log.jsonl").read_text().splitlines() if ln.strip()]
    return {e["step"]: e["loss"] for e in lines if e["event"] == "train"}


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class CrashingData(RepeatingData):
    """Raises at the given step, like a process that dies there."""

    def __init__(self, crash_at: int):
        super().__init__()
        self.calls, self.crash_at = 0, crash_at

    def sample_train_batch(self, batch_size, seq_len, generator):
        self.calls += 1
        if self.calls == self.crash_at:
            raise KeyboardInterrupt
        return super().sample_train_batch(batch_size, seq_len, generator)


@pytest.mark.parametrize("draft", ["spire", "vanilla"])
def test_resume_continues_exactly(tmp_path, tiny, draft):
    """An interrupted run resumed with --resume gives the same next losses and the same final weights as an
    uninterrupted run (batches depend on (seed, step), the schedule on step, AdamW state is restored)."""
    cfg = config(draft, max_steps=8, batch=4, checkpoint_every=0.0)  # checkpoint after every step
    ref_model, ref_state = train_draft(tiny, RepeatingData(), tmp_path / "ref", cfg, progress=False)
    with pytest.raises(KeyboardInterrupt):
        train_draft(tiny, CrashingData(crash_at=5), tmp_path / "run", config(draft, 8, 4, 0.0), progress=False)
    assert load_state(tmp_path / "run")["step"] == 4
    model, state = train_draft(tiny, RepeatingData(), tmp_path / "run", config(draft, 8, 4, 0.0), resume=True,
                               progress=False)
    assert state["step"] == 8 and state["finished"]
    ref, got = _train_losses(tmp_path / "ref"), _train_losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-7), step
    torch.testing.assert_close(_weights(model), _weights(ref_model), rtol=1e-6, atol=1e-7)
    assert ref[8] < ref[1]  # and it learns


def test_sigkill_mid_run_resumes_from_a_complete_checkpoint(tmp_path, tiny):
    """kill -9 at an arbitrary instant (often inside a checkpoint write): the run folder still holds a complete
    checkpoint, and resuming reaches the uninterrupted run's weights exactly."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(run), "spire", "400", "4", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and (load_state(run) or {}).get("step", 0) < 3:
        time.sleep(0.05)
    time.sleep(0.37)  # land somewhere in a later step or checkpoint
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = load_state(run)
    assert state is not None and 3 <= state["step"] < 400, proc.stderr.read().decode()[-2000:]
    steps = state["step"] + 3
    # resume for 3 more steps, and compare with an uninterrupted run of as many steps
    with pytest.raises(KeyboardInterrupt):
        train_draft(tiny, StopAt(4), run, config("spire", 400, 4, 0.0), resume=True, progress=False)
    with pytest.raises(KeyboardInterrupt):
        train_draft(tiny, StopAt(steps + 1), tmp_path / "ref", config("spire", 400, 4, 1e9), progress=False)
    got, ref = _train_losses(run), _train_losses(tmp_path / "ref")
    assert max(got) == steps and max(ref) == steps
    for step in range(1, steps + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), step


class StopAt(RepeatingData):
    """Interrupts a run when asked for its n-th batch (a run of n - 1 steps)."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.calls = n, 0

    def sample_train_batch(self, batch_size, seq_len, generator):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return super().sample_train_batch(batch_size, seq_len, generator)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny, monkeypatch):
    calls = {"n": 0}
    real = distill.mixed_loss_logp

    def poisoned(q, p, omega):
        calls["n"] += 1
        terms = real(q, p, omega)
        if calls["n"] == 4:
            terms.loss = terms.loss * float("nan")
        return terms

    monkeypatch.setattr(distill, "mixed_loss_logp", poisoned)
    with pytest.raises(TrainingError, match=r"non-finite loss .* at step 4 .*checkpoint \(step 3\)"):
        train_draft(tiny, RepeatingData(), tmp_path, config("spire", 10, 4, 0.0), progress=False)
    assert load_state(tmp_path)["step"] == 3
    draft = SpireDraftModel.load(tmp_path / "draft.safetensors", tiny)  # the exported draft is the good one
    assert all(torch.isfinite(p).all() for p in draft.parameters())


def test_vanilla_baseline_learns_and_exports_an_hf_folder(tmp_path, tiny):
    data = RepeatingData()
    cfg = config("vanilla", max_steps=40, batch=4)
    assert cfg.resolved_loss() == "hard"
    before = evaluate_heldout(distill._build_model(tiny, cfg), tiny, data.seqs, cfg)
    model, state = train_draft(tiny, data, tmp_path, cfg, heldout=data.seqs, progress=False)
    after = state["heldout"]
    assert after["ce"] < before["ce"] - 1.0, (before, after)
    # 1 block of the tiny target's width: the baseline is about 1/n_layers of the body
    assert sum(p.numel() for p in model.layers.parameters()) == tiny.num_body_params() // tiny.cfg.n_layers
    folder = tmp_path / "draft"
    cfg_hf = json.loads((folder / "config.json").read_text())
    assert cfg_hf["num_hidden_layers"] == 1 and cfg_hf["tie_word_embeddings"] is True
    loaded = Transformer(ModelConfig.from_hf(cfg_hf))
    loaded.load_state_dict(load_state_dict(folder), strict=False)
    loaded.lm_head.weight = loaded.model.embed_tokens.weight
    torch.testing.assert_close(_weights(loaded), _weights(model))
    # the trained draft decodes losslessly: greedy SD == AD
    prompts = data.seqs[:2, :10]
    ad = generate(tiny, prompts, 12)
    sd = generate(tiny, prompts, 12, draft=VanillaDraft(loaded.eval()), k=3)
    assert sd.tokens == ad.tokens


@pytest.mark.parametrize("name", [n for n in ABLATIONS if n != "none"])
def test_every_ablation_trains(tmp_path, tiny, name):
    cfg = ablation_config(name, **{k: v for k, v in vars(config("spire", 3, 2)).items()
                                   if k not in ("draft", "ablation", "spire", "omega", "loss")},
                          spire=SpireConfig(n_draft_layers=2, window=8))
    model, state = train_draft(tiny, RepeatingData(), tmp_path, cfg, heldout=RepeatingData().seqs[:2],
                               progress=False)
    assert state["step"] == 3 and state["config"]["ablation"] == name
    meta_cfg = SpireDraftModel.load(tmp_path / "draft.safetensors", tiny).cfg
    spire_kw, train_kw = ABLATIONS[name]
    for key, value in spire_kw.items():
        assert getattr(meta_cfg, key) == value
    for key, value in train_kw.items():
        assert state["config"][key] == value
    assert 0.0 < state["heldout"]["alpha"] <= 1.0


def test_explicit_options_win_over_the_ablation():
    cfg = ablation_config("omega1", omega=0.7)
    assert cfg.omega == 0.7 and cfg.ablation == "omega1"
    with pytest.raises(ConfigError, match="unknown ablation"):
        ablation_config("no-such")


def test_bad_runs_are_refused(tmp_path, tiny):
    train_draft(tiny, RepeatingData(), tmp_path / "a", config("spire", 2, 2), progress=False)
    with pytest.raises(ConfigError, match="already holds a run"):
        train_draft(tiny, RepeatingData(), tmp_path / "a", config("spire", 2, 2), resume=False, progress=False)
    with pytest.raises(CheckpointError, match="nothing to resume"):
        train_draft(tiny, RepeatingData(), tmp_path / "b", config("spire", 2, 2), resume=True, progress=False)
    other = make_tiny(seed=3)  # same shapes, other weights: another target
    with pytest.raises(TokenizerMismatchError, match="trained for target"):
        train_draft(other, RepeatingData(), tmp_path / "a", config("spire", 4, 2), resume=True, progress=False)
    changed = config("spire", 4, 2)
    changed.lr = 1e-4
    with pytest.raises(ConfigError, match=r"other settings \(lr\)"):
        train_draft(tiny, RepeatingData(), tmp_path / "a", changed, resume=True, progress=False)
    for bad in (dict(draft="medusa"), dict(loss="l2"), dict(max_steps=0), dict(seq_len=30), dict(lr=0.0)):
        with pytest.raises(ConfigError):
            train_draft(tiny, RepeatingData(), tmp_path / "c", TrainConfig(**bad), progress=False)
    assert not (tmp_path / "c").exists()


def test_text_files_data(tmp_path):
    from spire.data import prepare_text_files

    class CharTok:
        eos_token_id = 0

        def get_vocab(self):
            return {chr(32 + i): 1 + i for i in range(90)}

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[1 + (ord(c) % 90) for c in t] for t in texts]}

    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text files"):
        prepare_text_files(CharTok(), [tmp_path / "empty"], cache_dir=tmp_path / "cache")
    (tmp_path / "empty" / "a.txt").write_text("   \n")
    with pytest.raises(DataError, match="empty"):
        prepare_text_files(CharTok(), [tmp_path / "empty"], cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="not found"):
        prepare_text_files(CharTok(), [tmp_path / "missing.txt"], cache_dir=tmp_path / "cache")
    book = "\n\n".join(f"Paragraph {i}. " + "word " * 200 for i in range(300))  # ~300k chars: cut in parts
    (tmp_path / "book.txt").write_text(book)
    td = prepare_text_files(CharTok(), [tmp_path / "book.txt"], cache_dir=tmp_path / "cache", progress=False)
    assert len(td.train) >= 2 and len(td.heldout) >= 1
    assert td.train.n_tokens + td.heldout.n_tokens == len(book) + len(td.train) + len(td.heldout)  # + EOS each
    assert td.sample_train_batch(2, 64, torch.Generator().manual_seed(0)).shape == (2, 64)


@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun is not installed")
def test_torchrun_two_processes_match_one_process(tmp_path):
    """Data parallel (gloo, 2 CPU processes, global batch 4 = 2 x 2): the processes stay in sync and their
    losses and weights equal a 1-process run with the same global batch."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(WORKER), str(tmp_path / "ddp"),
                        "spire", "6", "4"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r1 = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "one"), "spire", "6", "4"], env=env,
                        capture_output=True, text=True, timeout=300)
    assert r1.returncode == 0, r1.stderr[-3000:]
    ranks = [json.loads((tmp_path / "ddp" / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert ranks[0]["world"] == 2 and ranks[0] == ranks[1]  # in sync, bit for bit
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    assert one["abs"] == pytest.approx(ranks[0]["abs"], rel=1e-5)
    ddp, ref = _train_losses(tmp_path / "ddp"), _train_losses(tmp_path / "one")
    assert sorted(ddp) == list(range(1, 7))
    for step in ddp:
        assert ddp[step] == pytest.approx(ref[step], rel=1e-5), step


def test_resume_takes_the_saved_settings(tmp_path, tiny):
    """`spire train --resume` rebuilds the run's config from its checkpoint; only the limits are new."""
    from spire.training.run import saved_config

    cfg = config("spire", 2, 2)
    cfg.lr, cfg.seq_len = 2e-3, 16
    train_draft(tiny, RepeatingData(), tmp_path, cfg, progress=False)
    again = saved_config(tmp_path, {"max_steps": 3, "checkpoint_every": 5.0})
    assert (again.lr, again.seq_len, again.max_steps, again.checkpoint_every) == (2e-3, 16, 3, 5.0)
    assert again.spire == cfg.spire
    _, state = train_draft(tiny, RepeatingData(), tmp_path, again, resume=True, progress=False)
    assert state["step"] == 3
    with pytest.raises(CheckpointError, match="nothing to resume"):
        saved_config(tmp_path / "empty", {})


def test_resume_a_run_saved_before_a_setting_existed(tmp_path, tiny):
    """A checkpoint written before a TrainConfig field was added (here: data) resumes when the field has
    its default; a real difference is still named."""
    import json as _json

    train_draft(tiny, RepeatingData(), tmp_path, config("spire", 2, 2), progress=False)
    state_file = tmp_path / "checkpoint" / "train_state.json"
    saved = _json.loads(state_file.read_text())
    assert "data" in saved["config"] and saved["config"]["data"] is None
    del saved["config"]["data"]
    state_file.write_text(_json.dumps(saved))
    _, state = train_draft(tiny, RepeatingData(), tmp_path, config("spire", 3, 2), resume=True, progress=False)
    assert state["step"] == 3
    del saved["config"]["omega"]  # absent reads as the default 0.5; the run says 0.9
    saved["step"] = 3
    state_file.write_text(_json.dumps(saved))
    changed = config("spire", 4, 2)
    changed.omega = 0.9
    with pytest.raises(ConfigError, match=r"other settings \(omega\)"):
        train_draft(tiny, RepeatingData(), tmp_path, changed, resume=True, progress=False)
