"""The per-op pieces of an inference block, one job: RMSNorm in one native call (:func:`rms_norm`), RoPE on
queries and keys at once (:func:`_rope_qk`), attention with one fused q/k/v matmul, grouped query heads and the decode
attention kernel for at most :data:`ATTENTION_KERNEL_ROWS` query rows per KV head (:func:`attention`), and the gated
MLP with gate and up as one matmul (:func:`mlp`): what a block runs when the native decode block does not apply."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from spire import kernels
from spire.backend import Backend
from spire.backend import of as backend_of
from spire.fastpath.cache_access import KVSource
from spire.fastpath.matmul import linear
from spire.kv_cache import is_causal


ATTENTION_KERNEL_ROWS = 4
"""On CPU in float32, attention with at most ATTENTION_KERNEL_ROWS query rows per key/value head (a decode
step: the query heads sharing a KV head) uses :func:`spire.kernels.decode_attention` (each key and value row
read once for all of them; :attr:`Backend.attention_kernel`); verify passes and prefills use torch's SDPA.

Which paths run is the module's :class:`spire.backend.Backend` (``owner.backend``): ``transposed_gemv`` (M = 1 by
a transposed (in, out) copy: MKL streams that GEMV about 1.2-1.4x faster than F.linear's, one extra copy of the
weights in memory), ``panel_kernel`` (decode matmuls, M ≤ KERNEL_MAX_M rows and every native block, by a copy packed
once for :func:`spire.kernels.panel_linear`: on a Zen 2 core 1.4-1.8x faster than the row-major kernel in float32
at M = 1..8 and 1.3-1.8x faster than MKL; with bf16 weights 1.1-1.4x at M = 1..5 and 0.92x at M = 8, docs/bench.md),
``fused_block`` (:func:`decode_step` runs blocks as :class:`spire.kernels.DecodeBlock` calls: the ~40 torch ops per
block and their dispatch saved), ``rmsnorm_kernel`` (RMSNorm in one native call, ~7 small torch ops saved) and
``autocast_copies`` (:func:`autocast_weight`)."""


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, weight: torch.Tensor, backend: Backend
             ) -> torch.Tensor | None:
    """x / sqrt(mean(x²) + eps) · w in one native call (float32 CPU inference, ``backend.rmsnorm_kernel``), or None
    (the caller computes it with torch). ``weight``: the norm's parameter (autograd through it keeps the torch
    ops)."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and backend.rmsnorm_kernel and backend.kernels
            and kernels.available()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return kernels.rms_norm(x, w, eps)
    return None


def _rope_qk(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over a (B, heads, T, D) stack of query and key heads at once (spire.rope.apply_rope's arithmetic)."""
    half = y.shape[-1] // 2
    return y * cos + torch.cat((-y[..., half:], y[..., :half]), -1) * sin


def attention(attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_source: KVSource,
              mask: torch.Tensor | None) -> torch.Tensor:
    """Inference ``Attention`` of normed h: (B, T, d_model) -> (B, T, d_model): one fused q/k/v matmul, RoPE,
    ``kv_source``, attention (mask may be None: nothing masked), o projection. Query heads are grouped per
    KV head (H = KV·g, head h reads KV head h // g, as HF's repeat_kv) so no K/V copy is made for GQA."""
    B, T, _ = h.shape
    H, KV, D = attn.n_heads, attn.n_kv, attn.d_head
    y = linear(h, (attn.q_proj, attn.k_proj, attn.v_proj), attn, "qkv").view(B, T, H + 2 * KV, D)
    if attn.qk_norm:
        y = torch.cat([attn.q_norm(y[:, :, :H]), attn.k_norm(y[:, :, H:H + KV]), y[:, :, H + KV:]], 2)
    y = y.transpose(1, 2)  # (B, H + 2 KV, T, D)
    qk = _rope_qk(y[:, : H + KV], cos, sin)
    q = qk[:, :H]
    k, v = kv_source(qk[:, H:], y[:, H + KV:])  # (B, KV, S, D)
    g = H // KV
    bk = backend_of(attn)
    if bk.causal_attention and is_causal(mask) and k.shape[2] == T:  # a prefill from 0: the masked half is skipped
        a = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=attn.scale,
                                           enable_gqa=g > 1)
        return linear(a.transpose(1, 2).reshape(B * T, H * D), (attn.o_proj,), attn, "o").view(B, T, -1)
    if g > 1:
        q = q.reshape(B, KV, g * T, D)
        if mask is not None:
            mask = mask.expand(mask.shape[0], 1, T, mask.shape[-1]).repeat(1, 1, g, 1)
    a = None
    if (bk.attention_kernel and q.device.type == "cpu" and q.dtype == torch.float32 and g * T <= ATTENTION_KERNEL_ROWS
            and bk.kernels and kernels.available()):
        a = kernels.decode_attention(q, k, v, mask, attn.scale)
    if a is None:
        a = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=attn.scale)
    a = a.view(B, H, T, D).transpose(1, 2).reshape(B * T, H * D)
    return linear(a, (attn.o_proj,), attn, "o").view(B, T, -1)


def mlp(m: nn.Module, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Inference gated MLP down(act(gate(x)) * up(x)) with gate and up as one matmul. x: (..., d_model)."""
    gu = linear(x, (m.gate_proj, m.up_proj), m, "gu")
    d_ff = m.gate_proj.out_features
    return linear(act(gu[..., :d_ff]) * gu[..., d_ff:], (m.down_proj,), m, "down")
