"""The fused decoder block (spire.kernels.DecodeBlock, spire.backend.Backend.fused_block) computes what the per-op path
and the autograd reference path compute, in float32, for every way decoding calls it."""

from __future__ import annotations

import copy

import pytest
import torch

from spire import fastpath, kernels
from spire.errors import ConfigError
from spire.kv_cache import SinkWindow
from tests.conftest import make_tiny
from tests.helpers import spire_rounds, with_backend

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")


@pytest.fixture(scope="module")
def tiny16():
    """Head dim 16 (the kernel takes multiples of 8), 6 query heads over 2 key/value heads (GQA, g = 3)."""
    return make_tiny(seed=5, d_model=48, n_heads=6, n_kv_heads=2, d_head=16, d_ff=80)


def _run(model, ids, lens, view, fused: bool, grad: bool, monkeypatch):
    """Prefill 47 tokens, 4 single-token steps at per-row positions, a 5-token verify block: the logits of
    every step, the hidden states entering layers 0 and 2, and the final cache."""
    with_backend(monkeypatch, model, fused_block=fused)
    B = ids.shape[0]
    cache = model.new_cache(B, 64)
    logits, hidden = [], []
    with torch.set_grad_enabled(grad):
        model(ids[:, :47], torch.arange(47)[None].expand(B, 47), cache)
        for t in range(4):
            pos = torch.tensor(lens)[:, None] + t
            out = model(ids.gather(1, pos), pos, cache, view=view, hidden_layers=(0, 2))
            logits.append(out.logits.detach())
            hidden += [out.hidden[0].detach(), out.hidden[2].detach()]
        pos = torch.tensor(lens)[:, None] + torch.arange(4, 9)
        out = model(ids.gather(1, pos), pos, cache, view=view, hidden_layers=(2,))
        logits.append(out.logits.detach())
        hidden.append(out.hidden[2].detach())
    upto = max(lens) + 9
    return torch.cat(logits, 1), hidden, torch.stack([cache.k[-1][:, :, :upto], cache.v[-1][:, :, :upto]])


@pytest.mark.parametrize("view", [None, SinkWindow(1, 6), SinkWindow(2, 3), SinkWindow(0, 40)])
def test_fused_block_equals_per_op_and_reference_paths(tiny16, view, monkeypatch):
    ref = copy.deepcopy(tiny16).requires_grad_(True)  # autograd through weights: the plain reference path
    g = torch.Generator().manual_seed(3)
    lens = [30, 12, 47]  # rows at different positions: per-row writes, windows and causal limits
    ids = torch.randint(0, 97, (3, 60), generator=g)
    fused = _run(tiny16, ids, lens, view, True, False, monkeypatch)
    per_op = _run(tiny16, ids, lens, view, False, False, monkeypatch)
    reference = _run(ref, ids, lens, view, True, True, monkeypatch)
    assert fastpath.native_blocks(tiny16), "the fused path did not run"
    for other in (per_op, reference):
        # float32 sums in another order (the kernel's vector width): on an AVX-512 Zen 4 one logit of 2,619 differed
        # by 1.06e-5 (logits of order 1); 2e-5 still fails any real error (a wrong mask or weight moves logits by 1e-2)
        torch.testing.assert_close(fused[0], other[0], atol=2e-5, rtol=1e-5)
        for a, b in zip(fused[1], other[1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused[2], other[2], atol=1e-5, rtol=1e-5)


def test_fused_block_bf16_weights(tiny16, monkeypatch):
    """Weight-only bf16: the fused block streams the bf16 copies and equals the reference on the rounded model."""
    model = copy.deepcopy(tiny16)
    fastpath.use_bf16_weights(model)
    ref = copy.deepcopy(model).requires_grad_(True)
    ids = torch.randint(0, 97, (2, 60), generator=torch.Generator().manual_seed(4))
    a = _run(model, ids, [40, 20], SinkWindow(1, 8), True, False, monkeypatch)
    b = _run(ref, ids, [40, 20], SinkWindow(1, 8), True, True, monkeypatch)
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    assert fastpath.native_blocks(model)[0][1]._keep[2].dtype == torch.bfloat16


def test_fused_block_scope_and_errors(tiny16, monkeypatch):
    """Too many query rows per KV head falls back to the per-op path (same logits); a position past the cache
    is a ConfigError; a deepcopy does not read the original's weights."""
    model = copy.deepcopy(tiny16)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache(1, 48)
    pos = torch.arange(12)[None]  # g × T = 3 × 12 = 36 rows per KV head: beyond the kernel's 32
    x = model.model.embed_tokens(ids[:, :12])
    assert not fastpath.decode_step(model, model.layers, model.cfg, x, pos, *model.rope(pos, x.dtype), cache,
                                    lambda: ([], [], None)).native
    with torch.no_grad():
        model(ids[:, :30], torch.arange(30)[None], cache)
        step = model(ids[:, 30:31], torch.tensor([[30]]), cache).logits
        with pytest.raises(ConfigError, match="beyond the cache length"):
            model(ids[:, :1], torch.tensor([[48]]), cache)
        for fused in (True, False):  # both paths refuse a negative position (the per-op path used to wrap)
            with_backend(monkeypatch, model, fused_block=fused)
            with pytest.raises(ConfigError, match="negative position"):
                model(ids[:, :1], torch.tensor([[-1]]), cache)
        with_backend(monkeypatch, model, fused_block=True)
        twin = copy.deepcopy(model)
        assert not fastpath.native_blocks(twin)
        model.layers[1].mlp.down_proj.weight.mul_(3.0)  # changes the original only
        cache2 = twin.new_cache(1, 48)
        twin(ids[:, :30], torch.arange(30)[None], cache2)
        torch.testing.assert_close(twin(ids[:, 30:31], torch.tensor([[30]]), cache2).logits, step)


def test_speculative_decoding_through_the_fused_block_is_lossless(tiny16):
    """Greedy SD (MagicDec draft on the target's own cache, and a small vanilla draft) emits exactly AD's
    tokens when the target's verify passes and the drafts' steps run through the fused block."""
    from spire.drafts.magicdec import MagicDecDraft
    from spire.drafts.vanilla import VanillaDraft
    from tests.oracle import generate

    prompts = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(8)).tolist()
    prompts[1] = prompts[1][:15]  # ragged rows
    ad = generate(tiny16, prompts, 30)
    assert fastpath.native_blocks(tiny16)
    for draft in (MagicDecDraft(1, 6), VanillaDraft(make_tiny(seed=9, n_layers=2, n_heads=6, n_kv_heads=2,
                                                             d_head=16, d_ff=80))):
        sd = generate(tiny16, prompts, 30, draft=draft, k=4)
        assert sd.tokens == ad.tokens
        assert sd.tau > 1.0 or isinstance(draft, VanillaDraft)


