"""A trained kind owns its life (issue 54, item 1): what spire's light parts know of a trained kind (the draft
file's metadata key of its settings, how a message names it, the vLLM method of its export, whether the diagnosis
applies) is on its registry line, and the tables other modules keep are views of the lines. A toy trained kind
(tests/toy_trained_draft.py) added as one more line of ``registry.KINDS`` at run time is saved and read by
TrainConfig, recognized in a draft file and named by the tables, with no other change; the existing kinds' tables
and run settings are the ones of before."""

from __future__ import annotations

import dataclasses
import json

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
                    vllm_method="draft_model")


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

    _add(monkeypatch, dataclasses.replace(TOY, run_weights="toy.safetensors"))
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
