"""A trained kind owns its life (issue 54, item 1): what spire's light parts know of a trained kind (the draft
file's metadata key of its settings, how a message names it, the vLLM method of its export, whether the diagnosis
applies) is on its registry line, and the tables other modules keep are views of the lines. A toy trained kind
(tests/toy_trained_draft.py) added as one more line of ``registry.KINDS`` at run time is saved and read by
TrainConfig, recognized in a draft file and named by the tables, with no other change; the existing kinds' tables
and run settings are the ones of before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spire.registry as registry
from spire.drafts.spire import SpireConfig
from spire.errors import CheckpointError, ConfigError
from spire.formats.draft_file import (DRAFT_KIND_KEYS, DRAFT_KIND_NAMES, draft_file_kind, read_draft_meta,
                                      write_draft_file)
from spire.integrations import vllm_export
from spire.training.checkpoint import _check_saved_config
from spire.training.config import TrainConfig, init_draft_settings
from tests.test_train_config import EAGLE3_RUN, SPIRE_RUN, VANILLA_RUN
from tests.toy_trained_draft import ToyConfig

TOY = registry.Kind("toy", "tests.toy_trained_draft", "a toy trained kind", "required", True,
                    registry.Pricing(kv="full", layers=1), config_key="toy_config", display_name="a toy",
                    vllm_method="draft_model", run_weights="toy.safetensors",
                    train_options=(registry.TrainOption("toy_width", int, "Toy: hidden columns of each block [2].",
                                                        "width"),))


def _add(monkeypatch, line: registry.Kind) -> None:
    """The line added to the registry, as test_seventh_kind adds one (and taken away after the test)."""
    monkeypatch.setattr(registry, "KINDS", registry.KINDS + (line,))
    monkeypatch.setitem(registry._BY_NAME, line.name, line)


def _json(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_the_existing_kinds_tables_are_views_of_their_lines():
    """The tables read as the literal ones of before, and n-gram (and "none") are left out of the diagnosis."""
    assert dict(DRAFT_KIND_KEYS) == {"spire": "spire_config", "eagle3": "eagle3_config", "vanilla": "vanilla_config"}
    assert dict(DRAFT_KIND_NAMES) == {"spire": "a SPIRe", "eagle3": "an EAGLE-3", "vanilla": "a vanilla"}
    assert dict(vllm_export.METHODS) == {"eagle3": "eagle3", "vanilla": "draft_model", "spire": "eagle3"}
    assert [n for n in registry.names() if registry.kind(n).diagnosable] == ["vanilla", "magicdec", "spire", "eagle3"]
    assert draft_file_kind({"eagle3_config": {}, "target": {}}) == "eagle3" and draft_file_kind({"target": {}}) is None
    with pytest.raises(ConfigError, match="cannot run a 'magicdec' draft"):
        vllm_export.method("magicdec")


def test_a_trained_kinds_settings_round_trip_through_train_config(monkeypatch):
    """Its settings are saved under its config key (in its own runs only) and read back into its config class; the
    layout of before (every run's ``spire``, ``eagle3``, ``vanilla_layers``) is kept around them."""
    _add(monkeypatch, TOY)
    cfg = TrainConfig(draft="toy", draft_config=ToyConfig(width=5, depth=3))
    cfg.validate()
    saved = _json(cfg.to_dict())
    assert saved["toy_config"] == {"width": 5, "depth": 3} and saved["loss"] == "hard"
    assert saved["spire"] == SpireConfig().to_dict()
    assert saved["vanilla_layers"] is None and "eagle3" in saved
    back = TrainConfig.from_dict(saved)
    assert back.draft_config == ToyConfig(5, 3) and _json(back.to_dict()) == saved
    assert type(TrainConfig(draft="toy").draft_config) is ToyConfig  # its defaults when none are given
    assert TrainConfig.from_dict({**saved, "toy_config": None}).draft_config == ToyConfig()

    # the other kinds' runs: read and written back as before, without the toy's key
    for run in (SPIRE_RUN, EAGLE3_RUN, VANILLA_RUN):
        assert _json(TrainConfig.from_dict(run).to_dict()) == run
    # a resume of the toy's run: a field added to its settings since reads as its default
    older = {**saved, "toy_config": {"width": 5}}
    _check_saved_config(None, {"config": older}, _json(TrainConfig(draft="toy", draft_config=ToyConfig(5)).to_dict()))
    with pytest.raises(ConfigError, match="other settings"):
        _check_saved_config(None, {"config": older}, saved)


def test_a_trained_kind_without_a_config_key_is_refused(monkeypatch):
    _add(monkeypatch, registry.Kind("toy", "tests.toy_trained_draft", "a toy", "required", True, None))
    with pytest.raises(ConfigError, match="names no config_key"):
        TrainConfig(draft="toy").to_dict()


def test_a_trained_kinds_draft_file_and_names_come_from_its_line(monkeypatch, tmp_path):
    """draft_file_kind recognizes its metadata, `--init-from` reads its settings (and names it when another kind
    is asked for), and the tables name it and its vLLM method."""
    _add(monkeypatch, TOY)
    assert DRAFT_KIND_KEYS["toy"] == "toy_config" and DRAFT_KIND_NAMES["toy"] == "a toy"
    assert vllm_export.METHODS["toy"] == "draft_model" == vllm_export.method("toy")
    assert registry.kind("toy").diagnosable
    assert registry.Kind("x", "m", "s", "none", True, None).article_name == "a x"

    path = tmp_path / "draft.safetensors"
    write_draft_file(path, {"w": torch.zeros(2)}, {"toy_config": {"width": 7, "depth": 2}, "target": {}})
    assert draft_file_kind(read_draft_meta(path)) == "toy"
    assert init_draft_settings(path, "toy") == ToyConfig(7, 2)
    with pytest.raises(CheckpointError, match=r"a toy draft, not spire \(--draft toy\)"):
        init_draft_settings(path, "spire")


def test_a_run_folder_resolves_by_its_kinds_declared_layout(monkeypatch, tmp_path):
    """resolve_draft_path reads each kind's run layout from its line (:attr:`registry.Kind.run_weights`): the
    existing kinds resolve as before (SPIRe's draft.safetensors, vanilla's draft/, EAGLE-3's run folder itself), a
    toy run folder resolves to its own file, and a run folder of another trained kind is refused with one message
    naming that kind and how to give it (``--draft KIND --draft-path PATH``, which every command that takes drafts
    has); the run folder's own names include the toy's."""
    from spire.formats.draft_file import resolve_draft_path
    from spire.training.runfolder import is_own

    _add(monkeypatch, TOY)
    runs = {k: tmp_path / k for k in ("spire", "vanilla", "eagle3", "toy")}
    for r in runs.values():
        (r / "checkpoint").mkdir(parents=True)
    (runs["spire"] / "draft.safetensors").write_bytes(b"x")
    (runs["vanilla"] / "draft").mkdir()
    (runs["eagle3"] / "eagle3").mkdir()
    (runs["toy"] / "toy.safetensors").write_bytes(b"x")
    assert resolve_draft_path("spire", runs["spire"]) == runs["spire"] / "draft.safetensors"
    assert resolve_draft_path("vanilla", runs["vanilla"]) == runs["vanilla"] / "draft"
    assert resolve_draft_path("eagle3", runs["eagle3"]) == runs["eagle3"]
    assert resolve_draft_path("toy", runs["toy"]) == runs["toy"] / "toy.safetensors"
    assert resolve_draft_path("toy", runs["toy"] / "toy.safetensors") == runs["toy"] / "toy.safetensors"
    for asked, given, named, has in (("spire", "vanilla", "a vanilla", "draft/"), ("vanilla", "spire", "a SPIRe",
                                     "draft.safetensors"), ("spire", "eagle3", "an EAGLE-3", "eagle3/"),
                                     ("toy", "spire", "a SPIRe", "draft.safetensors"),
                                     ("spire", "toy", "a toy", "toy.safetensors")):
        with pytest.raises(CheckpointError) as e:
            resolve_draft_path(asked, runs[given])
        msg = str(e.value)
        assert f"is {named} draft run (it has {has}" in msg, msg
        assert msg.endswith(f"give it as --draft {given} --draft-path {runs[given]}"), msg
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds no SPIRe draft \(draft.safetensors\): it is an HF model folder"):
        resolve_draft_path("spire", tmp_path / "hf")
    assert resolve_draft_path("toy", tmp_path / "hf") == tmp_path / "hf"  # a kind that takes folders reads it
    assert is_own("toy.safetensors") and is_own(".toy.safetensors.abc.tmp") and not is_own("toy.safetensors.old")
    assert is_own("draft.old") and not is_own("notes.txt")


def test_the_existing_kinds_declare_their_models_run_layout():
    """A kind's line declares what its model writes in its run folder (so light code reads it without torch)."""
    for name in registry.names(trains=True):
        assert registry.kind(name).run_weights == registry.impl(name).model.export_name, name


def test_a_trained_kinds_train_options_are_flags_of_spire_train(monkeypatch):
    """The toy's declared option becomes ``--toy-width`` of the train command (beside the existing kinds' flags,
    unchanged), sets its config's field, and given with another --draft is refused naming the flag."""
    import inspect

    from spire.commands.options import with_train_options
    from spire.commands.train import TrainRunArgs, _refuse_foreign, args_from_options, draft_option

    _add(monkeypatch, TOY)

    def command(ctx=None, device: str = "auto") -> None:
        pass
    params = inspect.signature(with_train_options(before="device")(command)).parameters
    assert list(params)[-1] == "device" and "toy_width" in params and "n_draft_layers" in params
    assert "vocab_size" in params and "eagle3_layers" in params
    base = {"draft": "toy", "target": "t", "data": ["registry"], "out": None, "ablation": "none", "resume": False,
            "device": "cpu", "eval_windows": None, **{name: None for name in params if name not in ("ctx", "device")}}
    args = args_from_options(base, {"toy_width": 3}, log=lambda _: None)
    assert args.draft_overrides == {"toy": {"width": 3}} and draft_option("toy", "width", 3) == "--toy-width"
    with pytest.raises(ConfigError, match="--toy-width: an option of --draft toy, not of --draft spire"):
        _refuse_foreign(TrainRunArgs(draft="spire", draft_overrides=args.draft_overrides))
    # the existing kinds' options as before: a J,J list, a switch, 0 as the whole vocabulary
    args = args_from_options({**base, "draft": "spire", "full_kv": True}, {"layers": "1,3", "draft_vocab": 0},
                             log=lambda _: None)
    assert args.draft_overrides == {"spire": {"layers": (1, 3), "vocab_size": None, "window": None}}
    with pytest.raises(ConfigError, match="--eagle3-layers: 'x' is not an integer"):
        args_from_options(base, {"eagle3_layers": "1,x"}, log=lambda _: None)


def test_a_trained_kind_without_an_export_is_one_error(monkeypatch, tmp_path):
    """`spire export` of a trained kind whose module declares no export: one ConfigError, nothing written."""
    import tests.toy_trained_draft as toy
    from spire.export import export_draft

    _add(monkeypatch, TOY)
    monkeypatch.setattr(toy, "KIND", registry.DraftImpl(load=toy.load_draft, model=toy.ToyDraftModel))
    with pytest.raises(ConfigError, match="--draft toy declares no export"):
        export_draft("toy", tmp_path, None, "t", tmp_path / "out", vllm=False)
    assert not (tmp_path / "out").exists()


ROOT = Path(__file__).resolve().parents[1]
ADD_THE_LINE = """
import sys
import spire.registry as registry
line = registry.Kind("toy", "tests.toy_trained_draft", "a toy trained kind", "required", True,
                     registry.Pricing(kv="full", layers=1), config_key="toy_config", display_name="a toy",
                     run_weights="toy.safetensors",
                     train_options=(registry.TrainOption("toy_width", int, "Toy: hidden columns of each block [2].",
                                                         "width"),))
registry.KINDS = registry.KINDS + (line,)
registry._BY_NAME["toy"] = line
from spire.cli import main
main(sys.argv[1:])
"""


def _run(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ADD_THE_LINE, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1",
                               "SPIRE_CACHE": str(cache)}, timeout=600)


