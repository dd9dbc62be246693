"""The inference fast path of :mod:`spire.model`: the same arithmetic with fewer, better-shaped kernels.

It applies when autograd need not see the computation (``torch.no_grad()`` or frozen weights and inputs);
with autograd active on trainable weights the model runs its plain reference ops. docs/bench.md has the
measurements behind each choice.

One decode-step interface (:func:`decode_step`, :class:`DecodeStep`): on CPU in float32, a forward of at most
:data:`KERNEL_MAX_M` new tokens over a dense :class:`KVCache` (a target decode step, a verify pass, a MagicDec
draft step) or over a :class:`RingKVCache` (the SPIRe draft's step and its memory writes) runs each decoder
block as one native call (:class:`spire.kernels.DecodeBlock`: norms, fused matmuls, RoPE, cache write,
attention over the cache in place, MLP, residuals). :func:`decode_step` decides whether the native block
applies; when it returns None the caller runs its blocks per op, which still takes the tricks below:

- q/k/v and gate/up projections run as one matmul each over weights concatenated along the output dimension
  (:func:`linear`); on CPU in float32 the matmul follows the number of rows M = B·T: M = 1 multiplies by a
  transposed (in, out) copy of the weights (a GEMV MKL streams faster than ``F.linear``'s), 2 ≤ M ≤ 32 uses
  :func:`spire.kernels.skinny_linear` (one pass over each weight for all rows), larger M ``F.linear``;
- RoPE on q and k in one op set; decode attention through :func:`spire.kernels.decode_attention`; RMSNorm
  through :func:`spire.kernels.rms_norm`;
- the dense cache is written by slice when every row writes the same contiguous positions, the mask is
  dropped when nothing is masked, and a sink + window view (MagicDec) gathers only its entries
  (:class:`CacheAccess`), so its cost does not grow with the context;
- weight-only bf16 (:func:`use_bf16_weights`) and, for drafts, weight-only int8 (:func:`use_int8_weights`).

The weight copies (fused, transposed, bf16, packed) and the native blocks are kept per module by this module
(:func:`weight_copies`, :func:`native_blocks`), built on first use and rebuilt whenever a source parameter
changes (data pointer, version counter, dtype, device), so training in place stays correct. They are not
buffers (never saved) and a deepcopy starts without them. Decoding with the panel matmul keeps one packed copy
of every weight; a prefill (F.linear over the fused q/k/v and gate/up weights) adds those fused copies, so up to
two extra copies of the weights in all.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from spire import kernels
from spire.backend import Backend
from spire.backend import of as backend_of
from spire.errors import ConfigError
from spire.kv_cache import (BaseKVCache, KVCache, SinkWindow, Span, attention_mask, causal_mask, is_causal,
                            prefix_mask)

KERNEL_MAX_M = 32
"""On CPU in float32, matmuls with 2 ≤ M ≤ KERNEL_MAX_M rows use :func:`spire.kernels.skinny_linear` when it
is available (one pass over each weight for all rows, no weight copy); more rows use F.linear (BLAS)."""

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

# A KV source: given a block's new keys/values (B, KV, T, D), return the keys/values to attend over
# (B, KV, S, D). The dense cache writes then reads; the SPIRe draft prepends its memory.
KVSource = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# ------------------------------------------------------------------------------------------ weight copies

class WeightCache:
    """Inference copies of one or more ``nn.Linear`` weights: concatenated along the output dimension, in
    (out, in) layout ("N"), transposed to a contiguous (in, out) layout ("T"), bf16 (out, in) ("B"), or packed
    for the panel matmul (:func:`spire.kernels.pack_panels`) in float32 ("P") or bf16 ("PB"), or as group-wise
    int8 (:func:`spire.kernels.pack_panels_int8`, "PQ").

    Copies are kept for frozen weights only (``requires_grad`` False: a loaded target, a loaded or finished draft);
    a weight in training gets a fresh product every call (:func:`linear`), so an optimizer step never meets a
    kept copy. A copy is rebuilt whenever a source weight changes: its key holds each weight's data pointer,
    version counter (bumped by every in-place update, e.g. ``load_state_dict`` or a rounding), dtype and device.
    ``copy.deepcopy`` gives an empty cache.
    """

    def __init__(self, weight_dtype: torch.dtype | None = None) -> None:
        self._store: dict[str, tuple[tuple, torch.Tensor]] = {}
        self.weight_dtype = weight_dtype  # torch.bfloat16 / torch.int8: use_bf16_weights / use_int8_weights

    def __deepcopy__(self, memo) -> "WeightCache":
        return WeightCache(self.weight_dtype)

    def clear(self) -> None:
        self._store.clear()

    def get(self, linears: Sequence[nn.Linear], layout: str) -> torch.Tensor:
        """The (out_total, in) ("N"), (in, out_total) ("T"), bf16 (out_total, in) ("B") or packed ("P", "PB",
        "PQ") weight of ``linears`` concatenated."""
        ws = [lin.weight for lin in linears]
        if layout == "N" and len(ws) == 1:
            return ws[0]
        if any(w.requires_grad for w in ws):  # a weight in training changes every step: never kept
            return self._build([w.detach() for w in ws], layout)
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
        hit = self._store.get(layout)
        if hit is not None and hit[0] == key:
            return hit[1]
        self._store.pop(layout, None)  # free the stale copy before building the new one
        w = self._build([w.detach() for w in ws], layout)
        self._store[layout] = (key, w)
        return w

    @staticmethod
    @torch.no_grad()
    def _build(ws: list[torch.Tensor], layout: str) -> torch.Tensor:
        w = ws[0] if len(ws) == 1 else torch.cat(ws)
        if layout == "PQ":
            return kernels.pack_panels_int8(w)
        if layout in ("P", "PB"):
            return kernels.pack_panels(w.to(torch.bfloat16) if layout == "PB" else w)
        return (w.t().contiguous() if layout == "T" else w.to(torch.bfloat16).contiguous() if layout == "B"
                else w.contiguous())

    def bias(self, linears: Sequence[nn.Linear]) -> torch.Tensor | None:
        """The (out_total,) biases of ``linears`` concatenated (zeros for one without), None when none has one."""
        bs = [lin.bias for lin in linears]
        if all(b is None for b in bs):
            return None
        if len(bs) == 1:
            return bs[0]
        key = tuple((lin.out_features, None if b is None else (b.data_ptr(), b._version, b.dtype, b.device))
                    for lin, b in zip(linears, bs))
        hit = self._store.get("bias")
        if hit is not None and hit[0] == key:
            return hit[1]
        with torch.no_grad():
            w = linears[0].weight
            b = torch.cat([torch.zeros(lin.out_features, dtype=w.dtype, device=w.device) if b is None else b.detach()
                           for lin, b in zip(linears, bs)])
        if not any(b is not None and b.requires_grad for b in bs):  # as weights: only frozen biases are kept
            self._store["bias"] = (key, b)
        return b


class _State:
    """What the fast path keeps on one module: weight copies by role, native blocks by layer, and the weight
    dtype new copies take. Never saved; a deepcopy or pickle keeps the weight dtype only."""

    __slots__ = ("weights", "blocks", "weight_dtype", "derived")

    def __init__(self, weight_dtype: torch.dtype | None = None) -> None:
        self.weights: dict[str, WeightCache] = {}
        self.blocks: dict[int, tuple[tuple, kernels.DecodeBlock]] = {}
        self.weight_dtype = weight_dtype
        self.derived: dict[str, tuple[tuple, list[weakref.ref], torch.Tensor]] = {}

    def __deepcopy__(self, memo) -> "_State":
        return _State(self.weight_dtype)

    def __reduce__(self):
        return (_State, (self.weight_dtype,))


def _state(module: nn.Module) -> _State:
    state = module.__dict__.get("_fastpath")
    if state is None:  # set past nn.Module.__setattr__: not a parameter, buffer or submodule
        state = module.__dict__["_fastpath"] = _State()
    return state


def weight_copies(module: nn.Module) -> dict[str, WeightCache]:
    """Role -> the :class:`WeightCache` the fast path keeps for ``module`` (e.g. an MLP's "gu" and "down")."""
    return _state(module).weights


def native_blocks(owner: nn.Module) -> dict[int, tuple[tuple, kernels.DecodeBlock]]:
    """Layer -> (key, :class:`spire.kernels.DecodeBlock`) kept for a model ``owner`` (empty until a
    :class:`DecodeStep` ran). The blocks hold raw addresses of the weights and cache, never copied."""
    return _state(owner).blocks


def forget(module: nn.Module) -> None:
    """Drop the weight copies kept for ``module`` (rebuilt on next use; e.g. its weights were replaced by
    new tensors that may reuse a freed address)."""
    state = _state(module)
    for wc in state.weights.values():
        wc.clear()
    state.derived.clear()


def kept(owner: nn.Module, role: str, sources: Sequence[torch.Tensor], build: Callable[[], torch.Tensor]
         ) -> torch.Tensor:
    """``build()`` (a tensor derived from the frozen ``sources``: a bf16 cast, a gather of head rows), kept on
    ``owner`` under ``role`` and rebuilt when a source is another tensor, or its storage or version changed."""
    store = _state(owner).derived
    key = tuple((t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for t in sources)
    hit = store.get(role)
    if hit is not None and hit[0] == key and all(r() is t for r, t in zip(hit[1], sources)):
        return hit[2]
    store.pop(role, None)
    value = build()
    store[role] = (key, [weakref.ref(t) for t in sources], value)
    return value


def _copies(module: nn.Module, role: str) -> WeightCache:
    state = _state(module)
    wc = state.weights.get(role)
    if wc is None:
        wc = state.weights[role] = WeightCache(state.weight_dtype)
    return wc


def needs_autograd(linears: Sequence[nn.Module], x: torch.Tensor | None = None) -> bool:
    """Whether autograd must see this computation: grad mode on and a weight (or the input) requires grad.
    The fast path (native kernels, cached weight copies) is taken only when it need not."""
    return torch.is_grad_enabled() and (any(lin.weight.requires_grad for lin in linears)
                                        or (x is not None and x.requires_grad))


def linear(x: torch.Tensor, linears: Sequence[nn.Linear], owner: nn.Module, role: str) -> torch.Tensor:
    """x: (..., in) -> (..., sum of out) = concat of ``lin(x)`` over ``linears`` (biases added), for inference,
    through the weight copies kept for ``owner`` under ``role``.

    The layout is picked by the row count M = x.numel() / in (module docstring). Mathematically the same
    product as ``F.linear``; the float32 summation order may differ (differences ~1e-7 relative).
    """
    training = any(lin.weight.requires_grad for lin in linears)
    if torch.compiler.is_compiling() and not training:  # traced: no kept copies (keyed by data pointers), one matmul
        ys = [F.linear(x, lin.weight, lin.bias) for lin in linears]  # per linear
        return ys[0] if len(ys) == 1 else torch.cat(ys, -1)
    cache = _copies(owner, role)
    if training:  # in training: the weights as they are now (never kept)
        return F.linear(x, cache.get(linears, "N"), cache.bias(linears))
    bk = backend_of(owner)
    lead, d_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d_in)
    M = x2.shape[0]
    y = None
    if x.device.type == "cpu" and x2.dtype == torch.float32:
        native = bk.kernels and kernels.available()
        if bk.panel_kernel and M <= KERNEL_MAX_M and native:
            xc = x2 if x2.stride(-1) == 1 else x2.contiguous()
            y = kernels.panel_linear(xc, cache.get(linears, _PANEL_LAYOUT.get(cache.weight_dtype, "P")),
                                     sum(lin.out_features for lin in linears))
        elif cache.weight_dtype == torch.bfloat16 and M <= KERNEL_MAX_M and native:
            y = kernels.skinny_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), [cache.get(linears, "B")])
        elif M == 1 and bk.transposed_gemv:
            y = x2 @ cache.get(linears, "T")
        elif M <= KERNEL_MAX_M and native:
            y = kernels.skinny_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), [lin.weight for lin in linears])
    b = cache.bias(linears)
    if y is None:
        w = cache.get(linears, "N")
        if (bk.onednn_linear and x2.device.type == "cpu" and x2.dtype == w.dtype == torch.float32 and onednn()
                and not torch.is_autocast_enabled("cpu")):  # under autocast F.linear runs bf16 (not this op)
            y = onednn_linear(x2, w, b)
        else:
            y = F.linear(x2, w, b)
    elif b is not None:
        y = y + b
    return y.reshape(*lead, y.shape[-1])


