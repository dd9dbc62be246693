"""The EAGLE-3 draft (spire.drafts.eagle3): target layer ids are HF's hidden states, teacher-forced training logits
are what the drafting loop computes, speculative decoding with it is lossless (greedy identity, sampled PIT at every
position including the bonus token), checkpoints and speculators folders round-trip and are refused when they do not
fit, and the real `speculators` package (PyPI) computes the same logits from spire's export and spire from its."""

from __future__ import annotations

import json
import types

import pytest
import torch

from spire.drafts.eagle3 import (DraftTargetMismatchError, Eagle3Config, Eagle3Draft, Eagle3DraftModel,
                                 default_layer_ids, export_speculators, load_speculators)
from spire.training.losses import kl_loss_logp
from spire.errors import CheckpointError, ConfigError, TokenizerMismatchError
from spire.model import ForwardOutput
from spire.sampling import SamplingParams
from tests.oracle import generate
from spire.training.losses import acceptance_alpha_logp
from tests.conftest import make_tiny

V = 97


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target8():
    """spire's tiny random target with 8 layers (speculators' default ids (2, 4, 5) fit it)."""
    return make_tiny(n_layers=8)


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """(HF LlamaForCausalLM, its folder, spire's Transformer of that folder): 8 layers, random non-trivial weights."""
    import transformers as tf

    from spire.loading import load_model
    from tests.families import randomize_

    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(hf, 0)
    folder = tmp_path_factory.mktemp("verifier")
    hf.save_pretrained(folder)
    return hf.eval(), folder, load_model(folder)


def _draft(target, cfg=None, n_vocab=60, seed=1):
    """A draft with weights moved well away from its initialization (so that nothing matches by accident)."""
    cfg = cfg or Eagle3Config(draft_vocab=n_vocab)
    g = torch.Generator().manual_seed(seed)
    N = cfg.vocab_columns(target.cfg.vocab_size)
    vocab = None if N is None else torch.randperm(target.cfg.vocab_size, generator=g)[:N].sort().values
    m = Eagle3DraftModel(target, cfg, vocab)
    with torch.no_grad():
        for p in m.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.add_(0.3 * noise) if p.dim() == 2 else p.mul_(1 + 0.2 * noise)
    return m.eval()


def _positions(tokens):
    return torch.arange(tokens.shape[1])[None].expand_as(tokens)


# --- layer ids ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_layer_ids_are_hf_output_hidden_states(hf_target):
    """Id j < n: the residual stream entering layer j = HF's output_hidden_states[j] (hidden_states[0] is the
    embedding output), what spire's Transformer returns for hidden_layers; id n: the final residual stream before
    the final norm (HF's hidden_states[n] is after it)."""
    hf, _, target = hf_target
    n = target.cfg.n_layers
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = hf(tokens, output_hidden_states=True).hidden_states
        ours = target(tokens, _positions(tokens), hidden_layers=range(n + 1)).hidden
    assert len(hs) == n + 1
    for j in range(n):
        torch.testing.assert_close(ours[j], hs[j], rtol=0, atol=1e-5)
    torch.testing.assert_close(target.model.norm(ours[n]), hs[n], rtol=0, atol=1e-5)
    assert (ours[n] - hs[n]).abs().max() > 0.1  # HF's last entry is normed: not the pre-norm stream
    assert default_layer_ids(n) == (2, 4, 5)
    m = Eagle3DraftModel(target, Eagle3Config(draft_vocab=0))
    assert m.target_layers() == (2, 4, 5) and Eagle3Draft(m).hidden_layers == (2, 4, 5)


# --- training == inference ------------------------------------------------------------------------------------

CASES = [
    (3, {}),
    (4, {"norm_before_residual": True, "norm_output": True, "fc_norm": True, "layers": (0, 3, 8)}),
    (2, {"norm_before_fc": True, "draft_vocab": 0, "window": 5, "sink": 1}),
]