def _cache(tmp_path: Path) -> Path:
    """A throwaway SPIRE_CACHE that reuses the real one's converted model and prepared data (as
    tests/test_reproduce.py does): the runs and measurements of the test go there."""
    from tests.helpers import scratch_cache

    return scratch_cache(tmp_path)


@pytest.mark.slow  # spire's commands on the embedded target, each in a fresh interpreter (about a minute)
def test_a_trained_kind_lives_through_spire_from_its_module_and_line(smollm2, tmp_path):
    """The toy trained kind, its module and one registry line added before spire's CLI is imported: `spire train
    --draft toy` (with its own --toy-width) trains it into a run folder, `--resume` takes it to more steps,
    `spire tau` and `spire generate` (greedy: the target's own tokens) read the run folder, `spire export --no-vllm`
    writes a folder that --draft-path reads back, and a run folder given as another kind is one error naming the
    toy and how to give it."""
    cache = _cache(tmp_path)
    text = tmp_path / "text"
    text.mkdir()
    words = "river stone light garden window morning letter quiet market winter bridge paper".split()
    for n in range(8):
        paras = [" ".join(words[(i * 7 + j * 3 + n) % len(words)] for j in range(60)) + "." for i in range(12)]
        (text / f"notes{n}.txt").write_text("\n\n".join(paras))

    def spire(*args: str) -> str:
        out = _run(*args, cache=cache)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    run = tmp_path / "run"
    common = ["--data", str(text), "--out", str(run)]
    spire("train", "--draft", "toy", *common, "--max-steps", "2", "--batch-size", "2", "--seq-len", "16", "-k", "4",
          "--eval-windows", "2", "--eval-every", "0", "--no-bf16", "--device", "cpu", "--warmup-steps", "1",
          "--checkpoint-every", "0", "--toy-width", "3")
    assert (run / "toy.safetensors").is_file()
    saved = json.loads((run / "checkpoint" / "train_state.json").read_text())
    assert saved["step"] == 2 and saved["config"]["toy_config"] == {"width": 3, "depth": 1}
    spire("train", "--resume", *common, "--max-steps", "3")
    state = json.loads((run / "checkpoint" / "train_state.json").read_text())
    assert state["step"] == 3 and state["finished"] and state["config"]["toy_config"] == {"width": 3, "depth": 1}
    assert json.loads((run / "summary.json").read_text())["draft_path"] == str(run / "toy.safetensors")

    rows = json.loads(spire("tau", "--draft", "toy", "--draft-path", str(run), "-L", "32", "-G", "8",
                            "--n-contexts", "2", "--format", "json", "--threads", "1"))["rows"]
    assert rows and all(r["draft"] == "toy" and 1.0 <= r["tau"] <= 5.0 for r in rows)

    prompt = ["Once upon a time there was a"]
    outs = {d: json.loads(spire("generate", *prompt, "--max-new-tokens", "10", "--format", "json", *extra))
            for d, extra in (("none", ["--draft", "none"]), ("toy", ["--draft", "toy", "--draft-path", str(run)]))}
    assert [o["token_ids"] for o in outs["toy"]["outputs"]] == [o["token_ids"] for o in outs["none"]["outputs"]]
    assert outs["toy"]["draft"] == "toy"

    exported = tmp_path / "export"
    assert spire("export", "--draft", "toy", "--draft-path", str(run), "--out", str(exported),
                 "--no-vllm").strip() == str(exported)
    back = json.loads(spire("generate", *prompt, "--max-new-tokens", "10", "--format", "json", "--draft", "toy",
                            "--draft-path", str(exported)))
    assert [o["token_ids"] for o in back["outputs"]] == [o["token_ids"] for o in outs["none"]["outputs"]]

    wrong = _run("generate", *prompt, "--draft", "spire", "--draft-path", str(run), cache=cache)
    err = wrong.stderr.strip().splitlines()
    assert wrong.returncode != 0 and len(err) == 1, wrong.stderr
    assert err[0] == f"error: {run} is a toy draft run (it has toy.safetensors, no draft.safetensors), not a SPIRe " \
                     f"draft: give it as --draft toy --draft-path {run}"


