"""`spire generate`: the JSON contract, losslessness against --draft none, bad input."""

import json
import subprocess
import sys

import pytest

from tests.test_cli_train import tiny_folder  # noqa: F401  (a module fixture)

SPIRE = [sys.executable, "-m", "spire.cli", "generate"]

pytestmark = pytest.mark.slow  # each test runs `spire generate` on the embedded target in a subprocess


def _run(args, stdin=None):
    return subprocess.run(SPIRE + args, capture_output=True, text=True, input=stdin, timeout=600)


@pytest.fixture(scope="module")
def folder(smollm2):
    from spire.loading import resolve_checkpoint

    return str(resolve_checkpoint(progress=False))


def test_json_contract_and_greedy_equals_ad(folder):
    prompts = ["The capital of France is", "def add(a, b):"]
    outs = {}
    for draft in ("none", "magicdec", "vanilla"):
        extra = ["--draft-path", folder] if draft == "vanilla" else []  # the target as its own vanilla draft
        res = _run([*prompts, "--draft", draft, *extra, "--max-new-tokens", "10", "--format", "json",
                    "--window", "8"])
        assert res.returncode == 0, res.stderr
        obj = json.loads(res.stdout)
        assert set(obj) >= {"outputs", "tau"} and len(obj["outputs"]) == 2
        for o in obj["outputs"]:
            assert set(o) >= {"text", "token_ids", "finish_reason", "tau"}
            assert o["finish_reason"] in ("stop", "length") and len(o["token_ids"]) <= 10
        outs[draft] = [o["token_ids"] for o in obj["outputs"]]
        if draft == "vanilla":
            assert obj["tau"] == 5.0 or any(o["finish_reason"] == "stop" for o in obj["outputs"])
    assert outs["magicdec"] == outs["none"] == outs["vanilla"]


def test_bf16_weights_greedy_equals_ad(folder):
    """--weights bf16 is a (slightly) different model; speculative decoding stays lossless against it."""
    prompts = ["The capital of France is", "def add(a, b):"]
    outs = {}
    for draft in ("none", "magicdec"):
        res = _run([*prompts, "--draft", draft, "--weights", "bf16", "--max-new-tokens", "12", "--format", "json",
                    "--window", "8"])
        assert res.returncode == 0, res.stderr
        outs[draft] = [o["token_ids"] for o in json.loads(res.stdout)["outputs"]]
    assert outs["magicdec"] == outs["none"] and all(len(t) > 0 for t in outs["none"])


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_rounded_draft_weights_beside_a_float32_target(folder, fmt):
    """--draft-weights bf16 / int8 rounds only the draft's own weights: greedy SD still gives the float32
    target's tokens (the target as its own vanilla draft, now rounded, still proposes almost every token)."""
    prompts = ["The capital of France is", "def add(a, b):"]
    outs = {}
    for draft, extra in (("none", []), ("vanilla", ["--draft-path", folder, "--draft-weights", fmt])):
        res = _run([*prompts, "--draft", draft, *extra, "--max-new-tokens", "12", "--format", "json"])
        assert res.returncode == 0, res.stderr
        obj = json.loads(res.stdout)
        outs[draft] = [o["token_ids"] for o in obj["outputs"]]
    assert outs["vanilla"] == outs["none"] and obj["tau"] > 2


def test_stdin_and_stop_string(folder):
    res = _run(["--draft", "magicdec", "--max-new-tokens", "40", "--stop", ",", "--format", "json"],
               stdin="Apples, pears, plums, cherries\n")
    assert res.returncode == 0, res.stderr
    o = json.loads(res.stdout)["outputs"][0]
    assert "," not in o["text"]


def test_chat_template_and_eos_stop(folder):
    res = _run(["What is the capital of France?", "--chat", "--max-new-tokens", "20", "--format", "json"])
    assert res.returncode == 0, res.stderr
    o = json.loads(res.stdout)["outputs"][0]
    assert o["text"] == "The capital of France is Paris."
    assert o["finish_reason"] == "stop" and o["token_ids"][-1] == 2  # <|im_end|> is emitted, then the row stops


