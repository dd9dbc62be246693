"""Bring your own target (issue 15): every family spire reads computes HF transformers' logits (float32, random
weights saved by transformers, several head layouts), on the per-op path, the fused native block (or a
fall-back to per op where the block does not apply) and a sink + window view; speculative decoding with
MagicDec and with a SPIRe draft equals AD for each family; a SPIRe draft of each family trains."""

from __future__ import annotations

import pytest
import torch

import spire.fastpath as fastpath
from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.kernels import available as kernels_available
from spire.kv_cache import SinkWindow
from spire.loading import load_model
from tests.oracle import generate
from tests.families import FAMILIES, LAYOUTS, PLAIN, VOCAB, build_checkpoint
from tests.helpers import with_backend

TOL = 1e-4
T_ALL, T_PREFILL = 40, 30  # crosses the tests' windows (8) and RoPE scalings' original context (32)


def _tokens(B=2, T=T_ALL, seed=1):
    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(T)[None].expand(B, T)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(HF model, spire model, checkpoint folder) per (family, layout), built once per module."""
    built = {}

    def get(name, layout="gqa"):
        if (name, layout) not in built:
            folder = tmp_path_factory.mktemp(f"{name}-{layout}")
            hf = build_checkpoint(name, folder, layout)
            built[name, layout] = (hf, load_model(folder), folder)
        return built[name, layout]

    return get


class _CountFused:
    """Counts forwards that ran through the fused native block."""

    def __init__(self, monkeypatch):
        self.n = 0
        orig = fastpath.decode_step

        def counted(*a, **kw):
            step = orig(*a, **kw)
            self.n += step.native
            return step

        monkeypatch.setattr(fastpath, "decode_step", counted)


def _fusable(model) -> int:
    """Forwards of :func:`_cached_logits` the fused block takes: the 5-token block (when its query rows per KV
    head fit the kernel) and the 5 single steps; the 2 x 30-token prefill is per op."""
    from spire.kernels import BLOCK_MAX_ROWS

    return 5 + (model.cfg.n_heads // model.cfg.n_kv_heads * 5 <= BLOCK_MAX_ROWS)


def _cached_logits(model, ids, pos, view=None):
    """Prefill T_PREFILL tokens, a verify-sized block of 5, then single decode steps: (B, T, V)."""
    cache = model.new_cache(ids.shape[0], 64)
    parts = [model(ids[:, :T_PREFILL], pos[:, :T_PREFILL], cache, view=view).logits]
    parts.append(model(ids[:, T_PREFILL:T_PREFILL + 5], pos[:, T_PREFILL:T_PREFILL + 5], cache, view=view).logits)
    for t in range(T_PREFILL + 5, ids.shape[1]):
        parts.append(model(ids[:, t:t + 1], pos[:, t:t + 1], cache, view=view).logits)
    return torch.cat(parts, 1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_hf(family, name, layout, monkeypatch):
    """max |logit - HF| <= 1e-4 in float32: uncached (per op), cached per op, cached with the fused block
    (used exactly for the plain-block families; the others must fall back to per op)."""
    hf, model, _ = family(name, layout)
    ids, pos = _tokens()
    with torch.no_grad():
        ref = hf(ids).logits.float()
        assert (model(ids, pos).logits - ref).abs().max() <= TOL
        with_backend(monkeypatch, model, fused_block=False)
        assert (_cached_logits(model, ids, pos) - ref).abs().max() <= TOL
        with_backend(monkeypatch, model, fused_block=True)
        fused = _CountFused(monkeypatch)
        assert (_cached_logits(model, ids, pos) - ref).abs().max() <= TOL
    if kernels_available():
        assert fused.n == (_fusable(model) if name in PLAIN else 0), fused.n


@pytest.mark.parametrize("name", FAMILIES)
def test_sink_window_view(family, name, monkeypatch):
    """A MagicDec view (sink 1, window 6) through the cache (fused block or per op) equals the uncached per-op
    forward with the same view, which equals HF above without it. Mistral's sliding window (8) is wider than
    the view's: past position 8 its rule is no (sink, window) pair, so the fused block declines (per op)."""
    _, model, _ = family(name)
    ids, pos = _tokens()
    view = SinkWindow(1, 6)
    with torch.no_grad():
        ref = model(ids, pos, view=view).logits
        fused = _CountFused(monkeypatch)
        got = _cached_logits(model, ids, pos, view)
    assert (got - ref).abs().max() <= TOL
    windowed = model.cfg.layer_windows is not None and any(w is not None and w > 6 for w in model.cfg.layer_windows)
    if kernels_available():
        assert fused.n == (_fusable(model) if name in PLAIN and not windowed else 0), fused.n