@pytest.mark.parametrize("self_attend", [True, False])
def test_spire_draft_step_through_the_fused_block(tiny16, self_attend, monkeypatch):
    """The SPIRe draft's step over its ring cache (explicit slot mask, slot writes) gives the same draft
    logits and the same cache as the per-op path, round after round, and greedy SD with it equals AD."""
    from spire.drafts.spire import SpireConfig, SpireDraftModel
    from tests.oracle import generate

    torch.manual_seed(11)
    model = SpireDraftModel(tiny16, SpireConfig(n_draft_layers=2, sink=1, window=5, self_attend=self_attend))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompts = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(12)).tolist()
    prompts[0] = prompts[0][:13]
    runs = []
    for fused in (True, False):
        with_backend(monkeypatch, tiny16, model, fused_block=fused)
        res, logits, cache = spire_rounds(tiny16, model, prompts)
        runs.append((res.tokens, logits, cache))
    assert fastpath.native_blocks(model), "the fused path did not run"
    assert runs[0][0] == runs[1][0] == generate(tiny16, prompts, 24).tokens
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runs[0][2], runs[1][2], atol=1e-5, rtol=1e-5)


def test_fused_blocks_do_not_keep_a_finished_cache_alive(tiny16, monkeypatch):
    """The per-layer DecodeBlocks a model keeps must not hold the KV cache of a finished generation (a long
    context's cache is most of the memory), and rows per KV head past the kernel's limit fall back even when
    KERNEL_MAX_M is raised."""
    import gc
    import weakref

    from spire.drafts.magicdec import MagicDecDraft
    from tests.oracle import generate

    model = copy.deepcopy(tiny16)
    cache = model.new_cache(2, 40)
    with torch.no_grad():
        model(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), cache)
    assert fastpath.native_blocks(model)
    ref = weakref.ref(cache.k[0])
    del cache
    gc.collect()
    assert ref() is None, "a DecodeBlock kept the cache alive"
    for where in (fastpath.step, fastpath.matmul):  # the modules that read it
        monkeypatch.setattr(where, "KERNEL_MAX_M", 64)
    prompts = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(13)).tolist()
    sd = generate(model, prompts, 24, draft=MagicDecDraft(1, 6), k=10)  # 3 × 11 = 33 rows per KV head
    assert sd.tokens == generate(model, prompts, 24).tokens