def test_prompt_longer_than_positions(folder):
    res = _run(["word " * 9000, "--max-new-tokens", "4"])
    assert res.returncode != 0 and "exceeds the target's 8192 positions" in res.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args,message", [
    (["", "--draft", "none"], "empty prompt"),
    (["hi", "--k", "0"], "k must be >= 1"),
    (["hi", "--temperature", "-1"], "temperature must be finite and >= 0"),
    (["hi", "--temperature", "inf"], "temperature must be finite and >= 0"),
    (["hi", "--k", "8190", "--max-new-tokens", "16", "--draft", "magicdec"], "k = 8190 draft tokens per round"),
    (["hi", "--top-p", "1.5"], "--top-p must be in [0, 1] (0: greedy), got 1.5"),
    (["hi", "--top-p", "-0.1"], "--top-p must be in [0, 1] (0: greedy), got -0.1"),
    (["hi", "--draft", "vanilla"], "needs --draft-path"),
    (["hi", "--draft", "magicdec", "--draft-path", "x.safetensors"], "--draft magicdec takes none"),
    (["hi", "--target", "/nonexistent/model"], "checkpoint not found"),
])
def test_bad_input(args, message):
    res = _run(args, stdin="")
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, res.stderr
    assert "Traceback" not in res.stderr


def test_mismatched_tokenizer_is_refused(smollm2):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from spire.drafts.vanilla import check_same_vocabulary
    from spire.errors import TokenizerMismatchError

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2},
                                                                                 unk_token="[UNK]")))
    with pytest.raises(TokenizerMismatchError, match="target has 49152 tokens, draft x has 3"):
        check_same_vocabulary(smollm2[1], other, "target", "draft x")


def test_dash_reads_prompts_from_stdin(folder):
    """`-` as a prompt stands for the lines of standard input (one prompt each, blank lines skipped), in its
    place among the other prompts."""
    common = ["--draft", "none", "--max-new-tokens", "3", "--format", "json"]
    res = _run(["The capital of France is", "-", *common], stdin="def add(a, b):\n\nOnce upon a time\n")
    assert res.returncode == 0, res.stderr
    ref = _run(["The capital of France is", "def add(a, b):", "Once upon a time", *common])
    assert ref.returncode == 0, ref.stderr
    got = [o["token_ids"] for o in json.loads(res.stdout)["outputs"]]
    assert len(got) == 3 and got == [o["token_ids"] for o in json.loads(ref.stdout)["outputs"]]


@pytest.mark.parametrize("args,warned", [
    (["--top-k", "5"], "--top-k does nothing"),
    (["--top-p", "0.9"], "--top-p does nothing"),
    (["--top-k", "5", "--top-p", "0.9"], "--top-k and --top-p do nothing"),
    (["--top-k", "5", "--temperature", "1"], None),  # they act at T > 0
    ([], None),
])
def test_sampling_flags_that_do_nothing_at_temperature_0_warn_once(args, warned):
    """At T = 0 (greedy) --top-k and --top-p change nothing: one warning line on stderr says so (checked before
    the target loads: here a missing one, so the run ends with its error line)."""
    res = _run(["hi", *args, "--target", "/nonexistent/model"])
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and lines[-1].startswith("error: ") and "checkpoint not found" in lines[-1]
    warnings = [ln for ln in lines if ln.startswith("warning: ")]
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0] and "temperature 0" in warnings[0], res.stderr


def test_top_p_0_is_greedy_as_in_spire_serve(capsys, tiny_folder):  # noqa: F811
    """`--top-p 0` is greedy decoding, as spire serve's `top_p: 0` (the shared serve-api-clients check sends it and
    expects the greedy text; vLLM would refuse it): at --temperature 1 it gives --temperature 0's tokens (it was
    refused: "top-p must be in (0, 1]")."""
    from tests.helpers import run_cli

    base = ["generate", "The river", "--target", str(tiny_folder), "--draft", "none", "--max-new-tokens", "12",
            "--format", "json"]
    outs = {}
    for extra in (["--temperature", "0"], ["--temperature", "1", "--top-p", "0"], ["--temperature", "1"]):
        code, out, err = run_cli(capsys, *base, *extra)
        assert code == 0, err
        outs[" ".join(extra)] = json.loads(out)["outputs"][0]["token_ids"]
    assert outs["--temperature 1 --top-p 0"] == outs["--temperature 0"]
    assert outs["--temperature 1"] != outs["--temperature 0"]  # (sampling at T = 1 does differ)
