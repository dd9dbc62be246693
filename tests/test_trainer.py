"""The trainer: bit-exact resume, crash safety (SIGKILL at every point of a checkpoint write, resumed bit for
bit), replace_dir's recovery, NaN stop, vanilla baseline, ablation configs, data-parallel runs under torchrun,
and bad input."""

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
from spire.drafts.vanilla import VanillaConfig, VanillaDraft
from spire.errors import CheckpointError, ConfigError, DataError, TokenizerMismatchError, TrainingError
from spire.loading import load_state_dict
from spire.model import ModelConfig, Transformer
from tests.oracle import generate
from spire.training import distill
from tests.helpers import set_in_training
from spire.training.distill import (ABLATIONS, TrainConfig, ablation_config, evaluate_heldout, load_state,
                                    train_draft)
from tests.conftest import make_tiny
from tests.train_worker import CRASH_POINTS, RepeatingData, TickClock, config

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


@pytest.fixture
def one_thread():
    """Bit-for-bit comparisons between runs need the same kernels: one thread, as in tests/train_worker.py."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tick_clock(monkeypatch):
    """The trainer's clock advances exactly 1 s per reading (as SPIRE_TEST_CLOCK does in the worker): every
    step takes 1 s, so log lines (elapsed_s, tokens_per_s) and time-limited runs are deterministic."""
    set_in_training("time", TickClock(), monkeypatch)


def _checkpoint(run: Path) -> tuple[dict, dict, dict]:
    """(draft weights, AdamW state dict, JSON state) of a run folder's checkpoint."""
    from safetensors.torch import load_file

    ck = run / "checkpoint"
    return (load_file(ck / "draft.safetensors"), torch.load(ck / "optimizer.pt", weights_only=True),
            json.loads((ck / "train_state.json").read_text()))


def _log(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "train_log.jsonl").read_text().splitlines() if ln.strip()]


def assert_same_run(run: Path, ref: Path) -> None:
    """Every parameter and every AdamW tensor equal bit for bit (torch.equal), the same JSON state (the
    loss EMA of ``history`` excepted: it restarts on resume) and the same log lines."""
    (w, opt, st), (w0, opt0, st0) = _checkpoint(run), _checkpoint(ref)
    assert w.keys() == w0.keys() and w
    for name in w:
        assert torch.equal(w[name], w0[name]), name
    assert opt["param_groups"] == opt0["param_groups"]
    assert opt["state"].keys() == opt0["state"].keys() and opt["state"]
    for i, slots in opt["state"].items():
        assert slots.keys() == opt0["state"][i].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for slot, value in slots.items():
            assert torch.equal(value, opt0["state"][i][slot]), (i, slot)
    for key in ("step", "tokens", "elapsed_s", "finished", "config"):
        assert st[key] == st0[key], key
    assert [h["step"] for h in st["history"]] == [h["step"] for h in st0["history"]]
    assert _log(run) == _log(ref)
    from safetensors.torch import load_file

    if (ref / "draft.safetensors").exists():  # the exported draft: a SPIRe file or a vanilla HF folder
        exported, exported0 = load_file(run / "draft.safetensors"), load_file(ref / "draft.safetensors")
    else:
        exported, exported0 = load_state_dict(run / "draft"), load_state_dict(ref / "draft")
    assert exported.keys() == exported0.keys() and all(torch.equal(exported[n], exported0[n]) for n in exported0)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["spire", "vanilla"])
