"""KV caches under random speculative append / rollback sequences, against a reference that recomputes the
visible set from the committed tokens (hypothesis)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spire.kv_cache import EMPTY, KVCache, RingKVCache, SinkWindow, attention_mask


def _visible(cache, layer, q):
    """{position: value} a query at position q (row 0) reads from the cache."""
    k, _ = cache.read(layer)
    kp = cache.key_positions()
    kp = kp[0] if kp.dim() == 2 else kp[: k.shape[2]]
    mask = attention_mask(torch.tensor([[q]]), kp[None], cache_view[0])[0, 0, 0]
    return {int(p): int(k[0, 0, s, 0]) for s, p in enumerate(kp.tolist()) if mask[s]}


cache_view = [None]


def _write(cache, pos_list, values, valid=None):
    pos = torch.tensor([pos_list])
    val = torch.tensor(values, dtype=torch.float32)[None, None, :, None].expand(1, 1, len(values), 2)
    kw = {} if valid is None else {"valid": torch.tensor([valid])}
    cache.write(0, pos, val, val, **kw)


@settings(max_examples=150, deadline=None)
@given(sink=st.integers(0, 2), window=st.integers(1, 9), k=st.integers(1, 5), prompt=st.integers(1, 30),
       pad=st.integers(0, 20), accepts=st.lists(st.integers(0, 5), min_size=1, max_size=25),
       ring=st.booleans())
@pytest.mark.slow
def test_round_loop_sequences_match_reference(sink, window, k, prompt, pad, accepts, ring):
    """Simulates the round loop's use of a draft cache: prefill (with right-padding), then rounds that
    write k draft positions (querying after each), overwrite k+1 verified positions, and accept a prefix.
    Every query must see exactly the committed tokens' values (and this round's drafts) inside its view."""
    view = SinkWindow(sink, window)
    cache_view[0] = view
    max_len = prompt + pad + 6 * len(accepts) + 2 * k + 4
    cache = RingKVCache(1, 1, 1, view, k + 1, 2) if ring else KVCache(1, 1, 1, max_len, 2)
    committed = {p: 1000 + p for p in range(prompt - 1)}  # value the target wrote for committed position p
    width = prompt - 1 + pad
    if width:
        _write(cache, list(range(width)), [1000 + p if p < prompt - 1 else -7 for p in range(width)],
               valid=[p < prompt - 1 for p in range(width)])
    n = prompt
    for rnd, a in enumerate(accepts):
        a = min(a, k)
        drafted = {}
        for j in range(k):
            q = n - 1 + j
            value = -(100 * rnd + j + 1)
            if ring:
                cache.claim(torch.tensor([[q]]))
            _write(cache, [q], [value])
            drafted[q] = value
            want = {p: v for p, v in {**committed, **drafted}.items()
                    if p <= q and (p < sink or p > q - window)}
            assert _visible(cache, 0, q) == want
        verified = list(range(n - 1, n + k))
        _write(cache, verified, [1000 + p for p in verified])  # verify writes all k+1 (rejected ones too)
        for p in range(n - 1, n + a):
            committed[p] = 1000 + p
        n += a + 1


def test_ring_is_constant_size():
    c = RingKVCache(2, 3, 1, SinkWindow(1, 64), 5, 8)
    assert c.k[0].shape == (3, 1, 70, 8) and c.tags.shape == (3, 70)


@settings(max_examples=60, deadline=None)
@given(sink=st.integers(0, 3), window=st.integers(1, 9), slack=st.integers(1, 5), B=st.integers(1, 3),
       T=st.integers(1, 4), start=st.integers(0, 40), self_attend=st.booleans(), seed=st.integers(0, 1000))
def test_ring_claim_mask_native_equals_torch(sink, window, slack, B, T, start, self_attend, seed):
    """RingKVCache.claim_mask: the native call (slots, tags, mask) equals claim + attention_mask (+ the no-self
    rule) in torch, over rings already holding positions, rows at different positions."""
    from spire import kernels

    if not kernels.available():
        import pytest
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    T = min(T, window + slack)
    g = torch.Generator().manual_seed(seed)
    rings = [RingKVCache(1, B, 1, SinkWindow(sink, window), slack, 8) for _ in range(2)]
    for b in range(B):  # history: positions 0 .. start_b - 1 written, the last window + slack of them kept
        hist = torch.arange(int(torch.randint(0, start + 1, (1,), generator=g)))[None]
        if hist.numel():
            keep = hist[:, -min(hist.shape[1], window + slack):]
            for r in rings:
                r.tags[b, r.slot(keep[0])] = keep[0]
    lens = torch.tensor([int(r) for r in torch.randint(0, start + 1, (B,), generator=g)])
    pos = lens[:, None] + torch.arange(T)
    native = rings[0].claim_mask(pos, self_attend=self_attend)
    rings[1].claim(pos)
    ref = attention_mask(pos, rings[1].tags, rings[1].view)
    if not self_attend:
        qp, kp = pos[:, :, None], rings[1].tags[:, None, :]
        ref = ref & ((kp != qp) | (qp == 0))[:, None]
    assert torch.equal(native[0], rings[1].slot(pos))
    assert torch.equal(rings[0].tags, rings[1].tags)
    assert native[1].dtype == torch.bool and torch.equal(native[1], ref)
    tags = rings[0].tags.clone()
    assert kernels.ring_claim_mask(tags, -pos - 1, sink, rings[0].ring, window, True) is None  # refused ...
    assert torch.equal(tags, rings[0].tags)  # ... with nothing written


def test_both_caches_are_one_base_type():
    """KVCache and RingKVCache are BaseKVCache: claim_mask of the dense cache is attention_mask over its
    positions under the given view (its entry of p is p); the ring's, under its own view, equals the torch
    reference; restart_rows makes a ring row's slots invisible and leaves a dense row as it is; a ring refuses
    another view."""
    import pytest

    from spire.errors import ConfigError
    from spire.kv_cache import BaseKVCache, KVCache

    view = SinkWindow(2, 5)
    dense, ring = KVCache(1, 2, 1, 32, 8), RingKVCache(1, 2, 1, view, 3, 8)
    assert isinstance(dense, BaseKVCache) and isinstance(ring, BaseKVCache) and dense.positional and not ring.positional
    pos = torch.tensor([[9, 10], [4, 5]])
    slots, mask = dense.claim_mask(pos, view, self_attend=False)
    kp = torch.arange(32)[None].expand(2, -1)
    ref = attention_mask(pos, kp, view) & ((kp[:, None, :] != pos[:, :, None]) | (pos[:, :, None] == 0))[:, None]
    assert torch.equal(slots, pos) and torch.equal(mask, ref)
    for p in range(12):  # positions 0..11 in both rows
        ring.claim(torch.tensor([[p], [p]]))
    slots, mask = ring.claim_mask(torch.tensor([[12], [12]]))
    assert torch.equal(mask, attention_mask(torch.tensor([[12], [12]]), ring.tags, view))
    ring.restart_rows(torch.tensor([1]))
    assert (ring.tags[1] == EMPTY).all() and (ring.tags[0] != EMPTY).sum() == ring.tags.shape[1]
    assert not ring.claim_mask(torch.tensor([[0], [0]]))[1][1, 0, 0, 1:].any()  # row 1 sees only its new key
    dense.k[0][1].fill_(1.0)
    dense.restart_rows(torch.tensor([1]))
    assert bool((dense.k[0][1] == 1.0).all())
    with pytest.raises(ConfigError, match="its own view"):
        ring.claim_mask(pos, SinkWindow(1, 5))