ONEDNN_ROWS = 64
"""oneDNN builds (and keeps, up to its cache's 1,024) one primitive per matmul shape, about 0.6 MB each here: rows
are padded to a multiple of this, so a server meeting every prompt length keeps a few dozen shapes, not hundreds
(RSS grew ~850 MB over a 10-minute load without it)."""


def onednn_linear(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(M, in) @ (out, in)^T + b by oneDNN, the rows padded with zeros to a multiple of :data:`ONEDNN_ROWS`."""
    M = x2.shape[0]
    pad = -M % ONEDNN_ROWS
    x = F.pad(x2, (0, 0, 0, pad)) if pad else (x2 if x2.stride(-1) == 1 else x2.contiguous())
    y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return y[:M] if pad else y


@functools.cache
def onednn() -> bool:
    """Whether this torch build runs float32 matmuls through oneDNN (``torch.ops.mkldnn._linear_pointwise``,
    what torch.compile's CPU backend emits for a frozen linear): checked once, by one small product against
    F.linear's."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        x, w, b = torch.randn(40, 24), torch.randn(16, 24), torch.randn(16)
        y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w, b), atol=1e-4, rtol=1e-4))
    except (RuntimeError, AttributeError):
        return False


_PANEL_LAYOUT = {torch.bfloat16: "PB", torch.int8: "PQ"}  # packed copy by weight dtype (float32: "P")