def test_resume_continues_exactly(tmp_path, tiny, draft, one_thread, tick_clock, capsys):
    """An interrupted run resumed with --resume ends bit for bit where an uninterrupted run ends (weights,
    AdamW state, log lines): batches depend on (seed, step), the schedule on step, AdamW state is restored."""
    cfg = config(draft, max_steps=8, batch=4, checkpoint_every=0.0)  # checkpoint after every step
    train_draft(tiny, RepeatingData(), tmp_path / "ref", cfg, progress=False)
    with pytest.raises(KeyboardInterrupt):
        train_draft(tiny, CrashingData(crash_at=5), tmp_path / "run", config(draft, 8, 4, 0.0), progress=False)
    assert load_state(tmp_path / "run")["step"] == 4
    from spire.commands.train import interrupted_note  # what `spire train` prints on Ctrl-C

    assert "its last checkpoint (step 4;" in interrupted_note(tmp_path / "run")
    assert interrupted_note(tmp_path / "none").startswith("interrupted before the first checkpoint")
    if draft == "spire":  # its intermediate draft still serves, with a warning naming the run
        from spire.drafts import make_draft

        capsys.readouterr()
        make_draft("spire", tiny, path=str(tmp_path / "run"))
        err = capsys.readouterr().err
        assert f"warning: {tmp_path / 'run'} is an unfinished training run (stopped at step 4)" in err
    model, state = train_draft(tiny, RepeatingData(), tmp_path / "run", config(draft, 8, 4, 0.0), resume=True,
                               progress=False)
    assert state["step"] == 8 and state["finished"]
    assert_same_run(tmp_path / "run", tmp_path / "ref")
    if draft == "spire":
        capsys.readouterr()
        make_draft("spire", tiny, path=str(tmp_path / "run"))
        assert "warning" not in capsys.readouterr().err
    losses = _train_losses(tmp_path / "ref")
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1]  # and it learns


def _worker(run: Path, *args, crash: str | None = None) -> None:
    """Run tests/train_worker.py (tick clock); with ``crash`` it must die by SIGKILL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "SPIRE_TEST_CLOCK": "1"}
    if crash:
        env["SPIRE_TEST_CRASH"] = crash
    r = subprocess.run([sys.executable, str(WORKER), str(run), *map(str, args)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == (-signal.SIGKILL if crash else 0), (r.returncode, r.stderr[-3000:])


def _temp_folders(run: Path) -> list[Path]:
    return sorted(run.glob(".checkpoint.*.tmp"))


def _assert_killed_at(run: Path, point: str, nth: int) -> None:
    """What the folder shows proves where the kill landed (checkpoint ``nth`` is written after step nth)."""
    ck, old, tmps = run / "checkpoint", run / "checkpoint.old", _temp_folders(run)
    step = (load_state(run) or {}).get("step")
    prev_size = {f.name: f.stat().st_size for f in (ck if ck.is_dir() else old).iterdir()}
    if point in ("draft", "optimizer", "state", "swap"):
        assert step == nth - 1 and ck.is_dir() and not old.exists() and len(tmps) == 1
        new = {f.name: f.stat().st_size for f in tmps[0].iterdir()}
        if point == "draft":  # atomic_write's own temporary file holds half of the bytes
            assert "draft.safetensors" not in new and len(new) == 1
            assert list(new.values())[0] == prev_size["draft.safetensors"] // 2
        elif point == "optimizer":
            assert 0 < new["optimizer.pt"] < prev_size["optimizer.pt"] and "train_state.json" not in new
            with pytest.raises(RuntimeError):
                torch.load(tmps[0] / "optimizer.pt", weights_only=True)
        elif point == "state":
            assert 0 < new["train_state.json"] < prev_size["train_state.json"]
            with pytest.raises(json.JSONDecodeError):
                json.loads((tmps[0] / "train_state.json").read_text())
        else:  # the whole new folder is there, the old one untouched
            assert set(new) == set(prev_size)
            assert json.loads((tmps[0] / "train_state.json").read_text())["step"] == nth
    elif point == "renames":
        assert not ck.exists() and step == nth - 1 and len(tmps) == 1
        assert json.loads((tmps[0] / "train_state.json").read_text())["step"] == nth
    elif point == "cleanup":
        assert step == nth and old.is_dir() and not tmps
        assert json.loads((old / "train_state.json").read_text())["step"] == nth - 1
    elif point == "export":
        assert step == nth and not old.exists() and not tmps
        part = list(run.glob(".draft.safetensors.*.tmp"))
        assert len(part) == 1 and 0 < part[0].stat().st_size < (ck / "draft.safetensors").stat().st_size
    elif point == "step":
        assert step == nth and not old.exists() and not tmps
    logged = [e["step"] for e in _log(run) if e["event"] == "train"]
    assert logged == list(range(1, nth + 1)), logged  # killed before step nth + 1 logged anything


def _in_process(run: Path, max_steps, budget_s=1e6, resume=None) -> None:
    """The worker's run, here (one thread, tick clock): to resume, and for the uninterrupted references."""
    threads, clock = torch.get_num_threads(), distill.time
    torch.set_num_threads(1)
    set_in_training("time", TickClock())
    try:
        train_draft(make_tiny(), RepeatingData(), run, config("spire", max_steps, 4, 0.0, budget_s), resume=resume,
                    progress=False)
    finally:
        torch.set_num_threads(threads)
        set_in_training("time", clock)


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """Uninterrupted runs: 5 steps (max_steps), and 5 s of the tick clock (time budget only)."""
    root = tmp_path_factory.mktemp("reference")
    _in_process(root / "steps", 5)
    _in_process(root / "time", None, budget_s=5)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_sigkill_inside_a_checkpoint_resumes_bit_for_bit(tmp_path, reference_runs, point):
    """kill -9 (in a child process) at each point of the third checkpoint write: inside each file, between
    the new folder and the swap, between the two renames, before the old folder's removal, in the export,
    between two checkpoints. The folder shows the kill landed there, and the resumed run equals the
    uninterrupted one bit for bit (every parameter, the AdamW state, the log lines)."""
    run = tmp_path / "run"
    _worker(run, "spire", 5, 4, 0, crash=f"{point}@3")
    _assert_killed_at(run, point, 3)
    _in_process(run, 5, resume=True)
    assert_same_run(run, reference_runs / "steps")
    assert not (run / "checkpoint.old").exists() and not _temp_folders(run)  # replace_dir removed the leftovers