@pytest.mark.parametrize("k,extra", CASES)
def test_train_logits_equal_step_by_step_inference(target8, k, extra):
    """Every position t of train_logits equals what the drafting loop gives at t: a chain started at the chunk
    start s = t - t mod k from the target's features (the prefix < s observed), its own features afterwards."""
    m = _draft(target8, Eagle3Config(**{"draft_vocab": 60, **extra})).requires_grad_(False)  # as a loaded draft
    B, T = 2, 4 * k
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(k))
    pos = _positions(tokens)
    with torch.no_grad():
        out = target8(tokens, pos, hidden_layers=m.layer_ids)
        train = m.train_logits(tokens, out.hidden, k)  # (B, T, N)
    assert train.shape == (B, T, m.n_vocab) and train.dtype == torch.float32
    draft = Eagle3Draft(m)
    for s in range(0, T, k):
        draft.start(target8, None, B, T + 1, k)
        if s > 0:
            draft.observe(tokens[:, :s], pos[:, :s], ForwardOutput(out.logits[:, :s],
                                                                   {j: h[:, :s] for j, h in out.hidden.items()}))
        for j in range(k):
            got = draft.step(tokens[:, s + j: s + j + 1], pos[:, s + j: s + j + 1])  # (B, V)
            want = m.to_target_vocab(train[:, s + j])
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_training_gradients_and_bf16(target8):
    """train_logits is differentiable into every trainable weight (the frozen head of train_head=False gets none),
    and under bf16 autocast it runs and stays close to float32."""
    m = _draft(target8, Eagle3Config(draft_vocab=60, train_head=False)).train()
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = target8(tokens, _positions(tokens), hidden_layers=m.layer_ids).hidden
    logits = m.train_logits(tokens, hidden, 4)
    logits.float().pow(2).mean().backward()
    assert not m.lm_head.weight.requires_grad and m.lm_head.weight.grad is None
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = m.train_logits(tokens, hidden, 4)
    assert low.dtype == torch.float32
    assert (low - logits.detach()).abs().max() < 0.1 * logits.detach().abs().max()


def test_for_training_and_the_kl_loss(target8):
    """for_training: the TrainConfig's eagle3 settings, the N most frequent training tokens, the head's rows and
    the final norm from the target. kl_loss_logp: KL(p' || q) with p' the target renormalized over the draft
    vocabulary (speculators' kl_div_loss), its gradient, and alpha with the target's true p."""
    counts = torch.arange(V).repeat_interleave(torch.arange(V) % 7 + 1)  # token i appears (i mod 7) + 1 times
    data = types.SimpleNamespace(train=types.SimpleNamespace(tokens=counts.numpy()))
    cfg = types.SimpleNamespace(seed=0, draft_config=Eagle3Config(draft_vocab=40))
    m = Eagle3DraftModel.for_training(target8, cfg, data)
    want = sorted(sorted(range(V), key=lambda i: (-(i % 7), i))[:40])
    assert m.vocab.tolist() == want and m.kind == "eagle3" and m.default_loss == "kl"
    assert torch.equal(m.lm_head.weight, target8.lm_head.weight[m.vocab])
    assert torch.equal(m.norm.weight, target8.model.norm.weight)
    assert m.to_draft_ids(torch.tensor([want[3], 7])).tolist() == [3, -100]  # 7 is one of the rarest
    full = Eagle3DraftModel.for_training(target8, types.SimpleNamespace(seed=0), None)  # defaults: 16384 >= V
    assert full.vocab is None and full.n_vocab == V

    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 40, generator=g, requires_grad=True)
    logp_full = torch.log_softmax(torch.randn(5, V, generator=g), -1)
    logp = logp_full[:, m.vocab]  # normalized over V: sums to < 1 over the draft vocabulary
    terms = kl_loss_logp(z, logp)
    p = torch.softmax(logp, -1)
    ref = (p * (p.log() - torch.log_softmax(z, -1))).sum(-1).mean()
    torch.testing.assert_close(terms.loss, ref, rtol=1e-5, atol=1e-6)
    terms.loss.backward()
    torch.testing.assert_close(z.grad, (torch.softmax(z, -1) - p).detach() / 5, rtol=1e-4, atol=1e-6)
    assert terms.alpha == pytest.approx(float(acceptance_alpha_logp(z, logp).mean()), rel=1e-6)


