"""`spire export` (issue 15, part 5): a trained draft as a speculators-style folder, read back by spire
(--draft-path FOLDER) exactly, refused for another target or an unknown format version."""

from __future__ import annotations

import json

import pytest
import torch

from spire.cli import main
from spire.drafts import make_draft
from spire.drafts.spire import SpireConfig, SpireDraftModel
from spire.errors import CheckpointError, TokenizerMismatchError
from spire.export import export_draft
from spire.formats.draft_file import FORMAT_VERSION, check_export
from tests.oracle import generate
from tests.conftest import make_tiny


def _trained_spire(target, tmp_path):
    torch.manual_seed(3)
    model = SpireDraftModel(target, SpireConfig(n_draft_layers=2, sink=1, window=5))
    with torch.no_grad():  # as if trained: away from the pruned initialization
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path / "draft.safetensors"
    model.save(path, {"ablation": "none", "loss": "mixed", "omega": 0.5})
    return model, path


@pytest.mark.slow
def test_spire_export_round_trip(tmp_path):
    target = make_tiny()
    model, path = _trained_spire(target, tmp_path)
    out = export_draft("spire", path, target, "tiny-target", tmp_path / "export", k=3)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "vllm",
                                                     "vllm_speculative_config.json"]  # vLLM's form beside it
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "spire" and c["spire_format_version"] == FORMAT_VERSION
    sc = c["speculators_config"]
    assert sc["algorithm"] == "spire" and sc["default_proposal_method"] == "greedy"
    assert [m["proposal_type"] for m in sc["proposal_methods"]] == ["greedy", "sample"]
    assert all(m["speculative_tokens"] == 3 for m in sc["proposal_methods"])
    assert sc["verifier"]["name_or_path"] == "tiny-target" and sc["verifier"]["hidden_size"] == 48
    assert c["inputs"] == ["input_ids", "hidden_states.layer.2", "hidden_states.layer.3"]
    assert {k: c["spire"][k] for k in ("source_layers", "sink", "window", "k", "draft_vocab")} == {
        "source_layers": [2, 3], "sink": 0, "window": 5, "k": 3, "draft_vocab": None}  # sink: the vLLM variant
    assert c["num_hidden_layers"] == 2 and c["architectures"] == ["SpireDraftModel"]

    assert (c["spire"]["sink"], c["spire"]["self_attend"]) == (0, False)  # the variant vLLM runs

    back = make_draft("spire", target, path=str(out))  # --draft-path FOLDER
    for (name, a), (_, b) in zip(model.state_dict().items(), back.model.state_dict().items()):
        assert torch.equal(a, b), name
    prompts = [[5, 17, 42, 8, 60], [3, 71, 9]]
    ad = generate(target, prompts, 16).tokens
    assert generate(target, prompts, 16, draft=back, k=3).tokens == ad
    variant = SpireDraftModel(target, SpireConfig(n_draft_layers=2, sink=0, window=5, self_attend=False))
    variant.load_state_dict(model.state_dict())
    variant.save(tmp_path / "variant.safetensors")
    as_vllm = generate(target, prompts, 16, draft=make_draft("spire", target, path=str(tmp_path / "variant.safetensors")),
                       k=3)
    assert generate(target, prompts, 16, draft=back, k=3).accepted_per_round == as_vllm.accepted_per_round

    exact = export_draft("spire", path, target, "tiny-target", tmp_path / "exact", k=3, vllm=False)  # --no-vllm
    assert sorted(p.name for p in exact.iterdir()) == ["config.json", "model.safetensors"]
    original = generate(target, prompts, 16, draft=make_draft("spire", target, path=str(path)), k=3)
    assert generate(target, prompts, 16, draft=make_draft("spire", target, path=str(exact)),
                    k=3).accepted_per_round == original.accepted_per_round  # the same draft


def test_export_refused_for_another_target(tmp_path):
    target = make_tiny()
    _, path = _trained_spire(target, tmp_path)
    out = export_draft("spire", path, target, "tiny", tmp_path / "export")
    other = make_tiny(seed=9)
    with pytest.raises(TokenizerMismatchError, match="exported for verifier 'tiny'"):
        make_draft("spire", other, path=str(out))
    with pytest.raises(TokenizerMismatchError):  # and at export time
        export_draft("spire", path, other, "other", tmp_path / "export2")


def test_unknown_format_version_refused(tmp_path):
    target = make_tiny()
    _, path = _trained_spire(target, tmp_path)
    out = export_draft("spire", path, target, "tiny", tmp_path / "export")
    c = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**c, "spire_format_version": FORMAT_VERSION + 1}))
    with pytest.raises(CheckpointError, match=f"format version {FORMAT_VERSION + 1}"):
        make_draft("spire", target, path=str(out))