@pytest.mark.slow
def test_sigkill_in_a_time_limited_run_resumes_bit_for_bit(tmp_path, reference_runs):
    """A run limited only by time (5 s of the tick clock, no max_steps): its learning-rate schedule follows
    the saved elapsed time, so the resumed run equals the uninterrupted one bit for bit."""
    run = tmp_path / "run"
    _worker(run, "spire", "none", 4, 0, 5, crash="renames@3")
    _assert_killed_at(run, "renames", 3)
    _in_process(run, None, budget_s=5, resume=True)
    assert_same_run(run, reference_runs / "time")
    st = _checkpoint(run)[2]
    assert st["step"] == 5 and st["elapsed_s"] == 5.0 and st["config"]["max_steps"] is None
    lrs = [e["lr"] for e in _log(run) if e["event"] == "train"]
    assert lrs[1] > lrs[2] > lrs[3] > lrs[4]  # warmup over 2 steps, then the cosine decay over the time budget


def test_replace_dir_recovers_from_leftovers(tmp_path):
    """spire.paths.replace_dir after a crash: a leftover <path>.old alone (killed between the renames) is
    what existing_dir finds; a leftover .old beside the new folder, or a temporary folder of an interrupted
    write, does not stop the next replace, which leaves the new folder only."""
    from spire.paths import existing_dir, replace_dir

    def writer(text):
        return lambda tmp: (tmp / "f.txt").write_text(text)

    path = tmp_path / "ck"
    assert existing_dir(path) is None
    replace_dir(path, writer("1"))
    os.replace(path, tmp_path / "ck.old")  # killed between the renames
    assert existing_dir(path) == tmp_path / "ck.old" and (existing_dir(path) / "f.txt").read_text() == "1"
    replace_dir(path, writer("2"))
    assert (path / "f.txt").read_text() == "2" and not (tmp_path / "ck.old").exists()
    shutil.copytree(path, tmp_path / "ck.old")  # killed before the old folder's removal
    stale = tmp_path / ".ck.12345.tmp"  # killed while the new folder was written
    stale.mkdir()
    (stale / "f.txt").write_text("partial")
    assert existing_dir(path) == path
    replace_dir(path, writer("3"))
    assert (path / "f.txt").read_text() == "3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    with pytest.raises(RuntimeError):  # a writer that fails leaves the old folder and no temporary one
        replace_dir(path, lambda tmp: (_ for _ in ()).throw(RuntimeError("disk full")))
    assert (path / "f.txt").read_text() == "3" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny, monkeypatch):
    calls = {"n": 0}
    real = distill.mixed_loss_logp

    def poisoned(q, p, omega, kernel=True):
        calls["n"] += 1
        terms = real(q, p, omega, kernel)
        if calls["n"] == 4:
            terms.loss = terms.loss * float("nan")
        return terms

    set_in_training("mixed_loss_logp", poisoned, monkeypatch)
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
                                   if k not in ("draft", "ablation", "draft_config", "omega", "loss")},
                          draft_config=SpireConfig(n_draft_layers=2, window=8))
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
@pytest.mark.slow
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
    ranks = [torch.load(tmp_path / "ddp" / f"rank{i}.pt", weights_only=True) for i in (0, 1)]
    one = torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)
    assert ranks[0]["world"] == 2 and one["world"] == 1
    assert ranks[0]["params"].keys() == one["params"].keys() and one["params"]
    for name, value in one["params"].items():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name  # in sync, bit for bit
        # the 2-process gradient is a mean of two half-batch means: equal up to float32 rounding, compared at the
        # tensor's scale: AdamW divides by sqrt(v), so an entry whose true gradient is 0 moves by rounding noise
        # times ~lr, differently for each split of the batch (seen: 6e-6 of the scale); a missing all-reduce moves
        # entries by ~lr = 3e-3 a step (~5e-3 of the scale), 100x the bound
        scale = float(value.abs().max())
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=0, atol=5e-5 * scale, msg=name)
    ddp, ref = _train_losses(tmp_path / "ddp"), _train_losses(tmp_path / "one")
    assert sorted(ddp) == list(range(1, 7))
    for step in ddp:
        assert ddp[step] == pytest.approx(ref[step], rel=1e-5), step