def test_the_trainer_trains_checkpoints_resumes_and_exports_it(tmp_path, target8):
    """spire's trainer drives the training interface: a few steps (MixedLoss with omega = 1, the distillation loss,
    until the trainer knows "kl"), a checkpoint and the run folder's ``eagle3/`` speculators export, an exact resume,
    and ``--draft eagle3 --draft-path RUN`` decodes losslessly with the trained draft."""
    import dataclasses

    from spire.drafts import make_draft
    from spire.training.distill import train_draft
    from tests.train_worker import RepeatingData, config

    data = RepeatingData()
    cfg = dataclasses.replace(config("eagle3", 4, 4), loss="mixed", omega=1.0)
    model, state = train_draft(target8, data, tmp_path / "run", cfg, heldout=data.seqs[:2], progress=False, log=None)
    assert isinstance(model, Eagle3DraftModel) and state["step"] == 4 and len(state["heldout"]["alpha_per_position"]) == 4
    assert (tmp_path / "run" / "eagle3" / "config.json").is_file()
    _, state = train_draft(target8, data, tmp_path / "run", dataclasses.replace(cfg, max_steps=6), progress=False,
                           log=None)
    assert state["step"] == 6
    draft = make_draft("eagle3", target8, path=str(tmp_path / "run"))
    prompts = [data.seqs[0, :10].tolist(), data.seqs[3, :3].tolist()]
    assert generate(target8, prompts, 12, draft=draft, k=4).tokens == generate(target8, prompts, 12).tokens


# --- the round loop -------------------------------------------------------------------------------------------

