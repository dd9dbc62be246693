"""The CPU training path under bf16 autocast: the grouped attention that replaces SDPA when autograd is on, the
bf16 copies of frozen weights kept from step to step, and a target cache built under bf16 as a live bf16 run
computes it (the build used to run the target in float32 whatever the run asked)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spire import fastpath
from spire import model as model_mod
from spire.model import grouped_attention
from spire.training.sources import LiveTarget, TargetCache, autocast
from tests.helpers import with_backend
from tests.test_target_cache import TokenLikeData


def _qkv_mask(B, H, KV, T, S, dtype, per_batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, KV, S, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, KV, S, 16, generator=g).to(dtype).requires_grad_()
    mask = torch.rand(B if per_batch else 1, 1, T, S, generator=g) > 0.4
    mask[..., 0] = True  # every query sees a key
    return q, k, v, mask


@pytest.mark.parametrize("H,KV", [(6, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize("per_batch", [False, True])
def test_grouped_attention_equals_sdpa_in_float32(H, KV, per_batch):
    """Outputs and the gradients of q, k and v against torch's SDPA (enable_gqa), float32: to rounding."""
    q, k, v, mask = _qkv_mask(3, H, KV, 5, 11, torch.float32, per_batch)
    g = torch.randn(3, H, 5, 16, generator=torch.Generator().manual_seed(1))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != KV, scale=0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    out = grouped_attention(q, k, v, mask, 0.3)
    grads = torch.autograd.grad(out, (q, k, v), g)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # a masked key has no influence at all: changing its value changes nothing
    v2 = v.detach().clone()
    v2[..., 1:, :] += 100.0 * (~mask[:, :, :, 1:].any(2, keepdim=True)).transpose(-1, -2).float()
    torch.testing.assert_close(grouped_attention(q, k, v2, mask, 0.3), out, rtol=0, atol=0)


def test_grouped_attention_in_bf16_is_within_bf16_rounding_of_float32():
    """bf16 inputs, float32 softmax: within bf16's rounding (2^-8 relative) of the float32 result."""
    q, k, v, mask = _qkv_mask(2, 6, 2, 7, 13, torch.float32, True)
    ref = grouped_attention(q, k, v, mask, 0.25)
    out = grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.25)
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).abs().max().item()
    assert err < 3e-2 * ref.abs().max().item()


def test_attention_module_uses_the_grouped_path_only_with_autograd(monkeypatch, tiny):
    """Attention.attend: with autograd on (training) the grouped path, else SDPA; both give the same values."""
    calls = []
    real = model_mod.grouped_attention
    monkeypatch.setattr(model_mod, "grouped_attention", lambda *a: calls.append(1) or real(*a))
    attn = tiny.layers[0].self_attn
    q, k, v, mask = _qkv_mask(2, attn.n_heads, attn.n_kv, 4, 6, torch.float32, False)
    q = q[..., :1].expand(-1, -1, -1, attn.d_head).contiguous().requires_grad_()
    k = k[..., :1].expand(-1, -1, -1, attn.d_head).contiguous()
    v = v[..., :1].expand(-1, -1, -1, attn.d_head).contiguous()
    y_train = attn.attend(q, k, v, mask)
    assert calls == [1]
    with torch.no_grad():
        y_infer = attn.attend(q, k, v, mask)
    assert calls == [1]
    torch.testing.assert_close(y_train, y_infer, rtol=0, atol=1e-5)


def test_autocast_weight_is_kept_and_refreshed(monkeypatch):
    """Under CPU bf16 autocast a frozen float32 weight's bf16 copy is made once (kept on its owner, by role) and
    reused until the weight changes in place; outside autocast, for a trainable weight, or with the owner's
    backend.autocast_copies off, the weight itself."""
    owner, w = torch.nn.Module(), torch.randn(8, 4)
    assert fastpath.autocast_weight(w, owner, "w") is w
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = fastpath.autocast_weight(w, owner, "w")
        assert a.dtype == torch.bfloat16 and torch.equal(a, w.to(torch.bfloat16))
        assert fastpath.autocast_weight(w, owner, "w") is a
        assert fastpath.autocast_weight(w, torch.nn.Module(), "w") is not a  # kept per owner
        w.mul_(2.0)  # an in-place change (a load, a rounding) makes a new copy
        b = fastpath.autocast_weight(w, owner, "w")
        assert b is not a and torch.equal(b, w.to(torch.bfloat16))
        p = torch.nn.Parameter(torch.randn(3, 3))
        assert fastpath.autocast_weight(p, owner, "p") is p  # autocast itself caches trainable weights' casts
        with_backend(monkeypatch, owner, autocast_copies=False)
        assert fastpath.autocast_weight(w, owner, "w") is w  # autocast casts anew