def test_resume_takes_the_saved_settings(tmp_path, tiny):
    """`spire train --resume` rebuilds the run's config from its checkpoint; only the limits are new."""
    from spire.commands.train import saved_config

    cfg = config("spire", 2, 2)
    cfg.lr, cfg.seq_len = 2e-3, 16
    train_draft(tiny, RepeatingData(), tmp_path, cfg, progress=False)
    again = saved_config(tmp_path, {"max_steps": 3, "checkpoint_every": 5.0})
    assert (again.lr, again.seq_len, again.max_steps, again.checkpoint_every) == (2e-3, 16, 3, 5.0)
    assert again.draft_config == cfg.draft_config
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


def test_resume_a_run_saved_before_a_draft_setting_existed(tmp_path, tiny):
    """A field added to the draft's own config (here SpireConfig.bridge) reads as its default in a checkpoint
    written before it: the run resumes; resuming it with other draft settings is refused, naming them."""
    import json as _json

    train_draft(tiny, RepeatingData(), tmp_path, config("spire", 2, 2), progress=False)
    state_file = tmp_path / "checkpoint" / "train_state.json"
    saved = _json.loads(state_file.read_text())
    assert saved["config"]["spire"]["bridge"] is False and "vocab_from" not in saved["config"]["spire"]
    del saved["config"]["spire"]["bridge"]
    state_file.write_text(_json.dumps(saved))
    _, state = train_draft(tiny, RepeatingData(), tmp_path, config("spire", 3, 2), resume=True, progress=False)
    assert state["step"] == 3
    changed = config("spire", 4, 2)
    changed.draft_config.sink = 2
    with pytest.raises(ConfigError, match=r"other settings \(spire\)"):
        train_draft(tiny, RepeatingData(), tmp_path, changed, resume=True, progress=False)


@pytest.mark.slow
def test_spawned_processes_match_one_process(tmp_path, tiny):
    """spire.training.parallel (the main job's data parallelism, no torchrun): 2 spawned processes train on the
    same global batches as one process (weights equal up to float32 rounding), and the finished run loads
    in the calling process without training again."""
    from spire.training.parallel import train_in_processes
    from tests.train_worker import RepeatingData, config

    data = RepeatingData()
    heldout = data.seqs[:2]  # rank 0 evaluates (with both processes' threads) while rank 1 waits
    one, s1 = train_draft(tiny, data, tmp_path / "one", config("spire", 4, 4), heldout=heldout, progress=False,
                          log=None)
    two, s2 = train_in_processes(tiny, data, tmp_path / "two", config("spire", 4, 4), n_processes=2,
                                 heldout=heldout, progress=False, log=None)
    assert s1["step"] == s2["step"] == 4 and s2["finished"]
    assert s2["heldout"]["alpha_per_position"] == pytest.approx(s1["heldout"]["alpha_per_position"], rel=1e-4)
    ref = dict(one.named_parameters())
    for name, p in two.named_parameters():  # at the tensor's scale, as in the torchrun test above
        torch.testing.assert_close(p, ref[name], rtol=0, atol=5e-5 * float(ref[name].abs().max()), msg=name)
    mtime = (tmp_path / "two" / "checkpoint" / "train_state.json").stat().st_mtime
    again, s3 = train_in_processes(tiny, data, tmp_path / "two", config("spire", 4, 4), n_processes=2,
                                   progress=False, log=None)
    assert s3["step"] == 4 and (tmp_path / "two" / "checkpoint" / "train_state.json").stat().st_mtime == mtime
    with pytest.raises(ConfigError, match="divisible"):
        train_in_processes(tiny, data, tmp_path / "three", config("spire", 4, 3), n_processes=2, log=None)