def test_greedy_decoding_equals_autoregressive(target8):
    """Greedy SD with an EAGLE-3 draft emits AD's tokens, in a batch of mixed prompt lengths (one of a single token:
    no prefill), with a draft vocabulary and with the whole vocabulary."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 17, 150)]
    ad = generate(target8, prompts, 40)
    for cfg in (Eagle3Config(draft_vocab=60), Eagle3Config(draft_vocab=0, norm_output=True)):
        sd = generate(target8, prompts, 40, draft=Eagle3Draft(_draft(target8, cfg)), k=4)
        assert sd.tokens == ad.tokens
        assert sd.emitted == [40, 40, 40]


def _soft_target():
    target = make_tiny(seed=11)  # 4 layers
    with torch.no_grad():  # soften the tiny model so that many tokens have mass
        target.lm_head.weight.mul_(0.35)
    return target


def test_drafts_after_rollbacks_equal_a_fresh_draft():
    """Sampled SD (accepts of 0 .. k tokens): every drafted step of every round, for every row still decoding,
    equals a fresh draft that observed only the committed text before the round (the cache invariant: entries of
    rejected tokens are never read, the features of the verified ones are)."""
    target = _soft_target()
    m = _draft(target, Eagle3Config(draft_vocab=70, layers=(1, 2, 4)), seed=3)
    draft = Eagle3Draft(m)
    calls = []
    step = draft.step
    draft.step = lambda tokens, pos: calls.append((tokens.clone(), pos.clone(), step(tokens, pos))) or calls[-1][2]
    prompts = [[5, 17, 42, 8], [3, 71, 9, 9, 30, 2, 61], [44]]
    k, new = 3, 12
    res = generate(target, prompts, new, draft=draft, k=k, params=SamplingParams(1.0),
                   generator=torch.Generator().manual_seed(5))
    seen = {a for rnd in res.accepted_per_round for a in rnd}
    assert 0 in seen and k in seen and seen & {1, 2}
    done = [0] * len(prompts)
    for r, accepted in enumerate(res.accepted_per_round):
        for b, prompt in enumerate(prompts):
            if done[b] >= new:
                continue
            text = prompt + res.tokens[b]
            pos0 = len(prompt) + done[b] - 1  # the pending token's position
            seq = torch.tensor([text])
            fresh = Eagle3Draft(m)
            fresh.start(target, None, 1, len(text) + k + 1, k)
            if pos0 > 0:
                with torch.no_grad():
                    out = target(seq[:, :pos0], _positions(seq[:, :pos0]), hidden_layers=m.layer_ids)
                fresh.observe(seq[:, :pos0], _positions(seq[:, :pos0]), out)
            for j in range(k):
                tokens, pos, logits = calls[r * k + j]
                assert int(pos[b]) == pos0 + j
                got = fresh.step(tokens[b: b + 1], pos[b: b + 1])
                torch.testing.assert_close(logits[b: b + 1], got, rtol=1e-4, atol=1e-4)
            done[b] += accepted[b] + 1


def _accepting_draft(target, n_vocab=80):
    """An untrained draft whose fc reads only the final residual stream (id n): at a chain's start it proposes about
    the target's own distribution at the previous position, so that on the softened target about a third of the
    rounds accept everything (many bonus tokens)."""
    torch.manual_seed(0)
    n, d = target.cfg.n_layers, target.cfg.d_model
    m = Eagle3DraftModel(target, Eagle3Config(draft_vocab=n_vocab, layers=(1, 2, n)), torch.arange(n_vocab))
    with torch.no_grad():
        m.fc.weight.zero_()
        m.fc.weight[:, 2 * d:] = torch.eye(d)
    return m.eval()


PIT_PARAMS = SamplingParams(0.8, top_p=0.95)


@pytest.mark.slow
def test_sampled_decoding_is_lossless_at_every_position_including_the_bonus_token():
    """The PIT chi-square of tests/test_sampling_positions.py (every emitted token's randomized probability
    integral transform under the target's exact p is uniform: all, per block position, the bonus token after a full
    accept, the first token of the second round, per prompt length) with an EAGLE-3 draft over a draft vocabulary
    (q = 0 outside it), temperature and top-p."""
    from tests.test_sampling_positions import LENGTHS, ROWS, _pit_groups, _uniform_pvalue

    target = _soft_target()
    groups = _pit_groups(target, Eagle3Draft(_accepting_draft(target)), PIT_PARAMS, seed=31)
    assert len(groups["bonus"]) > 300 and len(groups["round2-first"]) == ROWS * len(LENGTHS)
    pvalues = {key: _uniform_pvalue(u) for key, u in groups.items()}
    assert min(pvalues.values()) > 1e-3, pvalues


def test_the_pit_statistic_catches_a_wrong_bonus_with_this_draft(monkeypatch):
    """Power: with the bonus drawn from normalize(max(p_k - q_{k-1}, 0)) (the named off-by-one) the same statistic
    rejects the bonus group with this draft."""
    import tests.oracle as spec
    from tests.test_sampling_positions import _pit_groups, _uniform_pvalue
    from tests.test_verification import _mutant_verify

    target = _soft_target()
    monkeypatch.setattr(spec, "verify", _mutant_verify("bonus-residual"))
    groups = _pit_groups(target, Eagle3Draft(_accepting_draft(target)), PIT_PARAMS, seed=31)
    assert _uniform_pvalue(groups["bonus"]) < 1e-3


# --- persistence and refusals ---------------------------------------------------------------------------------

def test_checkpoint_round_trip_and_refusals(tmp_path, target8):
    m = _draft(target8, Eagle3Config(draft_vocab=60, fc_norm=True, norm_output=True))
    path = tmp_path / "draft.safetensors"
    m.save_checkpoint(path, target8, {"train": {"step": 3}})
    back = Eagle3DraftModel.load(path, target8)
    assert back.cfg == m.cfg and torch.equal(back.vocab, m.vocab)
    for (name, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    fresh = Eagle3DraftModel(target8, Eagle3Config(draft_vocab=60, fc_norm=True, norm_output=True))
    fresh.load_checkpoint(path, target8)  # the trainer's resume
    assert torch.equal(fresh.fc.weight, m.fc.weight) and torch.equal(fresh.vocab, m.vocab)
    with pytest.raises(CheckpointError, match="EAGLE-3 settings"):
        Eagle3DraftModel(target8, Eagle3Config(draft_vocab=60)).load_checkpoint(path, target8)
    with pytest.raises(TokenizerMismatchError):  # another target
        Eagle3DraftModel.load(path, make_tiny(seed=5, n_layers=8))
    from spire.drafts.spire import SpireConfig, SpireDraftModel

    SpireDraftModel(target8, SpireConfig(n_draft_layers=2)).save(tmp_path / "spire.safetensors")
    with pytest.raises(CheckpointError, match="not an EAGLE-3 draft"):
        Eagle3DraftModel.load(tmp_path / "spire.safetensors", target8)


@pytest.mark.parametrize("kw,match", [
    ({"layers": (2, 4, 9)}, r"\[0, 8\]"),  # beyond the final residual stream (id 8)
    ({"layers": (2, 2, 5)}, "distinct"),
    ({"layers": (-1, 2, 5)}, "distinct"),
    ({"embed_requires_grad": True}, "embed_requires_grad"),
    ({"num_layers": 2}, "one decoder layer"),
    ({"norm_before_fc": True, "fc_norm": True}, "mutually exclusive"),
    ({"draft_vocab": -1}, "vocabulary"),
    ({"window": 0}, "window"),
])
def test_config_refusals(target8, kw, match):
    with pytest.raises(ConfigError, match=match):
        Eagle3DraftModel(target8, Eagle3Config(**kw))


def test_default_layer_ids_need_six_layers():
    with pytest.raises(ConfigError, match="default layer ids"):
        Eagle3DraftModel(make_tiny(n_layers=4), Eagle3Config())  # (2, 2, 1)


def _rewrite(folder, **changes):
    c = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(c.get(key), dict):
            c[key] = {**c[key], **value}
        else:
            c[key] = value
    (folder / "config.json").write_text(json.dumps(c))


def test_speculators_folder_round_trip_and_refusals(tmp_path, target8):
    from spire.drafts import make_draft
    from spire.drafts.spire import SpireConfig, SpireDraftModel
    from spire.export import export_draft

    m = _draft(target8, Eagle3Config(draft_vocab=60, norm_before_residual=True, layers=(1, 4, 8)))
    out = export_speculators(m, tmp_path / "e3", target8, k=3, verifier_name_or_path="tiny")
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["speculators_config"]["algorithm"] == "eagle3"
    assert c["draft_vocab_size"] == 60 and c["eagle_aux_hidden_state_layer_ids"] == [1, 4, 8]
    assert c["transformer_layer_config"]["model_type"] == "llama" and c["norm_before_residual"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        assert "layers.0.hidden_norm.weight" in f.keys() and "fc.weight" in f.keys()
    assert torch.equal(torch.arange(60) + d2t, m.vocab) and t2d.dtype == torch.bool and int(t2d.sum()) == 60
    back = load_speculators(out, target8)
    for (name, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    assert isinstance(make_draft("eagle3", target8, path=str(out)), Eagle3Draft)  # --draft eagle3 --draft-path
    again = export_draft("eagle3", out, target8, "tiny", tmp_path / "again", k=2)  # `spire export --draft eagle3`
    assert json.loads((again / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 2

    with pytest.raises(DraftTargetMismatchError):  # another target: its fingerprint, or its embedding
        load_speculators(out, make_tiny(seed=5, n_layers=8))
    with pytest.raises(CheckpointError, match="hidden size"):
        load_speculators(out, make_tiny(n_layers=8, d_model=32, d_ff=64, d_head=8))
    spire_path = tmp_path / "spire.safetensors"
    SpireDraftModel(target8, SpireConfig(n_draft_layers=2)).save(spire_path)
    spire_out = export_draft("spire", spire_path, target8, "tiny", tmp_path / "spire-export")
    with pytest.raises(CheckpointError, match="is an exported SPIRe draft, not an EAGLE-3 draft: give it as "
                                              "--draft spire --draft-path"):
        load_speculators(spire_out, target8)
    for changes, match in [({"some_new_flag": True}, "some_new_flag"),
                           ({"embed_requires_grad": True}, "embed_requires_grad"),
                           ({"speculators_version": "1.0.0"}, "speculators 1.0.0"),
                           ({"transformer_layer_config": {"num_hidden_layers": 2}}, "one"),
                           ({"transformer_layer_config": {"model_type": "mistral"}}, "not implemented"),
                           ({"draft_vocab_size": 61}, "d2t")]:
        bad = tmp_path / f"bad-{len(changes)}-{match}"
        export_speculators(m, bad, target8)
        _rewrite(bad, **changes)
        with pytest.raises(CheckpointError, match=match):
            load_speculators(bad, target8)
    windowed = _draft(target8, Eagle3Config(draft_vocab=0, window=8, sink=2))
    with pytest.raises(ConfigError, match="sink \\+ window"):  # beyond EAGLE-3: refused unless asked for
        export_speculators(windowed, tmp_path / "w", target8)
    back = load_speculators(export_speculators(windowed, tmp_path / "w", target8, allow_extensions=True), target8)
    assert back.view == windowed.view and back.vocab is None  # spire's section restores the view


def test_a_gemma3_target_scaled_embedding_and_its_own_ropes(tmp_path):
    """A Gemma 3 target (embedding times sqrt(d), local and global RoPE, q/k norms): the draft reads its scaled
    embedding and its first layer's RoPE, decodes losslessly, and its speculators folder stores the scaled rows
    (a reader's plain embedding gives the same vectors), read back to the same draft."""
    from spire.loading import load_model
    from tests.families import build_checkpoint

    build_checkpoint("gemma3", tmp_path / "gemma3")
    target = load_model(tmp_path / "gemma3")
    assert target.cfg.embed_scale != 1.0
    m = _draft(target, Eagle3Config(draft_vocab=100, layers=(0, 1, 2)))
    assert m.rope_spec == target.cfg.rope_of(0) and m.layer_cfg.family == "llama"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 20)]
    assert generate(target, prompts, 16, draft=Eagle3Draft(m), k=3).tokens == generate(target, prompts, 16).tokens
    with pytest.raises(ConfigError, match="scales its embedding"):
        export_speculators(m, tmp_path / "no-embed", target, embed_tokens=False)
    out = export_speculators(m, tmp_path / "e3", target)
    from safetensors.torch import load_file

    stored = load_file(str(out / "model.safetensors"))["embed_tokens.weight"]
    tokens = torch.tensor([[5, 9, 100]])
    torch.testing.assert_close(stored[tokens], target.model.embed_tokens(tokens), rtol=0, atol=0)
    back = load_speculators(out, target)
    for (name, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


# --- the real speculators package -----------------------------------------------------------------------------

def _speculators_logits(sm, hidden_cat, tokens, k):
    """speculators' Eagle3DraftModel.forward on one row: per TTT step s, the logits (T - 1, N) of the chain starting
    at text position c = i + 1 after s drafted steps (index i), captured from its lm_head."""
    T = tokens.shape[1]
    caught = []
    hook = sm.lm_head.register_forward_hook(lambda mod, inp, out: caught.append(out[0].detach()))
    try:
        with torch.no_grad():
            sm(hidden_states=hidden_cat[:, :-1], input_ids=tokens[:, 1:], document_ids=torch.zeros(1, T - 1,
               dtype=torch.long), position_ids=torch.arange(1, T)[None], ttt_steps=k)  # shift_batch's layout
    finally:
        hook.remove()
    return caught


@pytest.mark.slow  # vllm-project/speculators (make test installs it)
def test_speculators_reads_spires_export(tmp_path, hf_target):
    """(a) speculators' Eagle3DraftModel.from_pretrained on spire's folder (the verifier an HF folder) computes, at
    every TTT depth, the logits spire's train_logits gives for the same chain (<= 1e-4, float32)."""
    pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel as SpecEagle3, Eagle3SpeculatorConfig

    _, folder, target = hf_target
    m = _draft(target, Eagle3Config(draft_vocab=60, norm_before_residual=True, norm_output=True))
    out = export_speculators(m, tmp_path / "e3", target, k=3, verifier_name_or_path=str(folder))
    cfg = Eagle3SpeculatorConfig.from_pretrained(out)
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU build
    sm = SpecEagle3.from_pretrained(out, config=cfg).eval()
    assert torch.equal(torch.arange(60) + sm.d2t, m.vocab) and torch.equal(sm.t2d.nonzero().flatten(), m.vocab)
    k, T = 3, 16
    tokens = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = target(tokens, _positions(tokens), hidden_layers=m.layer_ids).hidden
        ours = m.train_logits(tokens[:, :15], {j: h[:, :15] for j, h in hidden.items()}, k)[0]  # (15, N)
    theirs = _speculators_logits(sm, torch.cat([hidden[j] for j in m.layer_ids], -1), tokens, k)
    assert len(theirs) == k
    compared = 0
    for c in range(k, 15, k):  # chains start at c; spire's position c + j is speculators' step j at index c - 1
        for j in range(k):
            torch.testing.assert_close(theirs[j][c - 1], ours[c + j], rtol=1e-4, atol=1e-4)
            compared += 1
    assert compared == 12


@pytest.mark.slow  # vllm-project/speculators (make test installs it)
def test_spire_reads_a_speculators_checkpoint(tmp_path, hf_target):
    """(b) A random-weight Eagle3 checkpoint written by speculators (its config for this Llama verifier, vocabulary
    maps, verifier weights loaded as speculators loads them) is read by load_speculators, whose inference draft
    gives speculators' logits (<= 1e-4, float32)."""
    pytest.importorskip("speculators")
    import transformers as tf
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel as SpecEagle3, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    _, folder, target = hf_target
    layer = tf.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6,
                           max_position_embeddings=256)
    layer._attn_implementation = "eager"
    ids = [1, 3, 6]
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=50, eagle_aux_hidden_state_layer_ids=ids,
        norm_before_fc=True, speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(folder))))
    torch.manual_seed(7)
    sm = SpecEagle3(cfg)
    vocab = torch.randperm(V)[:50].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vocab] = True
    sm.load_vocab_mappings(t2d, vocab - torch.arange(50))
    sm.load_verifier_weights()  # the verifier's embedding and head rows, as speculators' training starts
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in sm.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                p.add_(0.3 * torch.randn(p.shape, generator=g)) if p.dim() == 2 else p.mul_(
                    1 + 0.2 * torch.randn(p.shape, generator=g))
    sm.save_pretrained(tmp_path / "spec")
    sm.eval()

    m = load_speculators(tmp_path / "spec", target)
    assert m.layer_ids == (1, 3, 6) and m.cfg.norm_before_fc and torch.equal(m.vocab, vocab)
    T, k = 14, 3
    tokens = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(3))
    pos = _positions(tokens)
    with torch.no_grad():
        out = target(tokens, pos, hidden_layers=m.layer_ids)
    theirs = _speculators_logits(sm, torch.cat([out.hidden[j] for j in ids], -1), tokens, k)
    draft = Eagle3Draft(m)
    for c in (1, 5, 9):  # spire's inference draft: chains starting at c after observing positions < c
        draft.start(target, None, 1, T + 1, k)
        draft.observe(tokens[:, :c], pos[:, :c], ForwardOutput(out.logits[:, :c],
                                                               {j: h[:, :c] for j, h in out.hidden.items()}))
        for j in range(k):
            got = draft.step(tokens[:, c + j: c + j + 1], pos[:, c + j: c + j + 1])[0, m.vocab]
            torch.testing.assert_close(got, theirs[j][c - 1], rtol=1e-4, atol=1e-4)