@pytest.mark.slow  # the main job, tiny, in a subprocess (a few minutes on 2 loaded cores)
def test_spire_reproduce_trains_and_measures_a_trained_kind_of_the_registry(smollm2, tmp_path):
    """`spire reproduce --quick` trains every trained kind of the registry: the toy (beside the recipe's SPIRe and
    vanilla) trains at its defaults for SPIRe's steps and is measured, priced and reported like the others."""
    out = tmp_path / "out"
    res = _run("reproduce", "--quick", "--out", str(out), "--steps", "1", "--vanilla-steps", "1", "--no-eagle3",
               "--target-cache", "none", "--n-contexts", "2", "-L", "64", "-G", "8", "--tau-L", "32",
               "--tau-L-contexts", "2", "--tau-k", "4", "--tau-k-contexts", "2", "--diagnose-contexts", "0",
               cache=_cache(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    toy = results["trainings"]["toy"]
    assert toy["draft"] == "toy" and toy["steps"] == 1 and toy["loss"] == "hard"
    assert {(t["draft"], t["temperature"]) for t in results["tau"] if t["draft"] == "toy"} == {("toy", 0.0),
                                                                                              ("toy", 1.0)}
    assert "toy" in {r["draft"] for r in results["throughput"]["measured"]["T=0"]}
    assert "| toy |" in (out / "REPORT.md").read_text()


def test_a_trained_kind_declares_its_vllm_form(monkeypatch, tmp_path, capsys):
    """A kind's vLLM form is its module's ``KIND.vllm`` (:class:`vllm_export.VllmForm`), read by the export with the
    method on its line: the subfolder its speculative config names, its target check (before anything is written),
    its config.json rewrite (with its note line) and its step after it; a kind with a method and no declared form gets
    the independent form (the export itself as vLLM's draft model)."""
    import dataclasses

    import tests.toy_trained_draft as toy
    from spire.export import export_draft
    from tests.conftest import make_tiny
    from tests.toy_trained_draft import ToyDraftModel

    target = make_tiny()
    ToyDraftModel(target, ToyConfig()).save_checkpoint(tmp_path / "toy.safetensors", target, {})
    seen = []

    def check(t):
        seen.append("check")
        if t is not target:
            raise ConfigError("not this target")

    def rewrite(folder, config, t):
        config["rewritten"] = True
        return "note: the toy's variant"

    def after(folder, config, t):
        (folder / "vllm").mkdir()
        (folder / "vllm" / "config.json").write_text(json.dumps({"from": config["kind"], **config}))

    form = vllm_export.VllmForm(subfolder="vllm", check_target=check, rewrite=rewrite, after_write=after)
    _add(monkeypatch, dataclasses.replace(TOY, vllm_method="eagle3"))
    monkeypatch.setattr(toy, "KIND", registry.DraftImpl(load=toy.load_draft, model=ToyDraftModel,
                                                        export=toy._export, vllm=form))
    out = export_draft("toy", tmp_path / "toy.safetensors", target, "t", tmp_path / "out", k=2)
    assert seen == ["check"] and capsys.readouterr().err.strip() == "note: the toy's variant"
    assert json.loads((out / "config.json").read_text())["rewritten"] is True
    assert json.loads((out / "vllm" / "config.json").read_text())["from"] == "toy"
    assert json.loads((out / vllm_export.SPEC_FILE).read_text()) == {
        "method": "eagle3", "model": str((out / "vllm").resolve()), "num_speculative_tokens": 2,
        "draft_sample_method": "probabilistic", "draft_tensor_parallel_size": 1}
    with pytest.raises(ConfigError, match="not this target"):
        export_draft("toy", tmp_path / "toy.safetensors", make_tiny(seed=1), "t", tmp_path / "other")
    assert not (tmp_path / "other").exists()

    monkeypatch.setattr(registry, "KINDS", registry.KINDS[:-1] + (TOY,))  # draft_model, no declared form: the
    monkeypatch.setitem(registry._BY_NAME, "toy", TOY)                     # independent form
    monkeypatch.setattr(toy, "KIND", registry.DraftImpl(load=toy.load_draft, model=ToyDraftModel, export=toy._export))
    assert vllm_export.form("toy") is vllm_export.INDEPENDENT_FORM
    out = export_draft("toy", tmp_path / "toy.safetensors", target, "t", tmp_path / "plain", k=2)
    assert json.loads((out / vllm_export.SPEC_FILE).read_text())["model"] == str(out.resolve())
    assert {n: registry.impl(n).vllm for n in ("spire", "eagle3", "vanilla")} == {
        "spire": vllm_export.SPIRE_FORM, "eagle3": vllm_export.EAGLE3_FORM, "vanilla": vllm_export.INDEPENDENT_FORM}


def test_a_trained_kinds_serve_memory_plan_counts_its_weights_and_its_cache(monkeypatch, tmp_path):
    """`spire serve --device-memory` plans a trained kind of the registry as the others (a fresh developer found a
    new kind planned with no draft weights and no draft state): its weights from the headers of its run's file, its
    KV cache as its line's Pricing says (one block of the target's KV shape over the whole context, kv "full")."""
    from safetensors.torch import save_file

    from spire.memory_plan import kv_bytes, serve_planner
    from spire.model import ModelConfig

    _add(monkeypatch, TOY)
    save_file({"w": torch.zeros(10, 7), "b": torch.zeros(3, dtype=torch.bfloat16)}, str(tmp_path / "toy.safetensors"))
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, d_head=8)
    plan = serve_planner(cfg, max_len=128, k=3, prefill_chunk=0, kind="toy",
                         draft_path=str(tmp_path / "toy.safetensors"))(5)
    assert plan.parts["draft weights"] == 10 * 7 * 4 + 3 * 2
    assert plan.parts["draft state"] == kv_bytes(1, 5, 2, 128, cfg.d_head) > 0
