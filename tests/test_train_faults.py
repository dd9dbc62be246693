"""Training never loses work and never loads what it should not (issue 52), one test per class of fault: run
folders that are not spire's and a second writer, non-finite steps, HF folders read by glob, resume (a torn log,
a new horizon, a budget-finished run, text identity, another device), data parallelism (waits on rank 0, the
valid-token normalization, batches without a valid target) and identity checks by content. Tiny settings: the
random tiny target of tests/conftest.py, seconds each. The kill-and-resume suite is tests/test_kill_resume.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from spire.errors import CheckpointError, ConfigError, TrainingError
from spire.training import distill
from tests.helpers import set_in_training
from spire.training.distill import load_state, train_draft
from tests.conftest import make_tiny
from tests.train_worker import RepeatingData, config


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _log_steps(run: Path) -> list[int]:
    rows = [json.loads(ln) for ln in (run / "train_log.jsonl").read_text().splitlines() if ln.strip()]
    return [r["step"] for r in rows if r["event"] == "train"]


# ------------------------------------------------------------------------------------------ run folders

def test_a_new_run_refuses_a_folder_of_other_files_and_touches_nothing(tmp_path, tiny):
    run = tmp_path / "mine"
    run.mkdir()
    (run / "notes.txt").write_text("the user's own notes")
    (run / "train_log.jsonl").write_text("")  # a name spire writes is not what makes it refuse
    before = _files(run)
    with pytest.raises(ConfigError, match=r"holds 'notes.txt'.*not a spire run's"):
        train_draft(tiny, RepeatingData(), run, config("spire", 2, 2), progress=False, log=None)
    assert _files(run) == before and sorted(p.name for p in run.iterdir()) == ["notes.txt", "train_log.jsonl"]


def test_a_second_writer_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path, tiny):
    run = tmp_path / "run"
    train_draft(tiny, RepeatingData(), run, config("spire", 2, 2), progress=False, log=None)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, json, os, socket, sys, time\n"
        f"f = open({str(run / 'train.lock')!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "f.truncate(0); f.write(json.dumps({'pid': os.getpid(), 'host': socket.gethostname()})); f.flush()\n"
        "print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _files(run)
        with pytest.raises(ConfigError, match=rf"in use by another `spire train` \(pid {holder.pid} on host"):
            train_draft(tiny, RepeatingData(), run, config("spire", 4, 2), resume=True, progress=False, log=None)
        assert _files(run) == before  # the second writer wrote nothing
    finally:
        holder.kill()
        holder.wait()
    notes: list[str] = []
    _, state = train_draft(tiny, RepeatingData(), run, config("spire", 4, 2), resume=True, progress=False,
                           log=notes.append)
    assert state["step"] == 4
    assert any(f"left by pid {holder.pid}" in n and "took over" in n for n in notes), notes


# ------------------------------------------------------------------------------------------ non-finite steps

class _InfGrad(torch.autograd.Function):
    """Identity forward, an infinite gradient backward: a finite loss whose step has a non-finite gradient norm."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def test_a_non_finite_gradient_norm_stops_before_the_update(tmp_path, tiny, monkeypatch):
    calls, real = {"n": 0}, distill.step_loss

    def poisoned(*a, **kw):
        loss, alpha = real(*a, **kw)
        calls["n"] += 1
        return (_InfGrad.apply(loss) if calls["n"] == 4 else loss), alpha

    set_in_training("step_loss", poisoned, monkeypatch)
    with pytest.raises(TrainingError, match=r"non-finite gradient norm \(.*\) at step 4 .*checkpoint \(step 3\)"):
        train_draft(tiny, RepeatingData(), tmp_path, config("spire", 8, 2, 0.0), progress=False, log=None)
    assert load_state(tmp_path)["step"] == 3
    from safetensors.torch import load_file

    for f in (tmp_path / "checkpoint" / "draft.safetensors", tmp_path / "draft.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(f).values())


def test_weights_that_are_not_finite_are_never_written(tmp_path, tiny):
    from spire.drafts.vanilla import VanillaDraftModel, save_vanilla
    from spire.formats.draft_file import write_draft_file

    with pytest.raises(CheckpointError, match="'w' holds NaN"):
        write_draft_file(tmp_path / "d.safetensors", {"w": torch.tensor([1.0, float("nan")])}, {})
    assert not any(tmp_path.iterdir())
    model = distill._build_model(tiny, config("vanilla", 2, 2))
    assert isinstance(model, VanillaDraftModel) and model.cfg.n_layers == 1
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        save_vanilla(model, tmp_path / "draft", None, {})
    assert not any(tmp_path.iterdir())


def test_a_non_finite_final_heldout_loss_is_an_error_and_keeps_the_last_checkpoint(tmp_path, tiny, monkeypatch):
    real = distill.evaluate_heldout

    def diverged(*a, **kw):
        ev = real(*a, **kw)
        return {**ev, "loss": float("nan")}

    set_in_training("evaluate_heldout", diverged, monkeypatch)
    data = RepeatingData()
    with pytest.raises(TrainingError, match=r"non-finite held-out loss \(nan\).*at step 3.*checkpoint \(step 2\)"):
        train_draft(tiny, data, tmp_path, config("spire", 3, 2, 0.0), heldout=data.seqs[:2], progress=False,
                    log=None)
    state = load_state(tmp_path)
    assert state["step"] == 2 and state["finished"] is False  # the last good checkpoint; the final one not written


def test_a_non_finite_draft_distribution_is_verified_not_a_traceback():
    from spire.params import SamplingParams
    from spire.sampling import probs_from_logits, sample
    from spire.verification import verify

    V = 8
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[1, 2] = float("nan")  # the draft diverged at its second position
    q = probs_from_logits(logits, SamplingParams(temperature=0.8))
    assert torch.isfinite(q).all() and torch.allclose(q.sum(-1), torch.ones(3))
    assert torch.equal(q[1], torch.nn.functional.one_hot(logits[1].nan_to_num(float("-inf")).argmax(), V).float())
    tokens = sample(q, torch.Generator().manual_seed(1))  # the old code raised inside torch.multinomial here
    # verification against the target keeps its distribution: the position-1 output is distributed as p
    p = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(2)), -1)
    g, counts = torch.Generator().manual_seed(3), torch.zeros(V)
    draft = tokens.clone()
    for _ in range(4000):
        draft[1] = sample(q[1:2], g)[0]
        n, nxt = verify(draft[None, 1:2], q[None, 1:2], p[None, 1:3], g)
        counts[draft[1] if n.item() == 1 else nxt.item()] += 1
    assert (counts / 4000 - p[1]).abs().max() < 0.03  # 4,000 draws: 4.5 standard errors at p = 0.5
    greedy = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert torch.equal(greedy.sum(-1), torch.ones(3))