def test_bridge_is_fitted_once_before_a_fresh_run_and_kept_on_resume(tmp_path, tiny, monkeypatch, one_thread):
    """A bridged SPIRe run fits its bridge before step 1 (a "bridge" log event with its layer and R², the fitted
    map the one fit_bridge gives on the seeded training windows); a resume keeps the trained bridge from its
    checkpoint and does not fit again; a random draft is not fitted (its stream is not the target's)."""
    cfg = config("spire", 2, 4)
    cfg.draft_config = SpireConfig(n_draft_layers=2, window=8, bridge=True)
    lines = []
    model, _ = train_draft(tiny, RepeatingData(), tmp_path / "run", cfg, progress=False, log=lines.append)
    events = [r for r in _log(tmp_path / "run") if r["event"] == "bridge"]
    assert len(events) == 1 and events[0]["layer"] == 0 and events[0]["step"] == 0 and 0 < events[0]["r2"] <= 1
    assert any("bridge into draft layer 0" in ln and "in-sample R²" in ln for ln in lines)
    fresh = SpireDraftModel(tiny, cfg.draft_config)
    rows = RepeatingData().sample_train_batch(32, cfg.seq_len, torch.Generator().manual_seed(cfg.seed))
    assert fresh.fit_bridge(rows) == pytest.approx(events[0]["r2"], abs=1e-9)
    assert not torch.equal(fresh.bridge.weight, torch.eye(tiny.cfg.d_model))
    trained = model.bridge.weight.detach().clone()

    def no_fit(*a, **kw):
        raise AssertionError("a resume must not fit the bridge again")
    monkeypatch.setattr(SpireDraftModel, "fit_bridge", no_fit)
    cfg.max_steps = 3
    model, state = train_draft(tiny, RepeatingData(), tmp_path / "run", cfg, resume=True, progress=False)
    assert state["step"] == 3 and not torch.equal(model.bridge.weight, trained)  # trained on from the checkpoint
    cfg2 = config("spire", 1, 4)
    cfg2.spire = SpireConfig(n_draft_layers=2, window=8, bridge=True, init="random")
    model, _ = train_draft(tiny, RepeatingData(), tmp_path / "random", cfg2, progress=False)  # fit_bridge raises
    assert not [r for r in _log(tmp_path / "random") if r["event"] == "bridge"]



class _CountedData(RepeatingData):
    """RepeatingData with the token counts a draft vocabulary is chosen from (``train.tokens``)."""

    def __init__(self, vocab=97, seed=0):
        super().__init__(vocab=vocab, seed=seed)
        self.train = type("Split", (), {"tokens": self.seqs.flatten().numpy()})()