def test_a_bf16_cache_stores_what_a_live_bf16_run_computes(tmp_path, tiny):
    """Built with bf16=True the cache holds the live bf16 run's hidden states rounded to bf16 and its exact final
    state and log Z; built without, the float32 run's (the two differ). The key says bf16 only when set: the
    keys of float32 builds are the ones the code before this gave (pinned)."""
    kw = dict(layers=(1, 3), teacher=True, batch_size=2, seq_len=32, seed=0, steps=2, dtype="bfloat16",
              progress=False, log=None)
    c16 = TargetCache.build(tiny, TokenLikeData(), root=tmp_path, bf16=True, **kw)
    c32 = TargetCache.build(tiny, TokenLikeData(), root=tmp_path, **kw)
    assert c16.path != c32.path
    for step in range(2):
        for cache, bf16 in ((c16, True), (c32, False)):
            live = LiveTarget(tiny, TokenLikeData(), (1, 3), True, 2, 32, 0, bf16=bf16).batch(step)
            got = cache.batch(step, slice(None), torch.device("cpu"), (1, 3))
            assert torch.equal(got.tokens, live.tokens)
            for j in (1, 3):
                assert torch.equal(got.hidden[j], live.hidden[j].to(torch.bfloat16).float()), j
            assert torch.equal(got.final, live.final) and torch.equal(got.logz, live.logz)
    assert not np.array_equal(c16._arrays["final"], c32._arrays["final"])
    ident = {"checkpoint": None, "config": {"x": 1}, "weights": 1.5}
    args = (ident, "d", (1, 2), True, 4, 32, 0, 3, "bfloat16")
    assert TargetCache.key(*args) == TargetCache.key(*args, False) == "add4d1a7b8e85a06"
    assert TargetCache.key(*args, True) != TargetCache.key(*args)


def test_teacher_head_under_autocast_matches_the_live_teacher(tiny):
    """The teacher's log-probabilities from a stored final state under bf16 autocast (the cached path) equal the
    live bf16 run's, which computes its logits in the same bf16 matmul."""
    live = LiveTarget(tiny, TokenLikeData(), (1,), True, 2, 32, 0, bf16=True).batch(0)
    stored = type(live)(live.tokens, live.hidden, live.final, live.logz)  # no full logits: recomputed
    with autocast(True, live.tokens.device):
        got = stored.target_logp(tiny)
    torch.testing.assert_close(got, live.logits - live.logz[..., None], rtol=0, atol=0)


def test_a_query_that_sees_no_key_reads_zero_as_in_sdpa():
    """A fully masked row (e.g. sink 0, window 1, no self-attend) gives 0 and finite gradients, as SDPA does
    (it gave NaN on the grouped path, and training stopped at step 1)."""
    q, k, v, mask = _qkv_mask(2, 6, 2, 5, 7, torch.float32, True)
    mask[1, :, 2] = False
    g = torch.randn(2, 6, 5, 16, generator=torch.Generator().manual_seed(3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    out = grouped_attention(q, k, v, mask, 0.3)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert torch.equal(out[1, :, 2], torch.zeros(6, 16))
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_spire_trains_where_a_drafted_query_sees_nothing(tiny):
    """sink 0, window 1, no self-attend: SpireConfig accepts it and every pass j >= 1 query sees no key; the
    training loss is finite."""
    from spire.drafts.spire import SpireConfig, SpireDraftModel
    from spire.training.distill import TrainConfig, step_loss
    from spire.training.sources import run_target
    model = SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, sink=0, window=1, self_attend=False))
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    tb = run_target(tiny, tokens, model.target_layers(), True)
    loss, alpha = step_loss(model, tiny, tb, TrainConfig(bf16=False))
    assert torch.isfinite(loss) and 0.0 <= alpha <= 1.0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_autocast_weight_sees_new_storage_under_the_same_tensor():
    """``w.data = ...`` keeps the tensor and its version counter: the copy follows the storage."""
    w = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        owner = torch.nn.Module()
        a = fastpath.autocast_weight(w, owner, "w")
        w.data = torch.randn(4, 4)
        again = fastpath.autocast_weight(w, owner, "w")
        assert torch.equal(again, w.to(torch.bfloat16)) and again is not a
