"""The EAGLE-3 and n-gram drafts through the CLI, as a user runs them: `spire train --draft eagle3`, then
`spire generate --draft eagle3 --draft-path RUN` and `--draft ngram` equal to `--draft none` on prompts of mixed
lengths (the JSON contract of `spire generate`), `spire export` of the run, and the bad input the drafts issue
names (one `error:` line, exit 2, nothing written). A tiny random Llama with SmolLM2's tokenizer (seconds)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli
from tests.test_cli_train import text_file, tiny_folder, trained  # noqa: F401  (module fixtures)


def _train(folder, text, out, *extra):
    return ["train", "--draft", "eagle3", "--target", str(folder), "--data", str(text), "--out", str(out),
            "--max-steps", "2", "--batch-size", "2", "--seq-len", "16", "-k", "4", "--eval-windows", "2",
            "--eval-every", "0", "--no-bf16", "--device", "cpu", "--warmup-steps", "1", "--checkpoint-every", "0",
            "--eagle3-vocab", "512", *extra]


@pytest.fixture(scope="module")
def eagle3_run(tiny_folder, text_file, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("e3") / "run"
    from spire.cli import main

    try:
        main(_train(tiny_folder, text_file, out, "--eagle3-layers", "0,1,2"))
    except SystemExit as e:
        assert not e.code, f"exit {e.code}"
    return out


def _prompts(tmp_path):
    lines = ["river stone light", "the garden window in the morning letter quiet market winter bridge " * 3,
             "paper orange mountain silver kitchen river stone light garden window morning letter quiet market " * 6,
             "x"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _generate(capsys, folder, prompts, *draft):
    code, out, err = run_cli(capsys, "generate", "--target", str(folder), "--file", str(prompts),
                             "--max-new-tokens", "20", "--format", "json", *draft)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_generate_with_eagle3_and_ngram_equals_ad(capsys, tiny_folder, eagle3_run, tmp_path):  # noqa: F811
    """Greedy SD with the trained EAGLE-3 run folder and with the n-gram draft gives AD's tokens for every prompt of
    a batch of mixed lengths, with the JSON fields of the contract."""
    prompts = _prompts(tmp_path)
    ad = _generate(capsys, tiny_folder, prompts, "--draft", "none")
    e3 = _generate(capsys, tiny_folder, prompts, "--draft", "eagle3", "--draft-path", str(eagle3_run))
    ng = _generate(capsys, tiny_folder, prompts, "--draft", "ngram", "--ngram-min", "1", "--ngram-max", "3")
    assert len(ad["outputs"]) == 4 and all(len(o["token_ids"]) == 20 for o in ad["outputs"])
    for sd, name in ((e3, "eagle3"), (ng, "ngram")):
        assert sd["draft"] == name
        assert [o["token_ids"] for o in sd["outputs"]] == [o["token_ids"] for o in ad["outputs"]]
        assert [o["text"] for o in sd["outputs"]] == [o["text"] for o in ad["outputs"]]
        assert all({"token_ids", "text", "finish_reason", "tau"} <= set(o) for o in sd["outputs"])
        assert all(1.0 <= o["tau"] <= 5.0 for o in sd["outputs"])


@pytest.mark.slow
def test_export_names_a_loadable_verifier(capsys, tiny_folder, eagle3_run, tmp_path):  # noqa: F811
    """`spire export --draft eagle3` writes a speculators folder whose verifier is the target's checkpoint folder
    (absolute), which speculators can load without the network, and spire reads the export back."""
    out = tmp_path / "export"
    code, _, err = run_cli(capsys, "export", "--draft", "eagle3", "--draft-path", str(eagle3_run), "--target",
                           str(tiny_folder), "--out", str(out))
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_folder.resolve())
    prompts = _prompts(tmp_path)
    ad = _generate(capsys, tiny_folder, prompts, "--draft", "none")
    back = _generate(capsys, tiny_folder, prompts, "--draft", "eagle3", "--draft-path", str(out))
    assert [o["token_ids"] for o in back["outputs"]] == [o["token_ids"] for o in ad["outputs"]]


@pytest.mark.slow
def test_export_of_the_preset_names_its_checkpoint_folder(capsys, text_file, tmp_path, smollm2):  # noqa: F811
    """For the embedded preset the verifier is the converted checkpoint folder, not the preset's name (which
    speculators would look up on the HF hub)."""
    from spire.loading import resolve_checkpoint

    run, out = tmp_path / "run", tmp_path / "export"
    code, _, err = run_cli(capsys, *_train("smollm2-135m", text_file, run, "--max-steps", "1", "--batch-size", "1"))
    assert code == 0, err
    code, _, err = run_cli(capsys, "export", "--draft", "eagle3", "--draft-path", str(run), "--out", str(out))
    assert code == 0, err
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(resolve_checkpoint(progress=False).resolve())
    assert (resolve_checkpoint(progress=False) / "config.json").is_file()


def _one_error(code, err, match):
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], err


@pytest.mark.slow
def test_bad_eagle3_and_ngram_input_is_one_error_line(capsys, tiny_folder, text_file, eagle3_run,  # noqa: F811
                                                      tmp_path, smollm2):
    """Layer ids outside the target, a count other than three, a resume that changes the EAGLE-3 settings, an
    EAGLE-3 draft of another target, `--draft eagle3` without a draft, a speculators folder of another algorithm,
    and n-gram bounds out of order: each one `error:` line, exit 2, nothing written."""
    prompts = _prompts(tmp_path)
    for layers, match in (("0,1,9", "layer ids"), ("0,1", "exactly three")):
        out = tmp_path / f"bad{layers}"
        _one_error(*run_cli(capsys, *_train(tiny_folder, text_file, out, "--eagle3-layers", layers))[:3:2], match)
        assert not out.exists()
    state = (eagle3_run / "checkpoint" / "train_state.json").read_bytes()
    _one_error(*run_cli(capsys, "train", "--resume", "--draft", "eagle3", "--target", str(tiny_folder), "--data",
                        str(text_file), "--out", str(eagle3_run), "--device", "cpu", "--eagle3-layers",
                        "0,1,1")[:3:2], "--eagle3-layers")
    assert (eagle3_run / "checkpoint" / "train_state.json").read_bytes() == state
    # the run was trained for the tiny target, not for SmolLM2-135M (same tokenizer, other weights)
    _one_error(*run_cli(capsys, "generate", "--file", str(prompts), "--max-new-tokens", "4", "--draft", "eagle3",
                        "--draft-path", str(eagle3_run))[:3:2], "")
    _one_error(*run_cli(capsys, "generate", "--target", str(tiny_folder), "--file", str(prompts),
                        "--max-new-tokens", "4", "--draft", "eagle3", "--draft-path",
                        str(tmp_path / "missing"))[:3:2], "")
    other = tmp_path / "other-algorithm"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"speculators_model_type": "mlp_speculator",
                                                   "speculators_version": "0.9.0"}))
    _one_error(*run_cli(capsys, "generate", "--target", str(tiny_folder), "--file", str(prompts),
                        "--max-new-tokens", "4", "--draft", "eagle3", "--draft-path", str(other))[:3:2], "")
    _one_error(*run_cli(capsys, "generate", "--target", str(tiny_folder), "--file", str(prompts),
                        "--max-new-tokens", "4", "--draft", "ngram", "--ngram-min", "4", "--ngram-max",
                        "2")[:3:2], "--ngram-min")


@pytest.mark.slow
def test_a_draft_of_another_kind_is_one_error_line_in_generate_serve_and_tau(capsys, tiny_folder, trained,  # noqa: F811
                                                                             tmp_path):
    """`--draft eagle3 --draft-path` of a SPIRe draft file, and of an HF model folder (a vanilla draft), is the same
    one line in every command that decodes (:func:`spire.formats.draft_file.other_kind_error`), exit 2."""
    import socket

    root, _ = trained
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    commands = (["generate", "hi", "--max-new-tokens", "2"], ["serve", "--port", port, "--max-len", "64"],
                ["tau", "-L", "32", "-G", "2", "--n-contexts", "1", "--temperature", "0", "--no-progress"])
    for path, what, kind in ((root / "full" / "draft.safetensors", "a SPIRe draft", "spire"),
                             (tiny_folder, "an HF model folder", "vanilla")):
        for command in commands:
            code, _, err = run_cli(capsys, *command, "--target", str(tiny_folder), "--draft", "eagle3",
                                   "--draft-path", str(path))
            assert (code, err.splitlines()) == (2, [f"error: {path} is {what}, not an EAGLE-3 draft: give it as "
                                                    f"--draft {kind} --draft-path {path}"]), command


@pytest.mark.slow
def test_a_portfolio_without_a_trained_spire_draft_keeps_it_in_the_hint(capsys, tiny_folder, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    """`spire serve --draft ngram,spire` with no trained SPIRe draft in the cache: one line, exit 2, whose hint
    suggests no command that drops the n-gram draft: --draft-path goes to the portfolio's one kind that takes a
    path (:func:`spire.commands.serve.parse_drafts`), so the same --draft ngram,spire with --draft-path serves it."""
    import socket

    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    code, _, err = run_cli(capsys, "serve", "--target", str(tiny_folder), "--draft", "ngram,spire", "--port", port,
                           "--max-len", "64")
    assert (code, err.splitlines()) == (2, [
        "error: no trained SPIRe draft for this target in the cache: pass --draft-path (e.g. the run folder of "
        "`spire train`), or run the main job (`spire reproduce`), which leaves one in the cache"])


@pytest.mark.slow
def test_a_text_file_given_as_a_checkpoint_or_draft_says_it_is_a_file(capsys, tiny_folder, tmp_path):  # noqa: F811
    """A .txt file where a checkpoint or a draft is expected: one line saying it is a file, not what was expected,
    and what to give (it said "not an HF checkpoint folder", or the safetensors reader's "header too small")."""
    notes = tmp_path / "notes.txt"
    notes.write_text("river stone light\n")
    cases = ((["--target", str(notes)], f"{notes} is a file, not an HF checkpoint folder (give an HF folder, a .gguf "
                                        "file, 'smollm2-135m' or 'gemma3-270m')"),
             (["--draft", "spire"], f"{notes} is a file, not a draft checkpoint (give a `spire train` run folder or "
                                    "the draft .safetensors in it)"),
             (["--draft", "vanilla"], f"{notes} is a file, not a vanilla draft (give an HF folder, a .gguf file or a "
                                      "`spire train --draft vanilla` run folder)"),
             (["--draft", "eagle3"], f"{notes} is a file, not an EAGLE-3 draft (give a speculators folder, a `spire "
                                     "train --draft eagle3` run folder or a draft .safetensors)"))
    for args, line in cases:
        if args[0] == "--draft":
            args = ["--target", str(tiny_folder), *args, "--draft-path", str(notes)]
        code, out, err = run_cli(capsys, "generate", "hi", "--max-new-tokens", "2", *args)
        assert (code, out, err.splitlines()) == (2, "", [f"error: {line}"]), args


def test_k_beyond_a_sequence_is_one_error_line_giving_the_range(capsys, tiny_folder):  # noqa: F811
    """-k has an upper bound in every command that decodes, the engine's own: a sequence (a `spire serve` slot of
    --max-len positions) holds a prompt token, a new token and the k drafted ones, so k <= positions - 2 (the tiny
    target has 512). `-k 100000` is one line giving the range, exit 2, checked before the target's weights load (it
    was an error on the prompt's length after loading, or on --max-len); -k 0 likewise."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    target = ["--target", str(tiny_folder)]
    fit = "(a prompt token, a new token and k drafted tokens fit"
    for command, k, line in (
            (["generate", "hi", *target], "100000", f"-k must be in [1, 510] {fit} the target's 512 positions), "
                                                    "got 100000"),
            (["generate", "hi", *target], "0", "-k must be >= 1 (and at most the positions of a sequence - 2), got 0"),
            (["serve", *target, "--port", port], "100000", f"-k must be in [1, 2046] {fit} a slot of --max-len 2048 "
                                                           "positions), got 100000"),
            (["serve", *target, "--port", port, "--max-len", "5"], "4", f"-k must be in [1, 3] {fit} a slot of "
                                                                        "--max-len 5 positions), got 4"),
            (["tau", *target, "--no-progress"], "100000", f"-k must be in [1, 510] {fit} the target's 512 positions), "
                                                          "got 100000")):
        code, out, err = run_cli(capsys, *command, "-k", k)
        assert (code, out, err.splitlines()) == (2, "", [f"error: {line}"]), command
