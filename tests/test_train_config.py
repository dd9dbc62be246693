"""TrainConfig holds one draft config (its kind's config class), and reads and writes the on-disk layout of run
folders saved before the config classes existed (``spire`` and ``eagle3`` objects, ``vanilla_layers``): a format
other tools read, and the key of the main job's draft cache."""

import json

import pytest

from spire.drafts.eagle3 import Eagle3Config
from spire.drafts.spire import SpireConfig
from spire.drafts.vanilla import VanillaConfig
from spire.errors import ConfigError
from spire.training.distill import TrainConfig

# the "config" of checkpoints written before the config classes (the main job's SPIRe and EAGLE-3 runs)
SPIRE_RUN = json.loads('{"draft": "spire", "budget_s": 1000000000.0, "max_steps": 600, "batch_size": 4, "seq_len": 256, "k": 4, "lr": 0.001, "warmup_steps": 20, "weight_decay": 0.0, "loss": "mixed", "omega": 0.5, "grad_clip": 1.0, "bf16": true, "seed": 0, "checkpoint_every": 60.0, "eval_every": 100, "ablation": "none", "spire": {"n_draft_layers": 8, "sink": 1, "window": 64, "mix_init": 4.0, "layers": [0, 1, 24, 25, 26, 27, 28, 29], "init": "pruned", "feedback_memory": true, "target_activations": true, "self_attend": true, "vocab_size": 16384, "feature_input": false, "feature_layer": null, "feature_from": null, "bridge": false}, "eagle3": {"layers": null, "draft_vocab": 16384, "norm_before_residual": false, "norm_before_fc": false, "fc_norm": false, "norm_output": false, "embed_requires_grad": false, "num_layers": 1, "train_head": true, "sink": 1, "window": null}, "vanilla_layers": null, "data_steps": 500, "target_cache": "bfloat16", "data": null, "hidden_weight": 0.0, "compile": true}')
EAGLE3_RUN = {**SPIRE_RUN, "draft": "eagle3", "loss": "kl",
              "spire": {**SPIRE_RUN["spire"], "layers": None, "vocab_size": None},
              "eagle3": {**SPIRE_RUN["eagle3"], "layers": [2, 15, 27], "draft_vocab": 8192}}
VANILLA_RUN = {**SPIRE_RUN, "draft": "vanilla", "loss": "hard", "spire": EAGLE3_RUN["spire"],
               "eagle3": SPIRE_RUN["eagle3"], "vanilla_layers": 3, "data_steps": None, "target_cache": None}


def _json(d: dict) -> dict:
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("saved,cls,own", [(SPIRE_RUN, SpireConfig, {"layers": (0, 1, 24, 25, 26, 27, 28, 29)}),
                                           (EAGLE3_RUN, Eagle3Config, {"layers": (2, 15, 27), "draft_vocab": 8192}),
                                           (VANILLA_RUN, VanillaConfig, {"n_layers": 3})])
def test_old_run_configs_read_and_write_back_unchanged(saved, cls, own):
    """A saved run's config reads into one draft config of its kind's class, with the saved values, and writes back
    byte for byte the same JSON object (so a resume matches it and the draft cache keys stay)."""
    cfg = TrainConfig.from_dict(saved)
    assert type(cfg.draft_config) is cls
    got = {k: getattr(cfg.draft_config, k) for k in own}
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in got.items()} == own
    assert _json(cfg.to_dict()) == saved
    cfg.validate()


def test_a_run_from_before_newer_fields_reads_with_their_defaults():
    """A checkpoint older than data, hidden_weight and compile (and SPIRe's bridge) reads with their defaults."""
    old = {k: v for k, v in SPIRE_RUN.items() if k not in ("data", "hidden_weight", "compile")}
    old["spire"] = {k: v for k, v in old["spire"].items() if k != "bridge"}
    cfg = TrainConfig.from_dict(old)
    assert (cfg.data, cfg.hidden_weight, cfg.compile, cfg.draft_config.bridge) == (None, 0.0, False, False)


def test_one_draft_config_of_the_right_class():
    """Each kind gets its own defaults; a config of another kind's class, or an unknown saved field, is refused."""
    assert [type(TrainConfig(draft=d).draft_config) for d in ("spire", "eagle3", "vanilla")] == [
        SpireConfig, Eagle3Config, VanillaConfig]
    with pytest.raises(ConfigError, match="a vanilla draft's settings are a VanillaConfig, got SpireConfig"):
        TrainConfig(draft="vanilla", draft_config=SpireConfig()).validate()
    with pytest.raises(ConfigError, match="unknown training settings medusa_heads"):
        TrainConfig.from_dict({**SPIRE_RUN, "medusa_heads": 4})
    with pytest.raises(ConfigError, match="the vanilla draft needs 1 to 30 layers"):
        VanillaConfig(31).validate(30)