def autocast_weight(w: torch.Tensor, owner: nn.Module, role: str) -> torch.Tensor:
    """``w`` as CPU bf16 autocast would cast it, kept from one call to the next while ``w`` lives unchanged.
    Autocast caches the casts of trainable weights within one autocast region only, and never those of frozen
    ones (the target's, a SPIRe draft's head): training cast the 16 K x 576 head once per k-pass pass and the
    teacher's rows once per step. Outside CPU bf16 autocast, for a weight that requires grad, or with
    ``owner``'s backend has ``autocast_copies`` off (autocast then casts anew on every call), ``w`` itself. The copy is
    kept on ``owner`` under ``role`` (:func:`kept`: an in-place change or new storage under the same tensor makes a
    new one)."""
    if (not backend_of(owner).autocast_copies or w.requires_grad or w.device.type != "cpu"
            or not torch.is_autocast_enabled("cpu") or torch.get_autocast_dtype("cpu") != torch.bfloat16
            or w.dtype != torch.float32):
        return w
    return kept(owner, f"autocast:{role}", (w,), lambda: w.detach().to(torch.bfloat16))


def unembed(h: torch.Tensor, head: nn.Linear, owner: nn.Module) -> torch.Tensor:
    """Normed (B, T, d_model) -> float32 logits (B, T, V) through ``head``: the fast path with the head copies
    kept for ``owner`` unless autograd must see it."""
    if needs_autograd((head,), h):
        return F.linear(h, autocast_weight(head.weight, owner, "head"), head.bias).float()
    return linear(h, (head,), owner, "head").float()


