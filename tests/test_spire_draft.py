"""The SPIRe draft: k-pass training forward == step-by-step inference; feedback memory (CASES.md 8)."""

import copy

import pytest
import torch

from spire.formats import draft_file
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.errors import CheckpointError, ConfigError, TokenizerMismatchError
from spire.model import ForwardOutput
from tests.conftest import make_tiny
from tests.helpers import with_backend


def _draft(target, n=2, window=6, sink=1, mix_init=1.0, seed=1):
    torch.manual_seed(seed)
    m = SpireDraftModel(target, SpireConfig(n_draft_layers=n, sink=sink, window=window, mix_init=mix_init))
    with torch.no_grad():  # move away from the target's weights so that nothing matches by accident
        m.mix_logits.normal_(0, 1.0)
        for p in m.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.eval()


@pytest.mark.parametrize("k,window", [(4, 6), (3, 64), (2, 3)])
def test_training_forward_matches_inference(tiny, k, window):
    """Paper Fig. 2: pass j of the k-pass procedure must produce exactly the logits the drafting loop
    produces at the same position, given the same verified prefix and teacher-forced tokens."""
    torch.manual_seed(0)
    T = 8 * k
    tokens = torch.randint(0, tiny.cfg.vocab_size, (2, T))
    _assert_training_matches_inference(tiny, _draft(tiny, n=2, window=window), tokens, k)


@pytest.mark.parametrize("k,window,sink,extra", [(4, 8, 1, {}), (2, 6, 2, {"self_attend": False}),
                                                  (3, 7, 0, {"feedback_memory": False}), (4, 5, 1, {"window": 9})])
