"""Cache access planning, one job: how a per-op forward writes its keys/values into a dense
:class:`spire.kv_cache.KVCache` and what each layer reads back (:class:`CacheAccess`: slice writes when every row
writes the same contiguous positions, reads up to the highest position, a sink + window view gathered instead of
masked, per-layer sliding-window masks), planned once per forward, with each layer's :data:`KVSource`;
:func:`check_positions` raises ConfigError for a position outside the cache."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from spire.errors import ConfigError
from spire.kv_cache import KVCache, SinkWindow, Span, attention_mask, causal_mask, prefix_mask


# A KV source: given a block's new keys/values (B, KV, T, D), return the keys/values to attend over
# (B, KV, S, D). The dense cache writes then reads; the SPIRe draft prepends its memory.
KVSource = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def check_positions(pos: torch.Tensor, max_len: int, span: Span | None = None) -> tuple[int, int]:
    """(min, max) of positions pos, from their host copy ``span`` when given (else read back from pos); raises
    ConfigError when one is negative or not below the cache length."""
    lo, hi = (span.lo, span.hi) if span is not None else (int(v) for v in torch.aminmax(pos))
    if hi >= max_len:
        raise ConfigError(f"position {hi} is beyond the cache length {max_len}")
    if lo < 0:
        raise ConfigError(f"negative position {lo}")
    return lo, hi


class CacheAccess:
    """How one per-op forward writes its keys/values into a dense :class:`KVCache` and what each layer reads
    back, planned once per forward (not per layer).

    Writes: a slice copy when every row writes the same contiguous positions, else one advanced-index
    assignment. Reads: positions < upto = max(pos) + 1 only. With a :class:`SinkWindow` view and a history
    longer than the view, the keys/values are gathered: per row the ``sink`` first positions and the
    ``window + (T - 1)`` positions ending at the row's last query, so a MagicDec step reads
    B·(sink + window) entries per layer whatever the context length. The mask is then built from the
    gathered positions (entries before 0, or duplicating a sink position, are masked out). With no view,
    T = 1 and every row at the same position nothing is masked and the mask is None.

    Host values: the plan needs the positions' extent (which entries to read, whether a slice write does). Given
    ``span`` (:class:`spire.kv_cache.Span`, the positions' host copy) it takes them from there and reads nothing
    back. Without one, on the CPU it reads them from ``pos`` (cheap there); off the CPU, and whenever torch.compile
    traces, it plans without them: every entry of the cache is read under the mask, and writes are indexed (no
    host sync, and shapes fixed by the cache, so one graph serves every position).
    """

    def __init__(self, cache: KVCache, pos: torch.Tensor, view: SinkWindow | None, span: Span | None = None
                 ) -> None:
        self.cache, self.pos, self.view = cache, pos, view
        B, T = pos.shape
        dev = pos.device
        self.gather, self.slices = None, None
        if torch.compiler.is_compiling() or (span is None and dev.type != "cpu"):
            # nothing known on the host: every entry is read under the mask (shapes fixed by the cache: one graph)
            if span is not None:
                check_positions(pos, cache.max_len, span)
            self.lo, self.upto, self.slice_at = 0, cache.max_len, None
            self.rows = torch.arange(B, device=dev)[:, None].expand(B, T)
            self.key_pos = cache.positions  # (S,)
            self.mask = attention_mask(pos, self.key_pos, view)
            return
        lo, hi = check_positions(pos, cache.max_len, span)  # from the span: nothing read back
        self.lo, self.upto = lo, hi + 1
        if span is not None:  # each row's positions contiguous
            contiguous, first = True, span.starts[0]
            self.slice_at = first if span.same else None
        else:
            p_first = pos[:, 0]
            contiguous = bool(((pos - p_first[:, None]) == torch.arange(T, device=dev)).all())
            first = int(p_first[0]) if contiguous else 0
            self.slice_at = first if contiguous and bool((p_first == p_first[0]).all()) else None
        self.rows = None if self.slice_at is not None else torch.arange(B, device=dev)[:, None].expand(B, T)
        if view is not None and contiguous:
            n_win = view.window + T - 1  # window entries of the last query ∪ the first's
            if view.sink + n_win < self.upto:
                p_last = pos[:, -1]
                g = torch.cat([torch.arange(view.sink, device=dev).expand(B, view.sink),
                               (p_last - n_win + 1)[:, None] + torch.arange(n_win, device=dev)], 1)  # (B, S')
                valid = g >= 0
                valid[:, view.sink:] &= g[:, view.sink:] >= view.sink
                self.gather = g.clamp_min(0)
                self.key_pos = g  # (B, S')
                self.mask = attention_mask(pos, g, view) & valid[:, None, None, :]
                start = first + T - n_win  # row 0's first gathered window position
                # every row reads the same positions (e.g. B = 1): two slices instead of an indexed copy
                self.slices = (view.sink, start) if self.slice_at is not None and start >= view.sink else None
                self.rows_g = torch.arange(B, device=dev)[:, None]
                return
        self.key_pos = cache.positions[: self.upto]  # (S,)
        if view is None and T == 1 and lo == hi:
            self.mask = None
        elif span is not None:  # a prefill from 0 in every row is the shared causal mask (decided on the host)
            causal = view is None and T > 1 and lo == 0 and hi == T - 1
            self.mask = causal_mask(T, dev) if causal else attention_mask(pos, self.key_pos, view)
        else:
            self.mask = prefix_mask(pos, self.key_pos, view)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cache
        if self.slice_at is not None:
            s = self.slice_at
            c.k[layer][:, :, s: s + k.shape[2]] = k
            c.v[layer][:, :, s: s + v.shape[2]] = v
        else:
            c.k[layer][self.rows, :, self.pos] = k.transpose(1, 2).to(c.k[layer].dtype)
            c.v[layer][self.rows, :, self.pos] = v.transpose(1, 2).to(c.v[layer].dtype)

    def read(self, layer: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys/values (B, KV, S, D) the layer attends over; ``start``: first position read (a sliding
        layer, no gathered view)."""
        c = self.cache
        if self.gather is None:
            return c.k[layer][:, :, start: self.upto], c.v[layer][:, :, start: self.upto]
        K, V = c.k[layer], c.v[layer]
        if self.slices is not None:
            sink, start = self.slices
            end = start + self.gather.shape[1] - sink
            return (torch.cat([K[:, :, :sink], K[:, :, start:end]], 2),
                    torch.cat([V[:, :, :sink], V[:, :, start:end]], 2))
        # (B, S', KV, D) rows copied whole, viewed as (B, KV, S', D)
        return K[self.rows_g, :, self.gather].transpose(1, 2), V[self.rows_g, :, self.gather].transpose(1, 2)

    def plan(self, windows: Sequence[int | None]) -> tuple[list[torch.Tensor | None], list[KVSource]]:
        """Per layer (``windows``: each layer's sliding window W, or None): its mask (B|1, 1, T, S) or None, and
        its KV source (write the layer's new keys/values, read what it attends over). A sliding layer whose
        window a query has passed (max position >= W) attends only to keys j > p - W: without a gathered view it
        reads positions from lo - W + 1 on (lo: the smallest query position), so its cost is O(W), not O(L);
        its mask is narrowed to the window (HF's sliding_window rule)."""
        masks: dict[int | None, torch.Tensor | None] = {None: self.mask}
        starts: dict[int | None, int] = {None: 0}
        for w in set(windows) - {None}:
            start = 0
            if self.upto <= w:  # no query has passed its window: nothing to narrow
                masks[w] = self.mask
            else:
                start = max(0, self.lo - w + 1) if self.gather is None else 0
                kp = self.key_pos if start == 0 else self.cache.positions[start: self.upto]
                base = self.mask if start == 0 and self.mask is not None else attention_mask(self.pos, kp, self.view)
                kp = kp[None, None, None, :] if kp.dim() == 1 else kp[:, None, None, :]
                masks[w] = base & (kp > self.pos[:, None, :, None] - w)
            starts[w] = start

        def source(layer: int, start: int) -> KVSource:
            def write_then_read(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                self.write(layer, k, v)
                return self.read(layer, start)

            return write_then_read

        return [masks[w] for w in windows], [source(i, starts[w]) for i, w in enumerate(windows)]