def bf16_weights(module: nn.Module) -> bool:
    """Whether :func:`use_bf16_weights` rounded ``module`` (its decoding matmuls stream bf16 copies)."""
    return _state(module).weight_dtype == torch.bfloat16


def use_bf16_weights(*modules: nn.Module | None) -> int:
    """Weight-only bf16 for float32 CPU inference: round every ``nn.Linear`` and ``nn.Embedding`` weight of
    the ``modules`` (targets or drafts; None entries are skipped) to the nearest bf16 value, in place, and let
    decoding matmuls (M ≤ KERNEL_MAX_M rows) stream a bf16 copy through :mod:`spire.kernels` -- half the
    weight bytes of float32, float32 activations and arithmetic. Larger matmuls (prefill) use the float32
    weights, which now hold the same bf16 values, so every path computes the same model. The rounding is
    irreversible (reload the checkpoint for the float32 model); norms and caches stay float32. Without the
    kernels (no AVX2 or C compiler, SPIRE_KERNELS=0) the model is still rounded and runs through torch at
    float32 speed.

    Returns the number of weight tensors rounded. Raises ConfigError on a non-float32 or non-CPU module.
    """
    return _round_weights(modules, (nn.Linear, nn.Embedding), torch.bfloat16, lambda w: w.to(torch.bfloat16).float())


