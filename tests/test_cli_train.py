"""`spire train` (user text, --resume), `spire generate --file` at T > 0 and `spire compare`, in-process, on a
tiny random Llama that uses SmolLM2's tokenizer (an HF folder built here; seconds, not minutes)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import shutil

import pytest
import torch

from spire.cli import main
from spire.training import distill
from tests.helpers import run_cli as run, set_in_training

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")


@pytest.fixture(scope="module")
def tiny_folder(smollm2, tmp_path_factory):
    """An HF Llama folder: 2 random layers (d 64, 4 query heads over 2 KV heads) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spire.loading import resolve_checkpoint

    src = resolve_checkpoint(progress=False)
    folder = tmp_path_factory.mktemp("tiny-target")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, folder / name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    words = ("river stone light garden window morning letter quiet market winter bridge paper orange "
             "mountain silver kitchen").split()
    folder = tmp_path_factory.mktemp("text")  # the user's text: a folder of 8 small files
    for n in range(8):
        paras = [" ".join(words[(i * 7 + j * 3 + n) % len(words)] for j in range(60)) + "." for i in range(12)]
        (folder / f"notes{n}.txt").write_text("\n\n".join(paras))
    return folder


def _main(args) -> None:
    """main() in-process; a successful command exits with 0."""
    try:
        main(args)
    except SystemExit as e:
        assert not e.code, f"exit {e.code}"


def _train_args(folder, text, out, *extra):
    return ["train", "--target", str(folder), "--data", str(text), "--out", str(out), "--max-steps", "3",
            "--batch-size", "2", "--seq-len", "16", "-k", "4", "--n-draft-layers", "1", "--window", "8",
            "--eval-windows", "2", "--eval-every", "0", "--no-bf16", "--device", "cpu", "--warmup-steps", "1",
            "--checkpoint-every", "0", "--lr", "3e-3", *extra]


def _checkpoint_tensors(run_dir):
    from safetensors.torch import load_file

    ck = run_dir / "checkpoint"
    return load_file(ck / "draft.safetensors"), torch.load(ck / "optimizer.pt", weights_only=True)["state"]


