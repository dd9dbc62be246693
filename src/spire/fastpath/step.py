"""The decode-step interface, one job: :func:`decode_step` decides whether a forward's decoder blocks run as native
:class:`spire.kernels.DecodeBlock` calls (:class:`DecodeStep`, over a dense cache or a ring; :func:`native_block`
keeps each layer's block, :func:`_layer_views` and :func:`_native_applies` decide where it applies) or per op
(:class:`PerOpStep`, from the caller's :data:`Plan`); either has ``block(i, x)`` and ``write_kv(i, m)``, so no caller
forks. Raises ConfigError for a position outside a dense cache."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from spire import kernels
from spire.backend import Backend
from spire.backend import of as backend_of
from spire.fastpath.cache_access import KVSource, check_positions
from spire.fastpath.matmul import KERNEL_MAX_M
from spire.fastpath.weights import _PANEL_LAYOUT, _copies, native_blocks
from spire.kv_cache import BaseKVCache, SinkWindow, Span


def native_block(block: nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, store: dict,
                 i: int) -> kernels.DecodeBlock:
    """The :class:`spire.kernels.DecodeBlock` of ``block`` over one cache layer, kept in ``store[i]`` and
    rebuilt when a weight copy or the cache storage changes (the kernel reads parameters in place, so
    in-place updates are seen). Weights: the block's fused float32 copies, or its bf16 copies after
    :func:`use_bf16_weights`, or its int8 ones after :func:`use_int8_weights` (float32 ones, holding the same
    values, without the panel matmul)."""
    attn, m = block.self_attn, block.mlp
    qkv = _copies(attn, "qkv")
    bf16 = qkv.weight_dtype == torch.bfloat16
    layout = _PANEL_LAYOUT.get(qkv.weight_dtype, "P") if backend_of(block).panel_kernel else ("B" if bf16 else "N")
    ws = (qkv.get((attn.q_proj, attn.k_proj, attn.v_proj), layout), _copies(attn, "o").get((attn.o_proj,), layout),
          _copies(m, "gu").get((m.gate_proj, m.up_proj), layout), _copies(m, "down").get((m.down_proj,), layout))
    ln1, ln2 = block.input_layernorm.weight, block.post_attention_layernorm.weight
    key = (*(w.data_ptr() for w in ws), ln1.data_ptr(), ln2.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
           tuple(k_cache.shape), k_cache.stride(), v_cache.stride())
    hit = store.get(i)
    if hit is not None and hit[0] == key:
        return hit[1]
    fb = kernels.DecodeBlock(ln1.detach(), ln2.detach(), block.input_layernorm.eps, *(w.detach() for w in ws),
                             k_cache, v_cache, n_heads, d_ff=m.down_proj.in_features)
    fb.rope_id = block.rope_id
    store[i] = (key, fb)
    return fb


def _layer_views(cfg, pos: torch.Tensor, view: SinkWindow | None, span: Span | None = None
                 ) -> list[SinkWindow | None] | None:
    """Per layer, the (sink, window) rule the native block applies over a dense cache: the forward's view, or
    for a sliding layer whose window is reached the window alone (sink 0) -- exact when there is no view or
    the layer's window is within the view's. None when a layer's rule is not one (sink, window) pair (a view
    with a smaller window than the layer's, past the layer's window): the forward then runs per op."""
    windows = cfg.layer_windows
    if windows is None:
        return [view] * cfg.n_layers
    hi = span.hi if span is not None else int(pos.max())
    views: list[SinkWindow | None] = []
    for w in windows:
        if w is None or hi < w:
            views.append(view)
        elif view is None or w <= view.window:
            views.append(SinkWindow(0, w))
        else:
            return None
    return views


def _native_applies(cfg, layers: nn.ModuleList, x: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                    backend: Backend) -> bool:
    """Whether :class:`spire.kernels.DecodeBlock` takes B × T new tokens x of a model shaped by ``cfg`` over a
    cache layer like ``k_cache``: ``backend.fused_block`` on, plain Llama blocks (:attr:`ModelConfig.plain_blocks`:
    a family with biases, q/k norms or Gemma's norms runs per op), float32 on the CPU, few rows, kernels built,
    frozen layers (the kernel computes no gradients, and the native block reads kept weight copies)."""
    B, T = pos.shape
    if (not backend.fused_block or not cfg.plain_blocks or x.device.type != "cpu" or x.dtype != torch.float32
            or B * T > min(KERNEL_MAX_M, kernels.MAX_ROWS) or cfg.d_head % 8 or cfg.d_head > 256
            or cfg.n_heads % cfg.n_kv_heads or cfg.n_heads // cfg.n_kv_heads * T > kernels.BLOCK_MAX_ROWS
            or k_cache.dtype != torch.float32 or k_cache.device.type != "cpu" or k_cache.stride(-1) != 1
            or not backend.kernels or not kernels.available()):
        return False
    return not any(p.requires_grad for p in layers.parameters())  # weights in training: per op, no kept copies


class PerOpStep:
    """One forward's decoder blocks per torch op, the twin of :class:`DecodeStep` behind the same two calls
    (made by :func:`decode_step` from the caller's plan): ``block(i, x)`` runs ``layers[i](x, cos, sin,
    sources[i], masks[i])``; ``write_kv(i, m)`` calls the caller's memory write."""

    native = False

    def __init__(self, layers: nn.ModuleList, cos: torch.Tensor, sin: torch.Tensor, sources: Sequence[KVSource],
                 masks: Sequence[torch.Tensor | None], write_kv: Callable[[int, torch.Tensor], None] | None) -> None:
        self.layers, self.cos, self.sin, self.sources, self.masks = layers, cos, sin, sources, masks
        self._write = write_kv

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[i](x, self.cos, self.sin, self.sources[i], self.masks[i])

    def write_kv(self, i: int, m: torch.Tensor) -> None:
        if self._write is None:
            raise TypeError("this forward writes no memory keys/values")
        self._write(i, m)


Plan = Callable[[], tuple[Sequence[KVSource], Sequence["torch.Tensor | None"],
                          "Callable[[int, torch.Tensor], None] | None"]]
"""The per-op path of a forward, built only when the native one does not apply: () -> (each layer's KV source,
each layer's mask, the memory write or None)."""


class DecodeStep:
    """One forward's decoder blocks as native :class:`spire.kernels.DecodeBlock` calls (made by
    :func:`decode_step`). What the calls share is prepared once: positions (B, T) int64, RoPE tables
    (R, B·T, D) (each block reads its ``rope_id``), the scratch buffer, and the cache rule: per-layer
    (sink, window) views over a dense cache, or the slots to write and the (B, T, S) mask over a ring."""

    native = True

    def __init__(self, owner: nn.Module, layers: nn.ModuleList, n_heads: int, cache: BaseKVCache,
                 pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, views: list[SinkWindow | None] | None,
                 slots: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        B, T = pos.shape
        self.B, self.T = B, T
        self.layers, self.n_heads, self.cache, self.store = layers, n_heads, cache, native_blocks(owner)
        self.pos = pos.to(torch.int64).contiguous()
        R = cos.shape[0] if cos.dim() == 5 else 1
        self.cos, self.sin = cos.reshape(R, B * T, -1).contiguous(), sin.reshape(R, B * T, -1).contiguous()
        self.views, self.slots, self.mask = views, slots, mask
        self._work: torch.Tensor | None = None
        self._blocks: dict[int, kernels.DecodeBlock] = {}

    def _native(self, i: int) -> kernels.DecodeBlock:
        fb = self._blocks.get(i)
        if fb is None:  # looked up once per forward (a SPIRe step runs a layer, then writes its memory)
            fb = self._blocks[i] = native_block(self.layers[i], self.cache.k[i], self.cache.v[i], self.n_heads,
                                                self.store, i)
            if self._work is None:  # every block of a model has the same sizes: one buffer for the whole forward
                self._work = torch.empty(fb.work_size(self.B * self.T), dtype=torch.float32)
        return fb

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d) residual stream entering layer i -> leaving it (its keys/values written to the cache)."""
        fb = self._native(i)
        view = None if self.views is None else self.views[i]
        sink, window = (0, 0) if view is None else (view.sink, view.window)
        r = fb.rope_id
        h = fb(x.reshape(self.B * self.T, -1).contiguous(), self.pos, sink, window, self.cos[r], self.sin[r],
               self._work, slots=self.slots, mask=self.mask)
        return h.view(x.shape)

    def write_kv(self, i: int, m: torch.Tensor) -> None:
        """Layer i's keys/values of vectors m: (B, T, d) (``Block.memory_kv``) into the cache."""
        fb = self._native(i)
        r = fb.rope_id
        fb.write_kv(m.reshape(self.B * self.T, -1).contiguous(), self.pos, self.cos[r], self.sin[r], self._work,
                    self.slots)


def decode_step(owner: nn.Module, layers: nn.ModuleList, cfg, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache: BaseKVCache | None, plan: Plan, view: SinkWindow | None = None,
                mask: torch.Tensor | None = None, slots: torch.Tensor | None = None, allow_native: bool = True,
                span: Span | None = None) -> DecodeStep | PerOpStep:
    """The blocks of one forward of ``layers`` (a model's blocks, shaped by ``cfg``; ``owner`` keeps their native
    blocks and carries the :class:`spire.backend.Backend`) for new tokens x: (B, T, d) at positions pos: (B, T),
    with RoPE tables cos, sin (R, B, 1, T, D): the native :class:`DecodeStep` where it applies (and
    ``allow_native``), else the :class:`PerOpStep` of the caller's ``plan``. The caller runs either the same way.

    Over a dense :class:`KVCache` (no ``mask``) keys live at their positions and each layer reads through
    ``view`` and its own sliding window; raises ConfigError for a position outside the cache. Over a
    :class:`RingKVCache` (T ≤ its ring; the slots of pos already claimed, given as ``slots`` (B, T) or computed
    here) keys go to the slots of pos and every block reads the entries ``mask`` (B, 1, T, S) bool allows (None:
    memory writes only). ``span``: pos on the host (:class:`spire.kv_cache.Span`), read instead of pos."""
    if allow_native and cache is not None and _native_applies(cfg, layers, x, pos, cache.k[0], backend_of(owner)):
        if cache.positional and mask is None:
            views = _layer_views(cfg, pos, view, span)
            if views is not None:
                check_positions(pos, cache.max_len, span)
                return DecodeStep(owner, layers, cfg.n_heads, cache, pos, cos, sin, views, None, None)
        elif not cache.positional and pos.shape[1] <= cache.ring:
            mask8 = None if mask is None else mask[:, 0].contiguous().view(torch.uint8)  # (B, T, S), no copy
            return DecodeStep(owner, layers, cfg.n_heads, cache, pos, cos, sin, None,
                              cache.slot(pos) if slots is None else slots, mask8)
    return PerOpStep(layers, cos, sin, *plan())