def test_init_from_starts_a_fresh_run_from_a_trained_draft(tmp_path, tiny, one_thread):
    """TrainConfig.init_from (`spire train --init-from`): a fresh run starts from a trained draft's weights and draft
    vocabulary (a run folder's last checkpoint or a draft file), not from the target's layers, logs where from, and
    trains on; its resume reads its own checkpoint (the source may be gone by then). The setting is left out of
    the saved config when not given, so the identity (cache key) of every other run is unchanged. A draft of other
    settings, another kind or a missing path is refused before anything is written."""
    def spire_cfg(steps, window=8, init_from=None):
        cfg = config("spire", steps, 2)
        cfg.draft_config, cfg.init_from = SpireConfig(n_draft_layers=2, window=window, vocab_size=40), init_from
        return cfg

    first = spire_cfg(3)
    trained, _ = train_draft(tiny, _CountedData(), tmp_path / "a", first, progress=False)
    assert "init_from" not in first.to_dict()
    other_text = _CountedData(vocab=60, seed=5)  # a fresh draft would take another vocabulary from it
    assert not torch.equal(SpireDraftModel.for_training(tiny, first, other_text).vocab, trained.vocab)
    for source in (tmp_path / "a", tmp_path / "a" / "draft.safetensors"):
        trainer = distill.Trainer(tiny, other_text, tmp_path / f"b-{source.name}", spire_cfg(2, init_from=str(source)),
                                  None, None, None, None)
        start = trainer.model.state_dict()
        for name, t in trained.state_dict().items():
            assert torch.equal(start[name], t), name
    cfg = spire_cfg(2, init_from=str(tmp_path / "a"))
    model, state = train_draft(tiny, other_text, tmp_path / "b", cfg, progress=False)
    events = [r for r in _log(tmp_path / "b") if r.get("event") == "init"]
    assert len(events) == 1 and events[0]["from"] == str(tmp_path / "a" / "checkpoint" / "draft.safetensors")
    assert state["step"] == 2 and not torch.equal(_weights(model), _weights(trained))
    assert torch.equal(model.vocab, trained.vocab)
    saved = json.loads((tmp_path / "b" / "checkpoint" / "train_state.json").read_text())["config"]
    assert saved["init_from"] == str(tmp_path / "a")
    shutil.rmtree(tmp_path / "a")
    cfg.max_steps = 3
    _, state = train_draft(tiny, other_text, tmp_path / "b", cfg, resume=True, progress=False)
    assert state["step"] == 3

    train_draft(tiny, _CountedData(), tmp_path / "a", first, progress=False)
    with pytest.raises(CheckpointError, match=r"other SPIRe settings than the run: window 8 \(the run: 16\)"):
        train_draft(tiny, _CountedData(), tmp_path / "c", spire_cfg(2, 16, str(tmp_path / "a")), progress=False)
    spelled = spire_cfg(1, 8, str(tmp_path / "a"))  # the default layers written out: the same draft
    spelled.draft_config.layers = (tiny.cfg.n_layers - 2, tiny.cfg.n_layers - 1)
    train_draft(tiny, _CountedData(), tmp_path / "spelled", spelled, progress=False)
    mass = spire_cfg(2, 8, str(tmp_path / "a"))
    mass.draft_config.vocab_from = "mass"  # a setting saved only when it is not the default
    with pytest.raises(CheckpointError, match=r"settings than the run: vocab_from frequency \(the run: mass\)$"):
        train_draft(tiny, _CountedData(), tmp_path / "c", mass, progress=False)
    vanilla = config("vanilla", 2, 2)
    vanilla.init_from = str(tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"a SPIRe draft, not vanilla \(--draft spire\)"):
        train_draft(tiny, _CountedData(), tmp_path / "c", vanilla, progress=False)
    train_draft(tiny, _CountedData(), tmp_path / "v", config("vanilla", 1, 2), progress=False)
    two = config("vanilla", 2, 2)
    two.draft_config, two.init_from = VanillaConfig(2), str(tmp_path / "v")
    with pytest.raises(CheckpointError, match=r"other vanilla settings than the run: n_layers 1 \(the run: 2\)$"):
        train_draft(tiny, _CountedData(), tmp_path / "c", two, progress=False)
    export = tmp_path / "v" / "draft"  # the vanilla export (an HF folder), and its weights file: not a checkpoint
    for bad, needle in ((export, "an exported draft folder; give the run folder"),
                        (export / "model.safetensors", "not a draft file of spire's trainer")):
        vanilla.init_from = str(bad)
        with pytest.raises(ConfigError, match=needle):
            train_draft(tiny, _CountedData(), tmp_path / "c", vanilla, progress=False)
    with pytest.raises(ConfigError, match="--init-from .*nowhere: the path does not exist"):
        train_draft(tiny, _CountedData(), tmp_path / "c", spire_cfg(2, 8, str(tmp_path / "nowhere")), progress=False)
    assert not (tmp_path / "c").exists()