def test_chunked_k_pass_equals_dense(tiny, monkeypatch, k, window, sink, extra):
    """With a window, the k-pass forward groups blocks into chunks that read only the target keys their window
    can reach (SpireDraftModel._chunks): logits and gradients equal the dense layout's, where every query reads
    every position (float32 rounding)."""
    torch.manual_seed(0)
    T = 16 * k
    m = SpireDraftModel(tiny, SpireConfig(**{"n_draft_layers": 2, "sink": sink, "window": window, "mix_init": 1.0,
                                            **extra}))
    tokens = torch.randint(0, tiny.cfg.vocab_size, (3, T))
    with torch.no_grad():
        hidden = tiny(tokens, torch.arange(T)[None].expand(3, T), hidden_layers=m.source_layers).hidden
    G, C, _, _ = m._chunks(T, k, tokens.device)
    assert C > 1 and G * C == T // k
    results = []
    for dense in (False, True):
        if dense:  # the switch benchmarks/train_throughput.py --levers times the old path with
            with_backend(monkeypatch, m, chunked_kpass=False)
            assert m._chunks(T, k, tokens.device)[1] == 1
        m.zero_grad()
        logits = m.forward_train(tokens, hidden, k)
        (logits.float() ** 2).mean().backward()
        results.append((logits.detach(), m.layers[0].self_attn.q_proj.weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-6)


def test_chunked_layout_falls_back_where_it_reads_no_fewer_keys(tiny):
    """A sink longer than the sequence, or a window so wide that a chunk reads every position: the dense layout
    (it used to index past the sequence with a sink > T)."""
    for sink, window, T, k in ((40, 4, 32, 2), (1, 52, 56, 4)):
        m = SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, sink=sink, window=window, mix_init=1.0))
        assert m._chunks(T, k, torch.device("cpu"))[1] == 1
        tokens = torch.randint(0, tiny.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            hidden = tiny(tokens, torch.arange(T)[None].expand(2, T), hidden_layers=m.source_layers).hidden
            assert torch.isfinite(m.forward_train(tokens, hidden, k)).all()


def _assert_training_matches_inference(target, model, tokens, k):
    """For every block start s (verified prefix = positions < s), the drafting loop through the real caches
    gives the k-pass training logits at s .. s + k - 1 (float32, 1e-4)."""
    B, T = tokens.shape
    pos = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        out = target(tokens, pos, hidden_layers=model.source_layers)
        train_logits = model.forward_train(tokens, out.hidden, k)
    draft = SpireDraft(model)
    for s in range(0, T, k):
        draft.start(target, None, B, T + 1, k)
        if s > 0:
            hid = {j: h[:, :s] for j, h in out.hidden.items()}
            draft.observe(tokens[:, :s], pos[:, :s], ForwardOutput(out.logits[:, :s], hid))
        for j in range(k):
            step_logits = draft.step(tokens[:, s + j: s + j + 1], pos[:, s + j: s + j + 1])
            torch.testing.assert_close(step_logits, train_logits[:, s + j], atol=1e-4, rtol=1e-4)


def test_pruned_initialization_copies_last_layers(tiny):
    m = SpireDraftModel(tiny, SpireConfig(n_draft_layers=2))
    assert m.source_layers == (2, 3)
    for i, j in enumerate(m.source_layers):
        for (na, a), (nb, b) in zip(m.layers[i].named_parameters(), tiny.layers[j].named_parameters()):
            assert na == nb and torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert all(p.requires_grad for p in m.layers.parameters())
    assert not tiny.model.embed_tokens.weight.requires_grad
    with pytest.raises(ConfigError):
        SpireDraftModel(tiny, SpireConfig(n_draft_layers=5))


def test_feedback_memory_weights():
    """CASES.md 8: logits [0, 20, 0, ...] select the activation after draft layer 1; rows sum to 1;
    memory is kept along time and per row."""
    target = make_tiny(n_layers=4)
    m = SpireDraftModel(target, SpireConfig(n_draft_layers=3))
    with torch.no_grad():
        m.mix_logits.zero_()
        m.mix_logits[0, 1] = 20.0
    xs = [torch.randn(2, 5, target.cfg.d_model) for _ in range(4)]
    mem = m.memory(xs)  # (n_d, B, T, d)
    assert mem.shape == (3, 2, 5, target.cfg.d_model)
    torch.testing.assert_close(mem[0], xs[1], rtol=1e-6, atol=1e-6 * xs[1].abs().max().item())
    torch.testing.assert_close(m.mix_logits.softmax(-1).sum(-1), torch.ones(3))
    # per row and per time step: changing row 1 / time 3 changes only that entry
    xs2 = [x.clone() for x in xs]
    xs2[1][1, 3] += 1.0
    diff = (m.memory(xs2) - mem).abs().sum((0, 3))  # (B, T)
    assert diff[1, 3] > 0 and diff.sum() == diff[1, 3]


def test_save_load_roundtrip_and_mismatch(tmp_path, tiny):
    m = _draft(tiny)
    m.save(tmp_path / "d.safetensors", {"note": 1})
    m2 = SpireDraftModel.load(tmp_path / "d.safetensors", tiny)
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    other = make_tiny(seed=5, vocab_size=101)
    with pytest.raises(TokenizerMismatchError, match="trained for target"):
        SpireDraftModel.load(tmp_path / "d.safetensors", other)
    # the same target loaded in bf16 / fp16 (spire compare's default) or rounded in place by use_bf16_weights still
    # takes its draft (exact checksums of the rounded rows); other targets do not, whatever their dtype
    from spire.fastpath import use_bf16_weights
    rounded = copy.deepcopy(tiny)
    use_bf16_weights(rounded)
    for same in (copy.deepcopy(tiny).to(torch.bfloat16), copy.deepcopy(tiny).to(torch.float16), rounded):
        assert SpireDraftModel.load(tmp_path / "d.safetensors", same).vocab is None
    for seed in range(1, 40):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with pytest.raises(TokenizerMismatchError, match="trained for target"):
                SpireDraftModel.load(tmp_path / "d.safetensors", make_tiny(seed=seed).to(dtype))
    perturbed = copy.deepcopy(tiny)
    with torch.no_grad():
        perturbed.model.embed_tokens.weight.mul_(1.01)
    with pytest.raises(TokenizerMismatchError, match="trained for target"):
        SpireDraftModel.load(tmp_path / "d.safetensors", perturbed.to(torch.bfloat16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_draft_with_non_finite_weights_is_refused_at_load(tmp_path, tiny, bad, monkeypatch):
    """A diverged draft (NaN / inf weights) is never written (issue 52), and one written otherwise (an older
    spire, a damaged copy) is refused by name: it decoded τ 1.0 at T = 0 and failed deep inside sampling at T > 0."""
    from spire.formats import draft_file

    m = _draft(tiny)
    with torch.no_grad():
        m.layers[1].mlp.down_proj.weight[0, 0] = bad
    with pytest.raises(CheckpointError, match=r"tensor 'layers.1.mlp.down_proj.weight' holds NaN or infinite"):
        m.save(tmp_path / "d.safetensors")
    assert not any(tmp_path.iterdir())
    with monkeypatch.context() as mp:  # written as a spire without the check wrote it
        mp.setattr(draft_file, "check_finite", lambda *a: None)
        m.save(tmp_path / "d.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'layers.1.mlp.down_proj.weight' holds NaN or infinite"):
        SpireDraftModel.load(tmp_path / "d.safetensors", tiny)
    from spire.export import export_draft  # nor is it exported

    with pytest.raises(CheckpointError, match=r"tensor 'layers.1.mlp.down_proj.weight' holds NaN or infinite"):
        export_draft("spire", tmp_path / "d.safetensors", tiny, "tiny", tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_fingerprint_of_a_draft_written_before_the_rounded_checksums(tiny):
    """A draft that stored only the float32 checksum: the same target in bf16 matches within 6 standard
    deviations of bf16 rounding; independent or 1 %-scaled embeddings do not."""
    from spire.formats.draft_file import fingerprint as _fingerprint, fingerprint_matches as _fingerprint_matches

    legacy = {k: v for k, v in _fingerprint(tiny).items() if not k.endswith(("_bf16", "_fp16"))}
    assert _fingerprint_matches(legacy, tiny) and _fingerprint_matches(legacy, copy.deepcopy(tiny).to(torch.bfloat16))
    assert not any(_fingerprint_matches(legacy, make_tiny(seed=s).to(torch.bfloat16)) for s in range(1, 40))
    scaled = copy.deepcopy(tiny)
    with torch.no_grad():
        scaled.model.embed_tokens.weight.mul_(1.01)
    assert not _fingerprint_matches(legacy, scaled.to(torch.bfloat16))


ABLATIONS = {
    "no-feedback": dict(feedback_memory=False),
    "no-feedback-no-target": dict(feedback_memory=False, target_activations=False),
    "full-kv": dict(window=None),
    "no-self-attend": dict(self_attend=False),
    "random-init": dict(init="random"),
    "middle-layers": dict(layers=(1, 2)),
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_ablated_training_forward_matches_inference(tiny, name):
    """Every ablation switch keeps training exact: the k-pass logits equal the drafting loop's (float32),
    through the real caches (ring cache with window, dense cache without)."""
    torch.manual_seed(0)
    k, T, B = 3, 18, 2
    cfg = SpireConfig(**{"n_draft_layers": 2, "window": 5, "mix_init": 1.0, **ABLATIONS[name]})
    model = SpireDraftModel(tiny, cfg)
    with torch.no_grad():
        model.mix_logits.normal_(0, 1.0)
        for p in model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    tokens = torch.randint(0, tiny.cfg.vocab_size, (B, T))
    _assert_training_matches_inference(tiny, model, tokens, k)


def test_ablation_switches_change_the_draft(tiny):
    """Each switch really changes the computation (guards against a flag that is read nowhere)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, tiny.cfg.vocab_size, (1, 12))
    pos = torch.arange(12)[None]

    def logits(**kw):
        torch.manual_seed(3)
        m = SpireDraftModel(tiny, SpireConfig(**{"n_draft_layers": 2, "window": 4, "mix_init": 0.0, **kw})).eval()
        with torch.no_grad():
            out = tiny(tokens, pos, hidden_layers=m.source_layers)
            return m.forward_train(tokens, out.hidden, 4)

    base = logits()
    for kw in ABLATIONS.values():
        assert (logits(**kw) - base).abs().max() > 1e-3, kw
    random = SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, init="random"))
    w = random.layers[0].self_attn.q_proj.weight.detach()
    assert abs(float(w.std()) - 0.02) < 0.005 and not torch.equal(w, tiny.layers[2].self_attn.q_proj.weight)
    assert SpireDraftModel(tiny, SpireConfig(layers=(0, 3))).source_layers == (0, 3)
    for bad in (dict(layers=(0, 0)), dict(layers=(4,)), dict(init="zeros"),
                dict(target_activations=False), dict(feedback_memory=False, target_activations=False,
                                                     self_attend=False)):
        with pytest.raises(ConfigError):
            SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, **bad))


def _feature_draft(target, window=6, layers=(2, 3), feature_from=None):
    torch.manual_seed(2)
    m = SpireDraftModel(target, SpireConfig(layers=layers, window=window, mix_init=1.0, feature_input=True,
                                            feature_from=feature_from))
    with torch.no_grad():
        m.mix_logits.normal_(0, 1.0)
        for p in m.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
        m.feature_proj.weight.normal_(0, 0.3)  # zero at initialization: make the feature count here
        m.feature_norm.weight.normal_(1, 0.2)
    return m.eval()


@pytest.mark.parametrize("k,window,layers,at,src", [(4, 6, (2, 3), 0, None), (3, 64, (2, 3), 0, None),
                                                    (3, 6, (0, 3), 1, None), (3, 6, (0, 1, 3), 2, 2),
                                                    (4, 6, (0, 1, 3), 2, 0)])
def test_feature_input_training_matches_inference(tiny, k, window, layers, at, src):
    """feature_input: pass 0 reads the target's feature at s - 1, pass j > 0 the draft's own at s + j - 1,
    added where the draft's shallow residual meets a deep target layer; the k-pass logits equal the drafting
    loop's (float32)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, tiny.cfg.vocab_size, (2, 8 * k))
    model = _feature_draft(tiny, window, layers, src)
    assert model.feature_layer == at
    _assert_training_matches_inference(tiny, model, tokens, k)


def test_feature_input_after_a_rejected_verify(tiny):
    """After a verify whose last positions were rejected (the draft observed the target's activations of
    tokens that are not the text's), drafting from the first rejected position still gives the k-pass
    training logits: stale features and keys at later positions are never read."""
    torch.manual_seed(0)
    k, T, B = 3, 24, 2
    model = _feature_draft(tiny)
    tokens = torch.randint(0, tiny.cfg.vocab_size, (B, T))
    other = torch.randint(0, tiny.cfg.vocab_size, (B, T))
    pos = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        out = tiny(tokens, pos, hidden_layers=model.source_layers)
        bad = tiny(other, pos, hidden_layers=model.source_layers)
        train_logits = model.forward_train(tokens, out.hidden, k)
    draft = SpireDraft(model)
    for s in range(k, T - k, k):
        draft.start(tiny, None, B, T + 1, k)
        draft.observe(tokens[:, :s], pos[:, :s], ForwardOutput(out.logits[:, :s], {j: h[:, :s] for j, h in out.hidden.items()}))
        stale = slice(s, s + 2)  # positions s, s + 1 observed with another text's activations (rejected)
        draft.observe(other[:, stale], pos[:, stale], ForwardOutput(bad.logits[:, stale], {j: h[:, stale] for j, h in bad.hidden.items()}))
        for j in range(k):
            step_logits = draft.step(tokens[:, s + j: s + j + 1], pos[:, s + j: s + j + 1])
            torch.testing.assert_close(step_logits, train_logits[:, s + j], atol=1e-4, rtol=1e-4)


def test_feature_input_starts_as_the_paper_draft(tiny):
    """The projection starts at zero: an untrained feature-input draft gives the paper draft's logits."""
    torch.manual_seed(0)
    tokens = torch.randint(0, tiny.cfg.vocab_size, (1, 12))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        hidden = tiny(tokens, pos, hidden_layers=(2, 3)).hidden
        torch.manual_seed(5)
        a = SpireDraftModel(tiny, SpireConfig(n_draft_layers=2)).forward_train(tokens, hidden, 3)
        torch.manual_seed(5)
        b = SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, feature_input=True)).forward_train(tokens, hidden, 3)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ConfigError, match="feature_input"):
        SpireConfig(n_draft_layers=2, feature_input=True, target_activations=False,
                    feedback_memory=False).validate(4)


def _bridge_draft(target, layers, window=6, feature=False, **extra):
    torch.manual_seed(4)
    m = SpireDraftModel(target, SpireConfig(layers=layers, window=window, mix_init=1.0, bridge=True,
                                            feature_input=feature, **extra))
    with torch.no_grad():
        m.mix_logits.normal_(0, 1.0)
        for p in m.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
        m.bridge.weight.add_(0.2 * torch.randn_like(m.bridge.weight))  # the identity at first: make it count
        m.bridge.bias.normal_(0, 0.3)
        if feature:
            m.feature_proj.weight.normal_(0, 0.3)
    return m.eval()


@pytest.mark.parametrize("k,layers,at,feature,extra", [
    (4, (2, 3), 0, False, {}), (3, (0, 3), 1, False, {}), (3, (0, 1, 3), 2, True, {}),
    (4, (0, 3), 1, False, {"window": None}), (3, (0, 3), 1, False, {"feedback_memory": False}),
    (3, (0, 3), 1, False, {"feedback_memory": False, "target_activations": False})])
def test_bridge_training_matches_inference(tiny, k, layers, at, feature, extra):
    """The bridge (beyond the paper) maps the residual stream entering the junction layer, in the k-pass training
    forward and in the drafting loop alike (also with the feature input at the same layer, a full KV cache, no
    feedback memory, no target activations): the logits agree (float32)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, tiny.cfg.vocab_size, (2, 8 * k))
    model = _bridge_draft(tiny, layers, feature=feature, **extra)
    assert model.bridge_layer == at
    _assert_training_matches_inference(tiny, model, tokens, k)


def test_bridge_starts_as_the_paper_draft_and_fits_the_target(tiny):
    """Unfitted, the bridge is the identity (the paper's draft, exactly). fit_bridge's map from the target's stream
    entering layer J to the one entering source_layers[J] equals the closed-form least squares (numpy's lstsq at
    ridge 0), its R² is the one of that map, and it beats the identity; no junction: the identity stays."""
    import numpy as np

    torch.manual_seed(0)
    tokens = torch.randint(0, tiny.cfg.vocab_size, (6, 24))
    pos = torch.arange(24)[None].expand(6, 24)
    with torch.no_grad():
        hidden = tiny(tokens, pos, hidden_layers=(0, 1, 3)).hidden
        torch.manual_seed(5)
        a = SpireDraftModel(tiny, SpireConfig(layers=(0, 3))).forward_train(tokens, hidden, 3)
        torch.manual_seed(5)
        m = SpireDraftModel(tiny, SpireConfig(layers=(0, 3), bridge=True))
        torch.testing.assert_close(m.forward_train(tokens, hidden, 3), a, atol=0, rtol=0)
    r2 = m.fit_bridge(tokens, ridge=0.0, batch_size=4)
    x = hidden[1].double().reshape(-1, tiny.cfg.d_model).numpy()
    y = hidden[3].double().reshape(-1, tiny.cfg.d_model).numpy()
    x1 = np.concatenate([x, np.ones((len(x), 1))], 1)
    w = np.linalg.lstsq(x1, y, rcond=None)[0]
    np.testing.assert_allclose(m.bridge.weight.detach().double().numpy(), w[:-1].T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(m.bridge.bias.detach().double().numpy(), w[-1], rtol=1e-4, atol=1e-5)
    expected_r2 = 1 - ((x1 @ w - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
    assert r2 == pytest.approx(expected_r2, abs=1e-5) and r2 > 1 - ((x - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
    with pytest.raises(ConfigError, match="needs a junction"):  # layers 0, 1: nothing to bridge
        SpireDraftModel(tiny, SpireConfig(layers=(0, 1), bridge=True))
    with pytest.raises(ConfigError, match="no bridge"):
        SpireDraftModel(tiny, SpireConfig(layers=(0, 3))).fit_bridge(tokens)


def test_bridge_round_trips_through_a_draft_file(tmp_path, tiny):
    """A bridged draft saves and loads back with its bridge; a file written before the bridge existed (no
    'bridge' in its configuration) loads as the paper's draft."""
    model = _bridge_draft(tiny, (0, 3))
    model.save(tmp_path / "d.safetensors")
    back = SpireDraftModel.load(tmp_path / "d.safetensors", tiny)
    assert back.cfg.bridge and back.bridge_layer == 1
    assert torch.equal(back.bridge.weight, model.bridge.weight) and torch.equal(back.bridge.bias, model.bridge.bias)
    plain = SpireDraftModel(tiny, SpireConfig(layers=(0, 3)))
    plain.save(tmp_path / "p.safetensors")
    meta, tensors = draft_file.read_draft_file(tmp_path / "p.safetensors", tiny)
    del meta["spire_config"]["bridge"]
    draft_file.write_draft_file(tmp_path / "old.safetensors", tensors, meta)
    old = SpireDraftModel.load(tmp_path / "old.safetensors", tiny)
    assert old.bridge is None and not old.cfg.bridge