# ------------------------------------------------------------------------------------------ HF folders

def _hf_tiny(folder: Path, dtype: str = "float32", shard: str | None = None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                      tie_word_embeddings=False, initializer_range=0.2)
    model = LlamaForCausalLM(cfg)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kw)
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config))


def test_a_sharded_folder_is_read_by_its_index_as_transformers_reads_it(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from spire.loading import load_model

    folder = tmp_path / "hf"
    _hf_tiny(folder, shard="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # sharded
    # a stale shard left beside the index, sorting after every real one, with other values for the same names
    save_file({"model.embed_tokens.weight": torch.ones(97, 32), "lm_head.weight": torch.ones(97, 32)},
              str(folder / "zz-stale.safetensors"))
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids).logits
        got = load_model(folder)(ids, torch.arange(6)[None]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    name = sorted(set(index["weight_map"].values()))[-1]
    (folder / name).rename(folder / "moved.bin")
    with pytest.raises(CheckpointError, match=f"names {name}, which is not in"):
        load_model(folder)


def test_a_vanilla_draft_folder_holds_only_its_own_files(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    from spire.drafts.vanilla import save_vanilla
    from spire.loading import load_model

    target_folder = tmp_path / "target"
    _hf_tiny(target_folder, dtype="bfloat16", shard="20KB")  # an index naming shards the draft will not hold
    (target_folder / "pytorch_model.bin").write_bytes(b"stale")
    (target_folder / "tokenizer_config.json").write_text("{}")
    target = load_model(target_folder)
    model = distill._build_model(target, config("vanilla", 2, 2))
    save_vanilla(model, tmp_path / "draft", target_folder, {})
    names = sorted(p.name for p in (tmp_path / "draft").iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "spire_train.json",
                     "tokenizer_config.json"]
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["torch_dtype"] == "float32"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")  # transformers reads it as it is
    assert hf.dtype == torch.float32 and hf.config.num_hidden_layers == model.cfg.n_layers


# ------------------------------------------------------------------------------------------ resume

def test_a_torn_log_tail_is_dropped_with_a_note(tmp_path, tiny):
    train_draft(tiny, RepeatingData(), tmp_path, config("spire", 3, 2, 0.0), progress=False, log=None)
    with open(tmp_path / "train_log.jsonl", "a") as f:
        f.write('{"event": "train", "step": 4, "tok')  # a crash (or a full disk) in the middle of a line
    notes: list[str] = []
    _, state = train_draft(tiny, RepeatingData(), tmp_path, config("spire", 5, 2, 0.0), resume=True,
                           progress=False, log=notes.append)
    assert state["step"] == 5 and any("dropped 1 torn line" in n for n in notes), notes
    assert _log_steps(tmp_path) == [1, 2, 3, 4, 5]


def test_new_limits_on_resume_say_how_the_schedule_changes_and_a_budget_finished_run_trains_more(tmp_path, tiny,
                                                                                              monkeypatch):
    from spire.commands.train import saved_config
    from tests.train_worker import TickClock

    set_in_training("time", TickClock(), monkeypatch)  # every step takes 1 s: the budget ends at step 3
    run = tmp_path / "budget"
    _, state = train_draft(tiny, RepeatingData(), run, config("spire", None, 2, budget_s=3.0), progress=False,
                           log=None)
    assert state["step"] == 3 and state["finished"]
    notes: list[str] = []
    cfg = saved_config(run, {"max_steps": 5}, log=notes.append)
    assert any("horizon changes from the 3 s time budget to 5 steps" in n for n in notes), notes
    assert any("ended at its 3 s time budget at step 3: it now trains to step 5" in n for n in notes), notes
    _, state = train_draft(tiny, RepeatingData(), run, cfg, resume=True, progress=False, log=None)
    assert state["step"] == 5 and _log_steps(run) == [1, 2, 3, 4, 5]
    notes.clear()
    saved_config(run, {"max_steps": 9}, log=notes.append)
    assert [n for n in notes if "horizon" in n] == [
        "note: --max-steps 9 on resume: the learning-rate schedule's horizon changes from 5 steps to 9 steps; from "
        "step 5 on the cosine decay follows the new horizon (a run given --max-steps 9 from the start would have "
        "decayed differently)"]


def test_the_texts_identity_is_its_content(tmp_path):
    from spire.data import prepare_text_files

    class Chars:  # a tokenizer of one id per character
        eos_token_id = 0

        def get_vocab(self):
            return {chr(i): 1 + i % 200 for i in range(256)}

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[1 + ord(c) % 200 for c in t] for t in texts]}

    text = tmp_path / "text"
    text.mkdir()
    for n in range(4):
        (text / f"f{n}.txt").write_text(f"document {n} " * 40)
    cache = tmp_path / "cache"
    key = prepare_text_files(Chars(), [text], cache_dir=cache, progress=False).manifest["key"]
    st = (text / "f1.txt").stat()
    os.utime(text / "f1.txt", ns=(st.st_atime_ns + 10**9, st.st_mtime_ns + 10**9))  # a touch: the same text
    assert prepare_text_files(Chars(), [text], cache_dir=cache, progress=False).manifest["key"] == key
    (text / "f1.txt").write_text(f"DOCUMENT {1} " * 40)  # a same-size edit, its time put back
    os.utime(text / "f1.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = prepare_text_files(Chars(), [text], cache_dir=cache, progress=False)
    assert changed.manifest["key"] != key  # re-tokenized: the new text's "D" (id 69) is in it
    assert int((changed.train.tokens == 69).sum()) + int((changed.heldout.tokens == 69).sum()) > 0


def _on_cuda(path: Path) -> None:
    """Rewrite a torch.save file so that its tensors say they were saved on cuda:0 (a GPU run's optimizer.pt)."""
    z = zipfile.ZipFile(path)
    names = z.namelist()
    pkl = next(n for n in names if n.endswith("data.pkl"))
    data = z.read(pkl)
    assert b"X\x03\x00\x00\x00cpu" in data
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
        for n in names:
            w.writestr(n, data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0") if n == pkl else z.read(n))
    z.close()
    path.write_bytes(out.getvalue())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a GPU-written checkpoint read where there is no GPU")
def test_a_checkpoint_written_on_a_gpu_resumes_on_a_cpu(tmp_path, tiny, one_thread):
    class Stopping(RepeatingData):  # Ctrl-C in step 3, after the checkpoint of step 2
        calls = 0

        def sample_train_batch(self, *a):
            Stopping.calls += 1
            if Stopping.calls == 3:
                raise KeyboardInterrupt
            return super().sample_train_batch(*a)

    with pytest.raises(KeyboardInterrupt):
        train_draft(tiny, Stopping(), tmp_path / "a", config("spire", 4, 2, 0.0), progress=False, log=None)
    assert load_state(tmp_path / "a")["step"] == 2
    full, _ = train_draft(tiny, RepeatingData(), tmp_path / "b", config("spire", 4, 2, 0.0), progress=False,
                          log=None)
    _on_cuda(tmp_path / "a" / "checkpoint" / "optimizer.pt")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tmp_path / "a" / "checkpoint" / "optimizer.pt", weights_only=True)
    resumed, state = train_draft(tiny, RepeatingData(), tmp_path / "a", config("spire", 4, 2, 0.0), resume=True,
                                 progress=False, log=None)
    assert state["step"] == 4
    for (name, p), q in zip(resumed.named_parameters(), full.parameters()):
        assert torch.equal(p, q), name  # the AdamW moments came back whole, on this device


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ identity

def test_the_fingerprint_and_the_target_cache_key_cover_every_weight(tiny):
    from spire.fastpath import use_bf16_weights
    from spire.formats.draft_file import fingerprint, fingerprint_matches
    from spire.training.sources import target_identity

    stored = fingerprint(tiny)
    tuned = make_tiny()  # a fine-tune with a frozen embedding: one value of one layer's weight changed
    with torch.no_grad():
        tuned.model.layers[2].mlp.down_proj.weight.view(-1)[-1] += 1e-3
    assert torch.equal(tuned.model.embed_tokens.weight, tiny.model.embed_tokens.weight)
    assert not fingerprint_matches(stored, tuned)
    assert target_identity(tuned, None) != target_identity(tiny, None)
    assert fingerprint_matches(stored, make_tiny())  # the same target, loaded again
    assert fingerprint_matches(stored, make_tiny().to(torch.bfloat16))  # in another dtype
    rounded = make_tiny()
    use_bf16_weights(rounded)  # rounded in place
    assert fingerprint_matches(stored, rounded)
    assert fingerprint_matches(fingerprint(make_tiny().to(torch.bfloat16)), make_tiny())  # trained on bf16 copy


# ------------------------------------------------------------------------------------------ data parallel

def test_a_batch_without_a_valid_target_contributes_zero():
    from spire.training.losses import hard_target_loss

    z = torch.randn(2, 5, 7, requires_grad=True)
    for kernel in (True, False):
        loss = hard_target_loss(z, torch.full((2, 5), -100), kernel)
        loss.backward()
        assert float(loss.detach()) == 0.0 and torch.equal(z.grad, torch.zeros_like(z))
        z.grad = None


class VocabData(RepeatingData):
    """RepeatingData with token counts, from which a draft vocabulary is chosen (its most frequent tokens)."""

    def __init__(self):
        super().__init__()
        self.train = SimpleNamespace(tokens=self.seqs.flatten().numpy().copy())  # not a view: spawn moves seqs


@pytest.mark.slow
def test_processes_normalize_by_the_global_count_of_valid_targets(tmp_path, tiny):
    """Hard loss and a draft vocabulary of 24 of the 97 tokens: each process holds another count of valid targets;
    2 spawned processes follow one process's trajectory."""
    from spire.drafts.spire import SpireConfig
    from spire.training.parallel import train_in_processes

    def cfg():
        c = config("spire", 3, 4)
        c.loss, c.draft_config = "hard", SpireConfig(n_draft_layers=2, window=8, vocab_size=24)
        return c
    data = VocabData()
    one, _ = train_draft(tiny, data, tmp_path / "one", cfg(), progress=False, log=None)
    two, _ = train_in_processes(tiny, data, tmp_path / "two", cfg(), n_processes=2, progress=False, log=None)
    ref = dict(one.named_parameters())
    for name, p in two.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=5e-5 * float(ref[name].abs().max()), msg=name)


def _slow_cache_worker(rank: int, port: int, root: str) -> None:
    """Rank 0 builds the target cache 4 s longer than the process group's 2 s deadline."""
    import datetime

    import torch.distributed as dist

    from spire.training.sources import TargetCache

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SPIRE_CACHE=root)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    real = TargetCache.build.__func__

    def slow(cls, *a, **kw):
        if rank == 0 and not (Path(root) / "started").exists():
            (Path(root) / "started").write_text("")
            time.sleep(4)
        return real(cls, *a, **kw)
    TargetCache.build = classmethod(slow)
    try:
        tiny = make_tiny()
        c = config("spire", 2, 2)
        c.target_cache, c.data_steps = "float32", 2
        model = distill._build_model(tiny, c)
        src = distill.make_source(tiny, RepeatingData(), model, c, progress=False, log=None)
        assert src.batch(1).tokens.shape == (2, 32)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_no_process_waits_on_rank_0s_cache_build_under_the_groups_deadline(tmp_path):
    import torch.multiprocessing as mp

    from spire.training.parallel import _free_port

    mp.start_processes(_slow_cache_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