@pytest.mark.slow
def test_cli_export_for_a_family_target_and_vanilla(tmp_path, capsys):
    """`spire export` with an HF folder target (Qwen3: q/k norms copied into the draft), then back; a vanilla
    draft folder exports with speculators_config added to its HF config and still loads."""
    from spire.drafts.vanilla import build_vanilla, save_vanilla
    from spire.loading import load_model
    from tests.families import build_checkpoint

    build_checkpoint("qwen3", tmp_path / "target")
    target = load_model(tmp_path / "target")
    model, path = _trained_spire(target, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # q/k norms: spire's vLLM plugin runs plain Llama blocks
        main(["export", "--target", str(tmp_path / "target"), "--draft-path", str(path), "--out",
              str(tmp_path / "out"), "-k", "5"])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: vLLM 0.32.0 cannot run this SPIRe draft") and "--no-vllm" in err[0]
    with pytest.raises(SystemExit) as e:
        main(["export", "--target", str(tmp_path / "target"), "--draft-path", str(path), "--out",
              str(tmp_path / "out"), "-k", "5", "--no-vllm"])
    assert e.value.code in (0, None)
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    back = make_draft("spire", target, path=str(tmp_path / "out"))
    with pytest.raises(CheckpointError, match="is an exported SPIRe draft, not a vanilla draft: give it as --draft "
                                              "spire --draft-path"):
        make_draft("vanilla", target, path=str(tmp_path / "out"))  # it said "unsupported model_type 'spire_draft'"
    q_norm = "layers.0.self_attn.q_norm.weight"
    assert torch.equal(back.model.state_dict()[q_norm], model.state_dict()[q_norm])

    vanilla = build_vanilla(target, 1).eval()
    save_vanilla(vanilla, tmp_path / "vanilla", tmp_path / "target", {})
    out = export_draft("vanilla", tmp_path / "vanilla", target, "qwen3-target", tmp_path / "vout", k=4)
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_config"]["algorithm"] == "independent" and c["model_type"] == "qwen3"
    check_export(out, target)
    with pytest.raises(TokenizerMismatchError):
        check_export(out, make_tiny())
    reloaded = load_model(out)
    for (name, a), (_, b) in zip(vanilla.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_export_keeps_the_draft_vocabulary(tmp_path):
    """A draft with a 20-token vocabulary: config.json names its d2t tensor and size, and the folder reads back
    to the same map and the same greedy tokens (AD's)."""
    target = make_tiny()
    vocab = torch.arange(0, 97, 5)[:20]
    model = SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=5, vocab_size=20), vocab)
    model.save(tmp_path / "d.safetensors")
    out = export_draft("spire", tmp_path / "d.safetensors", target, "tiny-target", tmp_path / "export")
    c = json.loads((out / "config.json").read_text())
    assert {k: c["spire"]["draft_vocab"][k] for k in ("tensor", "size", "holds")} == {
        "tensor": "vocab", "size": 20, "holds": "target_ids"}
    assert c["torch_dtype"] == "float32"  # the weights' dtype, not the int64 vocab buffer's (stored first)
    back = make_draft("spire", target, path=str(out))
    assert torch.equal(back.model.vocab, vocab)
    prompts = [[5, 17, 42], [3, 71]]
    assert generate(target, prompts, 12, draft=back, k=3).tokens == generate(target, prompts, 12).tokens


def test_export_refuses_to_destroy_a_folder(tmp_path):
    """--out must not be the draft's own run folder, a folder above it, or a non-empty folder that is not an
    earlier export; an earlier export is replaced, unless it holds a file no export writes there."""
    from spire.errors import ConfigError

    target = make_tiny()
    run = tmp_path / "run"
    run.mkdir()
    _, path = _trained_spire(target, run)
    (run / "train_log.jsonl").write_text("{}\n")
    for out in (run, tmp_path):
        with pytest.raises(ConfigError, match="holds the draft"):
            export_draft("spire", path, target, "t", out)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an earlier spire export"):
        export_draft("spire", path, target, "t", other)
    assert (other / "notes.txt").read_text() == "mine" and (run / "train_log.jsonl").is_file()
    out = export_draft("spire", path, target, "t", tmp_path / "export")
    assert export_draft("spire", path, target, "t", out) == out  # an earlier export is replaced
    assert export_draft("spire", path, target, "t", out, vllm=False) == out  # vLLM's form left out: replaced too
    # a user's file put in an earlier export is never deleted (a new user lost notes this way): refused, untouched
    for mine in (out / "notes.md", out / "mydata" / "notes.md"):
        mine.parent.mkdir(exist_ok=True)
        mine.write_text("mine")
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        with pytest.raises(ConfigError, match=f"holds {mine.relative_to(out)}, which this export does not write"):
            export_draft("spire", path, target, "t", out)
        assert mine.read_text() == "mine" and sorted(p.relative_to(out) for p in out.rglob("*")) == before
        mine.unlink()


