"""SPIRe at inference, one job: :class:`SpireDraft`, the round loop's draft (k tokens per round over its own cache
of memory keys/values: a :class:`~spire.kv_cache.RingKVCache` over its sink + window, or a dense
:class:`~spire.kv_cache.KVCache` without a window; caught up on the target's activations by ``observe``). It reads
a :class:`spire.drafts.spire.model.SpireDraftModel` (not imported here: model.py imports this module for
``as_draft``)."""

from __future__ import annotations

from functools import partial

import torch

from spire import fastpath
from spire.drafts.base import Draft
from spire.kv_cache import BaseKVCache, KVCache, RingKVCache, Span, attention_mask
from spire.model import ForwardOutput, Transformer


class SpireDraft(Draft):
    """Inference wrapper: a :class:`SpireDraftModel` with its own KV cache: constant-size sink + window
    (:class:`RingKVCache`, sink + window + k + 1 slots per layer, whatever the context length), or a dense
    :class:`KVCache` when the draft has no window (full-KV ablation).

    The draft cache holds, per draft layer and absolute position, the keys/values of the memory vectors:
    projected from target activations for verified positions (:meth:`observe`), from the draft's own
    feedback memory for drafted positions (:meth:`step`). Without target activations (ablation) the draft
    is an ordinary transformer: :meth:`observe` runs it over the verified tokens, like a vanilla draft.
    """

    name = "spire"

    def __init__(self, model: SpireDraftModel) -> None:
        self.model = model
        self.hidden_layers = model.source_layers if model.cfg.target_activations else ()
        # AD rounds' commits reach it in batches (Draft.defer_observe): with target activations an observe is
        # per-position projections into its cache, the same for T positions at once; a windowed cache holds them
        if model.cfg.target_activations and model.view is not None:
            self.defer_observe = max(1, model.view.window)
        self._cache: BaseKVCache | None = None
        self._feature: torch.Tensor | None = None  # (B, R, d) recent positions' features (feature_input)
        self._feature_pos: torch.Tensor | None = None  # (B, R) the position each slot holds

    def cost_shape(self, target):
        """Its layers at the target's width; the head it streams: its draft vocabulary's N rows, or the target's V."""
        from dataclasses import replace

        return replace(target.with_layers(len(self.model.layers)), vocab_size=self.model.n_vocab)

    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        t, view = target.cfg, self.model.view
        if view is None:
            self._cache = KVCache(len(self.model.layers), batch_size, t.n_kv_heads, max_len, t.d_head,
                                  dtype=target.dtype, device=target.device)
        else:
            self._cache = RingKVCache(len(self.model.layers), batch_size, t.n_kv_heads, view, k + 1, t.d_head,
                                      dtype=target.dtype, device=target.device)
        if self.model.feature_proj is not None:  # a ring of k + 2 slots: a verify writes k + 1 positions
            self._feature = torch.zeros(batch_size, k + 2, t.d_model, dtype=target.dtype, device=target.device)
            self._feature_pos = torch.full((batch_size, k + 2), -1 << 40, dtype=torch.int64, device=target.device)
        self._full = (self._cache, self._feature, self._feature_pos)
        if isinstance(self._cache, RingKVCache) and self.model.cfg.target_activations:
            # per position projections into the ring: only the sink and the last ring's positions stay (its write),
            # and a prefill of a few slots is projected for those rows alone
            self.observe_keeps, self.observe_rows = (view.sink, self._cache.ring), True
        else:
            self.observe_keeps, self.observe_rows = None, False

    def use_rows(self, n: int) -> bool:
        """Rows [0, n) of its cache and kept features (views)."""
        cache, feature, feature_pos = self._full
        self._cache = cache.narrow(n)
        if feature is not None:
            self._feature, self._feature_pos = feature[:n], feature_pos[:n]
        return True

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Forget rows ``rows`` (R,): their ring slots are tagged empty (never visible again) and their kept features
        dropped. A dense draft cache (the no-window ablation) needs nothing: a new request writes every position of
        its row before any query reads it."""
        self._cache.restart_rows(rows)
        if self._feature_pos is not None:
            self._feature_pos[rows.to(self._feature_pos.device)] = -1 << 40

    def _keep_features(self, pos: torch.Tensor, feature: torch.Tensor, valid: torch.Tensor | None,
                       rows: torch.Tensor | None = None) -> None:
        """Store the features (B, T, d) at positions (B, T) (those of each row within R of its latest valid one; an
        entry may repeat another) of rows ``rows`` (B,) of the batch (None: rows 0..B-1)."""
        R = self._feature.shape[1]
        B, T = pos.shape
        at = torch.arange(B, device=pos.device) if rows is None else rows.to(pos.device)
        if T <= R:  # contiguous positions, at most R of them: distinct slots, each written (nothing read back)
            rows = at[:, None].expand(B, T)
            slot = pos % R
            feature = feature.to(self._feature.dtype)
            if valid is not None:  # an invalid entry writes back what its slot held
                feature = torch.where(valid[..., None], feature, self._feature[rows, slot])
                pos = torch.where(valid, pos, self._feature_pos[rows, slot])
            self._feature[rows, slot] = feature
            self._feature_pos[rows, slot] = pos
            return
        valid = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid
        last = torch.where(valid, pos, torch.full_like(pos, -1)).max(1, keepdim=True).values
        keep = valid & (pos > last - R)  # each row's latest R positions: distinct slots (a repeated entry: the same)
        b, t = keep.nonzero(as_tuple=True)
        slot = pos[b, t] % R
        self._feature[at[b], slot] = feature[b, t].to(self._feature.dtype)
        self._feature_pos[at[b], slot] = pos[b, t]

    def _previous_feature(self, pos: torch.Tensor) -> torch.Tensor:
        """(B, 1) positions -> (B, 1, d) the feature kept for each row's previous position (zeros if none)."""
        prev = pos[:, 0] - 1
        rows = torch.arange(len(prev), device=prev.device)
        slot = prev % self._feature.shape[1]
        ok = self._feature_pos[rows, slot] == prev
        return (self._feature[rows, slot] * ok[:, None].to(self._feature.dtype))[:, None]

    def _key_positions(self, batch_size: int) -> torch.Tensor:
        kp = self._cache.key_positions()
        return kp if kp.dim() == 2 else kp[None].expand(batch_size, -1)

    @torch.no_grad()
    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None, span: Span | None = None, rows: torch.Tensor | None = None
                ) -> None:
        """:meth:`Draft.observe`; ``rows`` (B,) int64: the batch rows that the B rows given are (only with
        :attr:`observe_rows`, a ring cache over target activations): each position's memory keys/values are
        projected for those rows alone."""
        if not self.model.cfg.target_activations:
            self._run(tokens, pos, valid, span)
            return
        cos, sin = self.model.rope(pos, self.model.target.dtype)
        hidden = [target_out.hidden[j] for j in self.model.source_layers]
        if self._feature is not None:
            self._keep_features(pos, hidden[self.model.feature_from], valid, rows)
        m, cache = self.model, self._cache
        if rows is not None:  # per op, into the given rows of the ring
            for i, h in enumerate(hidden):
                cache.write(i, pos, *m.memory_kv(i, h, cos, sin), valid=valid, rows=rows)
            return

        def plan():  # per op: each layer's memory keys/values written with the rows' validity
            return [], [], lambda i, h: cache.write(i, pos, *m.memory_kv(i, h, cos, sin), valid=valid, span=span)

        run = fastpath.decode_step(m, m.layers, m.target.cfg, hidden[0], pos, cos, sin, cache, plan,
                                   allow_native=valid is None or bool(valid.all()), span=span)
        if run.native:
            cache.claim(pos)  # the slot tags the per-op path's layer-0 write sets
        for i, h in enumerate(hidden):
            run.write_kv(i, h)

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None = None,
             span: Span | None = None) -> torch.Tensor:
        """Ordinary transformer forward over (B, T) tokens at contiguous positions per row, reading the cache
        for earlier positions and then storing the new keys/values. Works for a ring cache of any T: the new
        keys are attended from the call's own tensors, not from the ring. Returns the last position's (B, d)."""
        m, cache = self.model, self._cache
        x = m.target.model.embed_tokens(tokens)
        cos, sin = m.rope(pos, x.dtype)
        B = tokens.shape[0]
        old = self._key_positions(B)  # entries at or past a row's first new position are stale: hide them
        old = torch.where(old < pos[:, :1], old, torch.full_like(old, 1 << 40))
        mask = attention_mask(pos, torch.cat([old, pos], 1), m.view)
        for i, layer in enumerate(m.layers):
            if m.enters(i):
                x = m.layer_input(i, x)
            new: list[torch.Tensor] = []

            def kv_source(k_new, v_new, i=i, new=new):  # the cache's past, then the call's own keys
                new += [k_new, v_new]
                k_old, v_old = cache.read(i)
                return torch.cat([k_old.to(k_new.dtype), k_new], 2), torch.cat([v_old.to(v_new.dtype), v_new], 2)
            x = layer(x, cos, sin, kv_source, mask)
            cache.write(i, pos, *new, valid=valid, span=span)
        return x

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None) -> torch.Tensor:
        m, cache = self.model, self._cache
        if not m.cfg.target_activations:
            return m.to_target_vocab(m.logits(self._run(tokens, pos, span=span))[:, -1])
        x = m.target.model.embed_tokens(tokens)  # (B, 1, d)
        feature = None if self._feature is None else self._previous_feature(pos)  # (B, 1, d)
        cos, sin = m.rope(pos, x.dtype)
        # the new position's entries claimed (its keys/values follow, per layer) and the mask over every entry
        slots, mask = cache.claim_mask(pos, m.view, m.cfg.self_attend)  # (B, 1), (B, 1, 1, S)
        xs = [x]

        def plan():  # per op: the token's own key/value into the cache, then attention over everything up to it
            def kv_source(i, k_self, v_self):
                cache.write(i, pos, k_self, v_self, span=span)
                return cache.read(i)
            return ([partial(kv_source, i) for i in range(len(m.layers))], [mask] * len(m.layers),
                    lambda i, mem: cache.write(i, pos, *m.memory_kv(i, mem, cos, sin), span=span))

        # natively, each layer is one call: the token's key/value into its slot, attention over the slots
        run = fastpath.decode_step(m, m.layers, m.target.cfg, x, pos, cos, sin, cache, plan, mask=mask, slots=slots,
                                   span=span)
        for i in range(len(m.layers)):
            if m.enters(i):
                x = xs[i] = m.layer_input(i, x, feature)
            x = run.block(i, x)
            xs.append(x)
        if self._feature is not None:
            self._keep_features(pos, xs[m.feature_from], None)
        if m.cfg.feedback_memory:  # later tokens read this token as memory, not as its self key/value
            mem = m.memory(xs)
            for i in range(len(m.layers)):
                run.write_kv(i, mem[i])
        return m.to_target_vocab(m.logits(x)[:, -1])
