"""benchmarks/t1_recipes.py's variants (issue "SPIRe at T = 1"): what each key sets on the run's TrainConfig."""

import importlib.util
from pathlib import Path

import pytest

from spire.drafts.spire import SpireConfig, SpireDraftModel
from spire.pipeline import ReproduceConfig, spire_architecture, training_runs

_spec = importlib.util.spec_from_file_location("t1_recipes", Path(__file__).parents[1] / "benchmarks" / "t1_recipes.py")
t1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(t1)


@pytest.fixture
def base_and_eagle3():
    cfg = ReproduceConfig(steps=600)
    runs = dict(training_runs(cfg, spire_architecture(cfg, 30, 49152)))
    return runs["spire"], runs["eagle3"]


def test_a_fine_tuning_variant_takes_the_drafts_own_settings(tmp_path, tiny, base_and_eagle3, monkeypatch):
    """init=RUN: the variant starts from that draft (absolute path) with the draft's own SpireConfig, whatever the
    main job's layers; target_cache=none is the live target on the same batches; the base is left as it was."""
    base, eagle3 = base_and_eagle3
    own = SpireConfig(n_draft_layers=2, window=8, vocab_size=40)
    SpireDraftModel(tiny, own, list(range(40))).save(tmp_path / "run" / "draft.safetensors")
    monkeypatch.chdir(tmp_path)
    name, kw = t1.parse_variant("ft:init=run,lr=3e-4,target_cache=none")
    cfg = t1.variant_config(base, kw, eagle3)
    assert name == "ft" and cfg.init_from == str(tmp_path / "run") and cfg.lr == 3e-4
    assert cfg.draft_config == own and cfg.target_cache is None and cfg.data_steps == base.data_steps
    assert base.draft_config.layers == (0, 1, 24, 25, 26, 27, 28, 29) and base.init_from is None
    assert base.target_cache == "bfloat16"
    with pytest.raises(SystemExit, match="bad --variant 'ft:layers=3'"):
        t1.parse_variant("ft:layers=3")