@pytest.fixture(scope="module")
def trained(tiny_folder, text_file, tmp_path_factory):
    """`spire train` on the user's text file: one run of 3 steps, and one interrupted after 2 steps (a
    Ctrl-C in step 3) then resumed with `--resume` alone (the saved settings apply)."""
    root = tmp_path_factory.mktemp("runs")
    cache = tmp_path_factory.mktemp("spire-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPIRE_CACHE", str(cache))  # the tokenized user text goes here, not to ~/.cache/spire
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = {}
    try:
        _main(_train_args(tiny_folder, text_file, root / "full"))
        real, calls = distill.mixed_loss_logp, {"n": 0}

        def interrupted(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 3:  # a real SIGTERM (a scheduler's stop), which `spire train` turns into Ctrl-C's
                os.kill(os.getpid(), signal.SIGTERM)  # KeyboardInterrupt: one path for both from here
            return real(*a, **kw)

        set_in_training("mixed_loss_logp", interrupted, mp)
        with pytest.raises(SystemExit) as stopped, contextlib.redirect_stderr(io.StringIO()) as err:
            main(_train_args(tiny_folder, text_file, root / "resumed"))  # stopped in step 3
        assert stopped.value.code == 130  # as on Ctrl-C
        results["interrupt_stderr"] = err.getvalue()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is spire train's only while it runs
        set_in_training("mixed_loss_logp", real, mp)
        results["after_interrupt"] = json.loads((root / "resumed" / "checkpoint" / "train_state.json").read_text())
        _main(["train", "--resume", "--target", str(tiny_folder), "--data", str(text_file), "--out",
              str(root / "resumed"), "--device", "cpu"])  # the run's own settings, evaluation windows included
    finally:
        torch.set_num_threads(threads)
        mp.undo()
    return root, results


@pytest.mark.slow
def test_train_on_user_text_and_resume_exactly(trained):
    root, results = trained
    assert results["after_interrupt"]["step"] == 2
    summary = json.loads((root / "resumed" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["tokens"] == 3 * 2 * 16 and summary["draft"] == "spire"
    assert summary["draft_path"].endswith("draft.safetensors") and summary["heldout"]["alpha"] > 0
    state = json.loads((root / "resumed" / "checkpoint" / "train_state.json").read_text())
    assert state["config"]["seq_len"] == 16 and state["config"]["spire"]["n_draft_layers"] == 1  # the saved ones
    assert state["config"]["data"] and state["config"]["data"] == json.loads(
        (root / "full" / "checkpoint" / "train_state.json").read_text())["config"]["data"]  # the user's text
    (w, opt), (w0, opt0) = _checkpoint_tensors(root / "resumed"), _checkpoint_tensors(root / "full")
    assert w.keys() == w0.keys() and all(torch.equal(w[n], w0[n]) for n in w0)
    for i in opt0:
        assert all(torch.equal(opt[i][s], opt0[i][s]) for s in opt0[i])
    logged = [json.loads(ln) for ln in (root / "resumed" / "train_log.jsonl").read_text().splitlines()]
    full = [json.loads(ln) for ln in (root / "full" / "train_log.jsonl").read_text().splitlines()]
    keep = ("event", "step", "tokens", "lr", "loss", "alpha", "grad_norm")
    assert [{k: e.get(k) for k in keep} for e in logged] == [{k: e.get(k) for k in keep} for e in full]
    assert [e["step"] for e in logged if e["event"] == "train"] == [1, 2, 3]


@pytest.mark.slow
def test_generate_from_a_file_at_temperature(tiny_folder, trained, tmp_path, capsys):
    """`generate --file` with the trained SPIRe draft at T = 0.8, top-k 5: one output per non-empty line,
    every token among the target's 5 most likely at its context, the same seed gives the same output."""
    from spire.loading import load_target

    root, _ = trained
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The river and the stone\n\nA quiet market in winter\n")
    args = ["generate", "--file", str(prompts), "--target", str(tiny_folder), "--draft", "spire", "--draft-path",
            str(root / "full" / "draft.safetensors"), "--temperature", "0.8", "--top-k", "5", "--seed", "3",
            "--max-new-tokens", "12", "--format", "json"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    obj = json.loads(out)
    assert obj["draft"] == "spire" and len(obj["outputs"]) == 2 and 1.0 <= obj["tau"] <= 5.0
    model, tok, _ = load_target(str(tiny_folder), progress=False)
    for line, o in zip(["The river and the stone", "A quiet market in winter"], obj["outputs"]):
        assert o["finish_reason"] in ("stop", "length") and 0 < len(o["token_ids"]) <= 12
        ids = tok(line).input_ids + o["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0]
        top5 = logits.topk(5, dim=-1).indices
        n = len(ids) - len(o["token_ids"])
        for t, y in enumerate(o["token_ids"]):
            assert y in top5[n - 1 + t].tolist(), (t, y)
        assert o["text"] == tok.decode(o["token_ids"], skip_special_tokens=True)
    assert run(capsys, *args)[1] == out  # reproducible with --seed
    code, text_out, err = run(capsys, *args[:-2])  # plain text: the outputs, separated by a blank line
    assert code == 0 and text_out.split("\n\n")[0].strip() == obj["outputs"][0]["text"].strip()
    assert "tau" in err


@pytest.mark.slow
def test_compare_reports_identical_in_float32(tiny_folder, trained, capsys):
    root, _ = trained
    code, out, err = run(capsys, "compare", "The river and the stone", "A letter", "--target", str(tiny_folder),
                         "--draft", "spire", "--draft-path", str(root / "full" / "draft.safetensors"),
                         "--dtype", "float32", "--max-new-tokens", "16")
    assert code == 0, err
    assert out.splitlines() == ["prompt 0: identical to AD (float32)", "prompt 1: identical to AD (float32)"]
    code, out, err = run(capsys, "compare", "The river and the stone", "--target", str(tiny_folder), "--draft",
                         "magicdec", "--max-new-tokens", "16")
    assert code == 0, err
    assert re.fullmatch(r"prompt 0: (identical to AD|first divergence at generated token \d+; target top-2 "
                        r"logit gap there \d+\.\d{4}) \(bfloat16\)\n", out), out


@pytest.mark.slow
def test_resume_keeps_the_run_settings_and_refuses_changed_ones(tiny_folder, text_file, trained, capsys):
    """A resumed run keeps its own intervals and held-out windows (not the command's defaults), and a resume
    that also changes a training setting is refused with one line naming it, the run left as it was."""
    root, _ = trained
    state = json.loads((root / "resumed" / "checkpoint" / "train_state.json").read_text())
    assert state["config"]["eval_every"] == 0 and state["config"]["checkpoint_every"] == 0
    assert state["heldout_windows"] == 2
    before = (root / "resumed" / "checkpoint" / "train_state.json").read_bytes()
    with pytest.raises(SystemExit) as e:
        main(["train", "--resume", "--target", str(tiny_folder), "--data", str(text_file), "--out",
              str(root / "resumed"), "--device", "cpu", "--lr", "0.5", "--window", "4"])
    assert e.value.code
    err = capsys.readouterr().err
    assert "lr" in err and "--window" in err and "--resume" in err
    assert (root / "resumed" / "checkpoint" / "train_state.json").read_bytes() == before
    with pytest.raises(SystemExit) as e:  # another kind's option: named as such, not as a changed setting
        main(["train", "--resume", "--target", str(tiny_folder), "--data", str(text_file), "--out",
              str(root / "resumed"), "--device", "cpu", "--vanilla-layers", "2"])
    assert e.value.code
    assert capsys.readouterr().err.strip() == "error: --vanilla-layers: an option of --draft vanilla, not of --draft spire"
    for flag, name in ((["--draft", "vanilla"], "draft"), (["--ablation", "omega1"], "ablation")):
        # a SPIRe run resumed as another draft or ablation: refused too (it used to be ignored silently)
        with pytest.raises(SystemExit) as e:
            main(["train", "--resume", "--target", str(tiny_folder), "--data", str(text_file), "--out",
                  str(root / "resumed"), "--device", "cpu", *flag])
        assert e.value.code
        err = capsys.readouterr().err
        assert f"differ from them: {name}" in err and len(err.strip().splitlines()) == 1
        assert (root / "resumed" / "checkpoint" / "train_state.json").read_bytes() == before


@pytest.mark.slow
def test_a_run_saved_without_its_texts_identity_resumes(tiny_folder, text_file, trained, tmp_path, monkeypatch):
    """A run saved with "data": null (as `spire reproduce` trains, and as runs older than the field were saved)
    resumes with its settings as saved (it was refused as "a run with other settings (data)")."""
    import shutil

    root, _ = trained
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    shutil.copytree(root / "full", tmp_path / "old")
    state_file = tmp_path / "old" / "checkpoint" / "train_state.json"
    state = json.loads(state_file.read_text())
    state["config"]["data"] = None
    state_file.write_text(json.dumps(state))
    main_args = ["train", "--resume", "--target", str(tiny_folder), "--data", str(text_file), "--out",
                 str(tmp_path / "old"), "--device", "cpu", "--max-steps", str(state["step"] + 1)]
    with pytest.raises(SystemExit) as e:
        main(main_args)
    assert e.value.code in (0, None)
    again = json.loads(state_file.read_text())
    assert again["step"] == state["step"] + 1 and again["config"]["data"] is None


@pytest.mark.slow
def test_resume_on_other_text_and_damaged_checkpoints_are_one_error(tiny_folder, text_file, trained, tmp_path,
                                                                     capsys):
    """A resume given other text than the run's is told to give the run's own --data (it said "use another --out
    or delete it"); a damaged train_state.json a checkpoint without optimizer.pt or with a truncated
    draft.safetensors is one CheckpointError line (no traceback, no banner before it); a new run into the run's folder is refused in one line; the run folder is left as it was."""
    import shutil

    root, _ = trained
    other = tmp_path / "other"
    other.mkdir()
    for n in range(8):  # other text, enough documents to split into training and held-out text
        (other / f"o{n}.txt").write_text(" ".join(f"word{(i * 7 + n) % 50}" for i in range(1500)))
    base = ["train", "--resume", "--target", str(tiny_folder), "--out"]
    before = (root / "resumed" / "checkpoint" / "train_state.json").read_bytes()
    with pytest.raises(SystemExit) as e:
        main(base + [str(root / "resumed"), "--data", str(other), "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code and "was trained on other text than --data" in err and "own --data" in err, err
    assert (root / "resumed" / "checkpoint" / "train_state.json").read_bytes() == before
    with pytest.raises(SystemExit) as e:  # a new run into a run folder: one line, before the banner
        main(_train_args(tiny_folder, text_file, root / "resumed"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "already holds a run (step 3)" in err, err
    assert (root / "resumed" / "checkpoint" / "train_state.json").read_bytes() == before
    for damage, needle in (("state", "cannot read"), ("optimizer", "holds no optimizer.pt"),
                           ("draft", "cannot read draft checkpoint")):
        run = tmp_path / damage
        shutil.copytree(root / "resumed", run)
        if damage == "state":
            (run / "checkpoint" / "train_state.json").write_text("{bad json")
        elif damage == "optimizer":
            (run / "checkpoint" / "optimizer.pt").unlink()
        else:  # cut short
            weights = run / "checkpoint" / "draft.safetensors"
            weights.write_bytes(weights.read_bytes()[:1000])
        with pytest.raises(SystemExit) as e:
            main(base + [str(run), "--data", str(text_file), "--device", "cpu"])
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # (the text's tokenization bars may come first: another cache here)
        assert e.value.code == 2 and last.startswith("error: ") and needle in last, err
        assert "Traceback" not in err and "training a" not in err, err  # refused before the banner


def test_hidden_loss_option(tiny_folder, text_file, tmp_path, capsys, monkeypatch):
    """`--hidden-loss W` reaches the run's saved settings (and its log); a draft with one layer has no layer
    input to match, and a negative weight is impossible: one error line each, non-zero exit, no run folder."""
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    args = _train_args(tiny_folder, text_file, tmp_path / "h")
    layers = args.index("--n-draft-layers")
    args[layers + 1] = "2"
    _main(args + ["--hidden-loss", "0.5"])
    state = json.loads((tmp_path / "h" / "checkpoint" / "train_state.json").read_text())
    assert state["config"]["hidden_weight"] == 0.5 and state["step"] == 3
    capsys.readouterr()
    for bad, needle in ((["--n-draft-layers", "1", "--hidden-loss", "1"], "at least 2 draft layers"),
                        (["--hidden-loss", "-1"], "--hidden-loss must be a finite number >= 0")):
        out = tmp_path / f"bad{len(needle)}"
        base = _train_args(tiny_folder, text_file, out)
        i = base.index("--n-draft-layers")
        base = base[:i] + base[i + 2:]
        with pytest.raises(SystemExit) as e:
            main(base + bad)
        err = capsys.readouterr().err
        assert e.value.code and needle in err, err
        assert not out.exists()


def test_target_cache_none_is_the_live_target(tiny_folder, text_file, tmp_path, monkeypatch):
    """`--target-cache none` (as `spire reproduce` takes it) trains against the live target; it used to be
    refused with a message that listed `none` as allowed."""
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    _main(_train_args(tiny_folder, text_file, tmp_path / "live", "--max-steps", "1", "--target-cache", "none"))
    state = json.loads((tmp_path / "live" / "checkpoint" / "train_state.json").read_text())
    assert state["config"]["target_cache"] is None and state["step"] == 1


@pytest.mark.slow
def test_init_from_fine_tunes_a_trained_run(tiny_folder, text_file, trained, tmp_path, monkeypatch, capsys):
    """`spire train --init-from RUN` (given relative to the working folder): a fresh run whose saved settings hold
    RUN's absolute path and RUN's draft settings (1 layer, window 8, not given again here), which starts from RUN's
    last checkpoint (its log names the file) and trains its steps; an option that contradicts RUN is one error line
    naming it; a resume does not need RUN any more."""
    import shutil

    root, _ = trained
    shutil.copytree(root / "full", tmp_path / "src")
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    args = _train_args(tiny_folder, text_file, tmp_path / "tuned", "--max-steps", "1", "--init-from", "src")
    for flag in ("--n-draft-layers", "--window"):
        i = args.index(flag)
        del args[i:i + 2]
    _main(args)
    state = json.loads((tmp_path / "tuned" / "checkpoint" / "train_state.json").read_text())
    assert state["config"]["init_from"] == str(tmp_path / "src") and state["step"] == 1
    assert (state["config"]["spire"]["n_draft_layers"], state["config"]["spire"]["window"]) == (1, 8)
    log = [json.loads(ln) for ln in (tmp_path / "tuned" / "train_log.jsonl").read_text().splitlines()]
    assert [r["from"] for r in log if r.get("event") == "init"] == [str(tmp_path / "src" / "checkpoint" /
                                                                         "draft.safetensors")]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(args + ["--window", "16", "--out", str(tmp_path / "other")])
    err = capsys.readouterr().err.strip()
    assert e.value.code and err.endswith("has other SPIRe settings than the run: window 8 (the run: 16)"), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "other").exists()
    shutil.rmtree(tmp_path / "src")
    _main(["train", "--resume", "--target", str(tiny_folder), "--data", str(text_file), "--out", str(tmp_path / "tuned"),
           "--device", "cpu", "--max-steps", "2", "--init-from", "src"])  # the saved value, its draft gone
    assert json.loads((tmp_path / "tuned" / "checkpoint" / "train_state.json").read_text())["step"] == 2


@pytest.mark.slow
def test_compile_option_and_a_resume_that_changes_it(tiny_folder, text_file, tmp_path, monkeypatch):
    """`--compile` reaches the run (its saved settings and a "compile" log event before step 1); a resume may
    turn it off (it changes how a step runs, not what it computes: one of the limits a resume takes anew)."""
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)  # the plumbing, not inductor
    run_dir = tmp_path / "c"
    _main(_train_args(tiny_folder, text_file, run_dir, "--compile"))
    state = json.loads((run_dir / "checkpoint" / "train_state.json").read_text())
    assert state["config"]["compile"] is True and compiled == [{"dynamic": False}]
    log = [json.loads(ln) for ln in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [e["event"] for e in log[:3]] == ["backend", "compile", "train"] and log[2]["step"] == 1
    assert log[1]["compiled"] is True and log[0]["fused_block"] is True  # every fast path by default
    _main(["train", "--resume", "--target", str(tiny_folder), "--data", str(text_file), "--out", str(run_dir),
           "--device", "cpu", "--max-steps", "4", "--no-compile"])
    state = json.loads((run_dir / "checkpoint" / "train_state.json").read_text())
    assert state["step"] == 4 and state["config"]["compile"] is False and len(compiled) == 1


def test_backend_option_reaches_the_run_log_and_a_resume_may_change_it(tiny_folder, text_file, tmp_path,
                                                                       monkeypatch):
    """`spire --backend no-loss-kernel,no-fused-adamw train ...` trains that way and says so in the run log; the
    resume, with every fast path, logs its own choice (the results are the same to rounding, so a resume may
    change it)."""
    from spire.backend import ENV

    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ENV, raising=False)
    run_dir = tmp_path / "b"
    _main(["--backend", "no-loss-kernel,no-fused-adamw", *_train_args(tiny_folder, text_file, run_dir)])
    import os
    monkeypatch.setenv(ENV, os.environ[ENV])  # the option set it for this process: undone at the test's end
    assert os.environ[ENV] == "no-fused-adamw,no-loss-kernel"
    monkeypatch.setenv(ENV, "")
    _main(["train", "--resume", "--target", str(tiny_folder), "--data", str(text_file), "--out", str(run_dir),
           "--device", "cpu", "--max-steps", "4"])
    log = [json.loads(ln) for ln in (run_dir / "train_log.jsonl").read_text().splitlines()]
    chosen = [(e["step"], e["loss_kernel"], e["fused_adamw"], e["fused_block"]) for e in log
              if e["event"] == "backend"]
    assert chosen == [(0, False, False, True), (3, True, True, True)]


@pytest.mark.slow
def test_impossible_train_settings_are_one_line_each(tiny_folder, text_file, tmp_path, capsys, monkeypatch):
    """--out naming a file, --device cuda without CUDA, a --seq-len past the target's positions (the tiny target
    has 512) and negative --eval-windows: each one error line and a non-zero exit (they crashed with a traceback or
    trained), SPIRe options with --draft vanilla name themselves and their kind, draft layers, vocabulary and vanilla layers that the target cannot hold are refused before the banner, nothing written; the file given as --out is left as it was."""
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    cases = [(["--out", str(afile)], "is a file, not a folder"),
             (["--out", str(afile / "sub")], f"{afile} is a file, not a folder"),
             (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0, got 1, 0 and -1.0"),
             (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
             (["--seed", "99999999999999999999"], "--seed must be in [0, 2^40), got 99999999999999999999"),
             (["--seq-len", "1024"], "--seq-len 1024 exceeds the target's 512 positions"),
             (["--eval-windows", "-1"], "--eval-windows must be >= 0, got -1"),
             (["--batch-size", "0"], "error: --batch-size must be >= 1, got 0"),  # (it said "batch size ... seq_len")
             (["--seq-len", "18"], "error: --seq-len 18 must be a multiple of -k 4"),  # (it said "k=4")
             (["--max-steps", "0"], "error: --max-steps must be >= 1, got 0"),
             (["--omega", "2"], "error: --omega must be in [0, 1], got 2.0"),
             (["--draft", "vanilla", "--full-kv", "--no-feedback-memory", "--draft-vocab", "64"],
              "--n-draft-layers, --full-kv, --draft-vocab, --no-feedback-memory: options of --draft spire, not of --draft vanilla"),
             (["--draft", "vanilla", "--ablation", "omega1"], "--ablation omega1 applies to --draft spire only"),
             (["--layers", "0,99"], "draft layers must be distinct target layers in [0, "),
             (["--draft-vocab", "10000000"], "the draft vocabulary (10000000) is larger than the target's"),
             (["--draft-vocab", "64", "--draft-vocab-from", "counts"],
              "the draft vocabulary is chosen by frequency or mass (--draft-vocab-from), got 'counts'"),
             (["--draft-vocab-from", "mass"], "--draft-vocab-from mass chooses a draft vocabulary: give its size"),
             (["--init-from", str(tmp_path / "nowhere")], "nowhere: the path does not exist"),
             (["--init-from", str(tmp_path)], "folder holds no trained draft (checkpoint/draft.safetensors)")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "sees no CUDA device"))
    for bad, needle in cases:
        out = tmp_path / f"bad{len(needle)}"
        with pytest.raises(SystemExit) as e:
            main(_train_args(tiny_folder, text_file, out) + bad)
        err = capsys.readouterr().err
        assert e.value.code and needle in err and len(err.strip().splitlines()) == 1, err
        assert "Traceback" not in err and not out.exists()
    assert afile.read_text() == "keep me"
    vanilla = _train_args(tiny_folder, text_file, tmp_path / "v0")
    for spire_only in ("--n-draft-layers", "--window"):
        i = vanilla.index(spire_only)
        del vanilla[i: i + 2]
    with pytest.raises(SystemExit) as e:
        main(vanilla + ["--draft", "vanilla", "--vanilla-layers", "0"])
    err = capsys.readouterr().err
    assert e.value.code and err.strip() == "error: the vanilla draft needs 1 to 2 layers (the target's), got 0", err


def test_vocab_size_is_a_deprecated_alias_of_draft_vocab(monkeypatch, capsys):
    """`spire train --draft-vocab N` is the name `spire reproduce` gives the SPIRe draft vocabulary; the old
    --vocab-size still sets it, with one warning line on stderr, and is left out of --help."""
    import spire.commands.train as train_command

    seen = []
    monkeypatch.setattr(train_command, "run", lambda args, log: seen.append(args) or {"rank": 1})  # no training
    _main(["train", "--vocab-size", "1000"])
    assert capsys.readouterr().err.splitlines() == ["warning: --vocab-size is deprecated; use --draft-vocab"]
    _main(["train", "--draft-vocab", "1000"])
    assert capsys.readouterr().err == ""
    assert seen[0].draft_overrides == seen[1].draft_overrides == {"spire": {"vocab_size": 1000}}
    _main(["train", "--draft-vocab", "2000", "--vocab-size", "1000"])  # the new name wins
    assert seen[2].draft_overrides == {"spire": {"vocab_size": 2000}}
    _main(["train", "--draft-vocab", "0"])  # the whole vocabulary, as `spire reproduce --draft-vocab 0`
    assert seen[3].draft_overrides == {"spire": {"vocab_size": None}}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", "--vocab-size", "1000", "--help"])
    help_text = capsys.readouterr().out
    assert not e.value.code and "--draft-vocab" in help_text and "--vocab-size" not in help_text


def test_sigterm_during_spire_train_is_handled_as_ctrl_c():
    """In a process of its own: within `sigterm_as_interrupt`, a SIGTERM raises Terminated (a KeyboardInterrupt, so
    spire train's Ctrl-C path runs: the note, the lock given back, exit 130); outside it, the default action is back
    (the process dies by the signal)."""
    import subprocess
    import sys

    code = ("import os, signal\n"
            "from spire.commands.train import Terminated, sigterm_as_interrupt\n"
            "try:\n"
            "    with sigterm_as_interrupt():\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        import time; time.sleep(5)\n"
            "except KeyboardInterrupt as e:\n"
            "    print(type(e).__name__, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "import time; time.sleep(5)\n"
            "print('survived')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["Terminated"] and res.returncode == -signal.SIGTERM, (res.stdout, res.stderr)


@pytest.mark.slow
def test_sigterm_prints_the_interrupted_line_as_ctrl_c(trained):
    """A SIGTERM in step 3 (the fixture's) ends the run as Ctrl-C does: exit 130 (asserted there), and the same
    last line on stderr (:func:`spire.commands.train.interrupted_note`), naming the checkpoint that --resume goes on
    from."""
    root, results = trained
    out = root / "resumed"
    assert results["interrupt_stderr"].splitlines()[-1] == (
        f"interrupted: {out} holds its last checkpoint (step 2; one is written every --checkpoint-every seconds); "
        f"`spire train --resume --out {out}` goes on from there exactly")


@pytest.mark.slow
def test_resuming_a_finished_run_notes_no_schedule(tiny_folder, text_file, trained, tmp_path, capsys):
    """`--resume --max-steps 2` of a run finished at step 3 trains nothing: the line saying so comes after the
    banner, and no note on the learning-rate schedule's horizon (which no step would follow) comes before it."""
    root, _ = trained
    shutil.copytree(root / "full", tmp_path / "run")
    code, out, err = run(capsys, "train", "--resume", "--target", str(tiny_folder), "--data", str(text_file),
                         "--out", str(tmp_path / "run"), "--device", "cpu", "--max-steps", "2")
    lines = [ln for ln in err.splitlines() if not ln.startswith(("tokenize", "\r"))]
    assert code == 0 and "spire draft: 3 steps" in out, err
    assert [ln for ln in lines if "note" in ln or "horizon" in ln] == [], err
    assert lines[-1] == "      run: finished run found (3 steps), not trained again", err