def _round_weights(modules, kinds: tuple[type, ...], weight_dtype: torch.dtype,
                   rnd: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Round in place the weight of every ``kinds`` submodule of ``modules`` by ``rnd`` (float32 -> float32) and
    mark every submodule's fast-path copies as ``weight_dtype`` (stale copies dropped). Returns the count."""
    subs = [m for module in modules if module is not None for m in module.modules()]
    params = {id(m.weight): m.weight for m in subs if isinstance(m, kinds)}
    name = {torch.bfloat16: "bf16", torch.int8: "int8"}[weight_dtype]
    for w in params.values():
        if w.dtype != torch.float32 or w.device.type != "cpu":
            raise ConfigError(f"{name} weights need a float32 model on the CPU, got {w.dtype} on {w.device.type}")
        if weight_dtype == torch.int8 and w.shape[1] % 2:
            raise ConfigError(f"int8 weights need an even number of inputs per linear layer, got {w.shape[1]}")
    with torch.no_grad():
        for w in params.values():
            w.copy_(rnd(w.detach()))
    for m in subs:
        state = _state(m)
        state.weight_dtype = weight_dtype
        for wc in state.weights.values():
            wc.weight_dtype = weight_dtype
            wc.clear()
    return len(params)


def int8_weights(module: nn.Module) -> bool:
    """Whether :func:`use_int8_weights` quantized ``module`` (its decoding matmuls stream int8 copies)."""
    return _state(module).weight_dtype == torch.int8


def rounded_like(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """The float32 weight w rounded as ``module``'s own weights were (to bf16 values after
    :func:`use_bf16_weights`, to group-wise int8 values after :func:`use_int8_weights`), else w itself: a weight
    derived later (the SPIRe draft's vocabulary head) then computes like the rest of the module on every path."""
    if w.dtype != torch.float32:
        return w
    if bf16_weights(module):
        return w.bfloat16().float()
    if int8_weights(module):
        return kernels.dequantize_int8(*kernels.quantize_int8(w))
    return w


def use_int8_weights(*modules: nn.Module | None) -> int:
    """Weight-only int8 for a float32 CPU draft: round every ``nn.Linear`` weight of the ``modules`` (None entries
    skipped) in place to its group-wise int8 value (:func:`spire.kernels.quantize_int8`: one scale per output row
    and 64 inputs), and let decoding matmuls (M ≤ KERNEL_MAX_M rows) stream the packed int8 copy
    (:func:`spire.kernels.pack_panels_int8`: 1.06 bytes per value, a quarter of float32's plus the scales), which
    multiplies by activations rounded to int16 per group of 64 (2^-16 of the group's largest value) with exact
    int32 sums. Prefill matmuls use the float32 weights, which now hold the same values with float32
    activations: the two paths differ by that activation rounding (~1e-4 of the logit scale after a few blocks;
    tests/test_int8_kernel.py), not by the weights. Meant for a draft: speculative decoding stays lossless
    whatever q the draft computes (each step's q is the one its token was drawn from), so a draft's precision
    changes only τ. Embeddings are lookups and
    stay float32 (one tied to a head holds the head's rounded values); irreversible (reload for the float32
    model). Without the kernels the rounded model runs at float32 speed.

    Returns the number of weight tensors rounded. Raises ConfigError on a non-float32 or non-CPU module, or a
    linear layer with an odd number of inputs (the kernel multiplies inputs in pairs).
    """
    return _round_weights(modules, (nn.Linear,), torch.int8, lambda w: kernels.dequantize_int8(*kernels.quantize_int8(w)))


# ------------------------------------------------------------------------------------- per-op pieces

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


# ------------------------------------------------------------------------------ the native decode step

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
