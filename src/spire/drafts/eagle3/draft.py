"""EAGLE-3 at inference, one job: :class:`Eagle3Draft`, the round loop's draft (a chain of k tokens per round over
its own KV cache of the one layer, caught up on the target's features by ``observe``). It reads an
:class:`spire.drafts.eagle3.model.Eagle3DraftModel` (not imported here: model.py imports this module for
``as_draft``)."""

from __future__ import annotations

import torch

from spire import fastpath
from spire.drafts.base import Draft
from spire.drafts.eagle3.layer import eagle3_mask
from spire.errors import TokenizerMismatchError
from spire.kv_cache import KVCache, Span
from spire.model import ForwardOutput, Transformer

_NONE = -(1 << 40)  # a position no step was taken at



class Eagle3Draft(Draft):
    """The round loop's EAGLE-3 draft (:mod:`spire.engine.runner`): a chain of k tokens per round.

    State per generation (:meth:`start`): a dense :class:`KVCache` of the one layer (B, KV, max_len, D), the fused
    target feature of every position (B, max_len, d), the previous step's fed-back feature (B, 1, d) and the
    position it was drafted at per row. The cache invariant of :mod:`spire.engine.prefill` holds: :meth:`observe`
    (prefill and verify) writes the keys/values and features of the positions the target ran, :meth:`step`
    writes its position's keys/values before its query reads, and a query reads positions <= its own, so the
    entries of rejected tokens and padding are overwritten before anything reads them.
    """

    name = "eagle3"

    def __init__(self, model: Eagle3DraftModel) -> None:
        self.model = model
        self.hidden_layers = tuple(model.layer_ids)
        self._cache: KVCache | None = None
        self._feat: torch.Tensor | None = None  # (B, max_len, d) fused target feature g_t per position
        self._own: torch.Tensor | None = None  # (B, 1, d) the last step's fed-back feature
        self._chain: torch.Tensor | None = None  # (B,) position of the last step since the last observe

    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        m = self.model
        t = target.cfg
        if t.vocab_size != m.target.cfg.vocab_size or t.d_model != m.target.cfg.d_model:
            raise TokenizerMismatchError(f"the EAGLE-3 draft was made for a target of vocabulary "
                                         f"{m.target.cfg.vocab_size} and hidden size {m.target.cfg.d_model}; this "
                                         f"target has {t.vocab_size} and {t.d_model}")
        lc, dev, dtype = m.layer_cfg, target.device, target.dtype
        self._cache = KVCache(1, batch_size, lc.n_kv_heads, max_len, lc.d_head, dtype=dtype, device=dev)
        self._feat = torch.zeros(batch_size, max_len, t.d_model, dtype=dtype, device=dev)
        self._own = torch.zeros(batch_size, 1, t.d_model, dtype=dtype, device=dev)
        self._chain = torch.full((batch_size,), _NONE, dtype=torch.int64, device=dev)
        self._full = (self._cache, self._feat)

    def use_rows(self, n: int) -> bool:
        """Rows [0, n) of its cache and features (views); the chains (reset by every observe) restart."""
        cache, feat = self._full
        self._cache, self._feat = cache.narrow(n), feat[:n]
        self._own = torch.zeros(n, 1, feat.shape[-1], dtype=feat.dtype, device=feat.device)
        self._chain = torch.full((n,), _NONE, dtype=torch.int64, device=feat.device)
        return True

    def _target_feature(self, pos: torch.Tensor) -> torch.Tensor:
        """(B,) positions p -> (B, d) the fused target feature kept for p - 1 (zeros at p = 0)."""
        rows = torch.arange(len(pos), device=pos.device)
        f = self._feat[rows, (pos - 1).clamp_min(0)]
        return f * (pos > 0)[:, None].to(f.dtype)

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Forget rows ``rows`` (R,): their chains end; their cache entries and features are rewritten by the new
        request's prefill and rounds before any step reads them (positions <= its own, written first)."""
        self._chain[rows.to(self._chain.device)] = _NONE

    def _observe_rows(self, rows: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
                      target_out: ForwardOutput) -> None:
        """:meth:`observe` of rows ``rows`` only: on a sub-batch of the cache and features, written back."""
        cache, feat = self._cache, self._feat
        self._cache, self._feat = cache.take_rows(rows), feat[rows]
        try:
            hidden = {j: h[rows] for j, h in target_out.hidden.items()}
            self.observe(tokens[rows], pos[rows], ForwardOutput(hidden=hidden, compute_logits=lambda: None))
        finally:
            cache.put_rows(rows, self._cache)
            feat[rows] = self._feat
            self._cache, self._feat = cache, feat

    @torch.no_grad()
    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None, span: Span | None = None) -> None:
        """Catch-up after a prefill or verify: tokens, pos (B, T) (each row's positions contiguous); keys/values of
        (x_t, g_{t-1}) into the cache and the fused features g_t kept, for every position (padding included: it
        lies past the committed length). The next step starts a new chain from the target's features. With
        ``valid`` (B, T), rows without a valid token are left untouched (other requests while one joins)."""
        if valid is not None and not bool(valid.any(1).all()):
            self._observe_rows(valid.any(1).nonzero()[:, 0], tokens, pos, target_out)
            return
        m = self.model
        layer = m.layers[0]
        B, T = tokens.shape
        dtype = self._feat.dtype
        g = m.fuse([target_out.hidden[j].to(dtype) for j in m.layer_ids])  # (B, T, d)
        before = self._target_feature(pos[:, 0])[:, None]  # (B, 1, d): g of the position before the first
        prev = torch.cat([before, g[:, :-1]], 1)  # (B, T, d)
        u, _ = layer.inputs(m.embed(tokens), prev, m.cfg.norm_before_residual)  # (B, T, 2d)
        cos, sin = m.rope(pos, u.dtype)  # (B, 1, T, D)
        k, v = layer.kv(u, cos, sin)  # (B, KV, T, D)
        self._cache.write(0, pos, k, v, span=span)
        rows = torch.arange(B, device=pos.device)[:, None].expand(B, T)
        self._feat[rows, pos] = g.to(dtype)
        self._chain.fill_(_NONE)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None) -> torch.Tensor:
        """tokens, pos (B, 1) -> float32 logits (B, V) over the target's vocabulary (-inf outside a draft vocabulary)
        for position pos + 1. The feature read is the draft's own from the previous step when that step was at
        pos - 1 since the last observe, else the target's fused feature of pos - 1."""
        m = self.model
        layer = m.layers[0]
        p = pos[:, 0]  # (B,)
        own = (self._chain == p - 1)[:, None, None]  # (B, 1, 1)
        feature = torch.where(own, self._own, self._target_feature(p)[:, None])  # (B, 1, d)
        u, res = layer.inputs(m.embed(tokens), feature, m.cfg.norm_before_residual)  # (B, 1, 2d), (B, 1, d)
        cos, sin = m.rope(pos, u.dtype)
        access = fastpath.CacheAccess(self._cache, pos, m.view, span)
        mask = eagle3_mask(pos, access.key_pos, m.view)  # (B, 1, 1, S)
        if access.mask is not None:
            mask = mask & access.mask

        def kv_source(k, v):  # this position's key/value into the cache, then everything up to it
            access.write(0, k, v)
            return access.read(0)
        z = layer(u, res, cos, sin, kv_source, mask)  # (B, 1, d)
        self._own = m.feed_back(z)
        self._chain = p.clone()
        return m.to_target_vocab(m.logits(z)[:, -1])