def test_a_draft_of_another_kind_is_one_error_naming_its_kind(tmp_path, target8):
    """A draft of another kind than --draft is refused with one wording for every kind and form
    (:func:`spire.formats.draft_file.other_kind_error`), naming what it is and how to give it: a SPIRe file given
    as eagle3 (the message named only the missing eagle3_config) or vanilla, an EAGLE-3 file given as spire (a
    KeyError traceback) or vanilla, an HF model folder given as eagle3 (it said "not a speculators folder")."""
    from spire.drafts import make_draft
    from spire.drafts.spire import SpireConfig, SpireDraftModel

    SpireDraftModel(target8, SpireConfig(n_draft_layers=2)).save(tmp_path / "s.safetensors")
    Eagle3DraftModel(target8, Eagle3Config()).save(tmp_path / "e.safetensors")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256}))
    for asked, given, is_ in (("eagle3", "s.safetensors", "a SPIRe draft, not an EAGLE-3 draft"),
                              ("vanilla", "s.safetensors", "a SPIRe draft, not a vanilla draft"),
                              ("spire", "e.safetensors", "an EAGLE-3 draft, not a SPIRe draft"),
                              ("vanilla", "e.safetensors", "an EAGLE-3 draft, not a vanilla draft"),
                              ("eagle3", "hf", "an HF model folder, not an EAGLE-3 draft")):
        path = tmp_path / given
        found = {"s.safetensors": "spire", "e.safetensors": "eagle3", "hf": "vanilla"}[given]
        with pytest.raises(CheckpointError) as e:
            make_draft(asked, target8, path=str(path))
        assert str(e.value) == f"{path} is {is_}: give it as --draft {found} --draft-path {path}"