def _export_round_trip(tmp_path, tiny, cfg, perturb):
    """Save a draft of ``cfg`` (its extra weights moved by ``perturb``), export it, load the export back: (model,
    export folder, loaded model); the two give the same k-pass logits exactly."""
    import torch

    from spire.drafts.spire import SpireDraftModel
    from spire.drafts.spire import load_exported_spire
    from spire.export import export_draft

    torch.manual_seed(0)
    model = SpireDraftModel(tiny, cfg)
    with torch.no_grad():
        perturb(model)
    model.save(tmp_path / "draft.safetensors")
    out = export_draft("spire", tmp_path / "draft.safetensors", tiny, "tiny", tmp_path / "export", k=3,
                       vllm=False)  # beyond the paper: spire's form alone (spire's vLLM plugin runs the paper's SPIRe)
    back = load_exported_spire(out, tiny)
    tokens = torch.randint(0, tiny.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        hidden = tiny(tokens, torch.arange(12)[None], hidden_layers=model.source_layers).hidden
        torch.testing.assert_close(back.forward_train(tokens, hidden, 3), model.forward_train(tokens, hidden, 3),
                                   atol=0, rtol=0)
    return model, out, back


def test_export_round_trip_keeps_the_feature_input(tmp_path, tiny):
    """A draft trained with feature_input (beyond the paper) exports its projection and loads back exactly."""
    import torch

    from spire.drafts.spire import SpireConfig

    model, out, back = _export_round_trip(tmp_path, tiny, SpireConfig(n_draft_layers=2, window=6, feature_input=True),
                                          lambda m: m.feature_proj.weight.normal_(0, 0.1))
    assert json.loads((out / "config.json").read_text())["spire"]["feature_input"] is True
    assert back.cfg.feature_input and torch.equal(back.feature_proj.weight, model.feature_proj.weight)


def test_export_round_trip_keeps_the_bridge(tmp_path, tiny):
    """A bridged draft (beyond the paper) exports its bridge and loads back exactly, with the same logits."""
    import torch

    from spire.drafts.spire import SpireConfig

    def perturb(m):
        m.bridge.weight.add_(0.1 * torch.randn_like(m.bridge.weight))
        m.bridge.bias.normal_(0, 0.1)
    model, out, back = _export_round_trip(tmp_path, tiny, SpireConfig(layers=(0, 3), window=6, bridge=True), perturb)
    assert json.loads((out / "config.json").read_text())["spire"]["bridge"] is True
    assert back.bridge_layer == 1 and torch.equal(back.bridge.weight, model.bridge.weight)


def test_vllm_batch_size_table_is_the_cost_models_argmax(tmp_path):
    """spire export --k-table: vLLM's num_speculative_tokens_per_batch_size holds, per batch size, the k the cost
    model rates best with the run's held-out α per position, as inclusive ranges from 1 that vLLM 0.32 accepts
    (sorted, non-overlapping, k in 0..num_speculative_tokens); the table is written into the export's config."""
    from spire.integrations.vllm_export import SPEC_FILE, batch_size_table
    from spire.serving.policy import RoundModel, batch_size_ks
    from spire.throughput.cost_model import CostOptions
    from spire.throughput.shapes import ModelShape

    assert batch_size_table([4, 4, 3, 3, 3, 0, 0]) == [[1, 2, 4], [3, 5, 3], [6, 7, 0]]
    with pytest.raises(Exception):
        batch_size_table([])
    smollm2 = ModelShape(30, 576, 3, 3, 64, 1536, 49152, True)
    options = CostOptions(weight_bytes=4, kv_bytes=4, attention_flops=True, embeddings=True, sink=1, window=64)
    model = RoundModel(smollm2, smollm2.with_layers(8), "spire", 12.0, options, options)
    alphas = [0.8, 0.7, 0.6, 0.5]
    ks = batch_size_ks(model, alphas, 4, 1024, 64)
    for B in (1, 8, 64):
        taus = [1.0, 1.8, 1.8 + 0.56, 1.8 + 0.56 + 0.336, 1.8 + 0.56 + 0.336 + 0.168]
        m = [1.0] + [taus[k] / model.delta_t(B, 1024, k) for k in range(1, 5)]
        assert ks[B - 1] == max(range(5), key=lambda k: (m[k], -k))
    assert ks[0] > 0 and ks[0] >= ks[-1]  # drafts more at B = 1 than at 64 (the verify's FLOPs grow with B)
    table = batch_size_table(ks)
    assert table[0][0] == 1 and all(a <= b for a, b, _ in table)
    assert all(table[i][1] + 1 == table[i + 1][0] for i in range(len(table) - 1)) and table[-1][1] == 64

    target = make_tiny()
    _, path = _trained_spire(target, tmp_path)
    out = export_draft("spire", path, target, "tiny-target", tmp_path / "export", k=3, k_table=[[1, 2, 5], [3, 9, 0]])
    spec = json.loads((out / SPEC_FILE).read_text())
    assert spec["num_speculative_tokens"] == 3
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 9, 0]]  # at most k