def test_sliding_window_inside_view_is_fused(family, monkeypatch):
    """A view whose window holds the layers' sliding window (Mistral: 8 <= 16): the fused block applies the
    sliding window alone (sink 0), exactly."""
    _, model, _ = family("mistral")
    ids, pos = _tokens()
    view = SinkWindow(1, 16)
    with torch.no_grad():
        ref = model(ids, pos, view=view).logits
        fused = _CountFused(monkeypatch)
        got = _cached_logits(model, ids, pos, view)
    assert (got - ref).abs().max() <= TOL
    if kernels_available():
        assert fused.n == _fusable(model)


def _spire_draft(model, seed=0):
    torch.manual_seed(seed)
    n = min(2, model.cfg.n_layers)
    return SpireDraftModel(model, SpireConfig(n_draft_layers=n, sink=1, window=6))


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_sd_equals_ad(family, name):
    """Greedy SD with MagicDec and with a (pruned, untrained) SPIRe draft emits exactly AD's tokens."""
    _, model, _ = family(name)
    ids, _ = _tokens(B=3, T=12, seed=5)
    prompts = [ids[0].tolist(), ids[1, :7].tolist(), ids[2, :10].tolist()]
    ad = generate(model, prompts, 24).tokens
    for draft in (MagicDecDraft(1, 6), SpireDraft(_spire_draft(model))):
        sd = generate(model, prompts, 24, draft=draft, k=3)
        assert sd.tokens == ad, draft.name


@pytest.mark.parametrize("name", FAMILIES)
def test_spire_draft_trains(family, name):
    """Pruned initialization copies the family's extra weights (biases, q/k norms, Gemma's norms; each draft
    layer keeps its source layer's RoPE); the k-pass training forward equals drafting step by step; two
    optimizer steps on MixedLoss lower it."""
    from tests.helpers import mixed_loss
    from tests.test_spire_draft import _assert_training_matches_inference

    _, target, _ = family(name)
    draft = _spire_draft(target)
    src = dict(target.named_parameters())
    for i, j in enumerate(draft.source_layers):
        for pname, p in draft.layers[i].named_parameters():
            torch.testing.assert_close(p, src[f"model.layers.{j}.{pname}"], rtol=0, atol=0)
        assert draft.layers[i].rope_id == target.layers[j].rope_id
    ids, pos = _tokens(B=2, T=16, seed=3)
    _assert_training_matches_inference(target, draft.eval(), ids, 4)
    with torch.no_grad():
        out = target(ids, pos, hidden_layers=draft.source_layers)
        target_logits = out.logits
    draft.train()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(3):
        loss = mixed_loss(draft.forward_train(ids, out.hidden, 4), target_logits).loss
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in draft.layers.parameters())  # biases and extra norms train too
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", FAMILIES)
def test_throughput_shapes_count_the_family(family, name, layout):
    """`spire throughput --config FOLDER` reads the family's shapes: its body parameter count N (biases and
    extra norms included, paper convention) equals the loaded model's."""
    from spire.throughput.shapes import ModelShape

    _, model, folder = family(name, layout)
    shape = ModelShape.from_hf_config_file(folder)
    assert shape.body_params() == model.num_body_params()
    assert shape.kv_values_per_token() == 2 * model.cfg.n_layers * model.cfg.n_kv_heads * model.cfg.d_head


@pytest.mark.parametrize("name", ["gemma3", "qwen2"])
def test_random_init_ablation_has_unit_norms_and_zero_biases(family, name):
    """The random-initialization ablation starts every norm at scale 1 (Gemma stores 1 + w: w = 0) and every
    bias at 0, whatever the family stores."""
    from spire.model import RMSNorm

    _, target, _ = family(name)
    draft = SpireDraftModel(target, SpireConfig(n_draft_layers=2, sink=1, window=6, init="random"))
    norms = [m for m in [*draft.layers.modules(), draft.norm] if isinstance(m, RMSNorm)]
    assert norms and all(torch.equal(m.scale(), torch.ones_like(m.weight)) for m in norms)
    biases = [p for n, p in draft.layers.named_parameters() if n.endswith("bias")]
    assert (name == "qwen2") == bool(biases) and all(not b.any() for b in biases)
