"""The weight copies the fast path keeps, one job: per module, the inference copies of frozen ``nn.Linear`` weights
(:class:`WeightCache`: fused along the output dimension, transposed, bf16, or packed for the panel matmul in float32,
bf16 or int8; :func:`weight_copies`), the native decode blocks of a model (:func:`native_blocks`) and other tensors
derived from frozen weights (:func:`kept`, :func:`autocast_weight`), each rebuilt when a source weight changes and
never saved (:func:`forget` drops them); and the weight-only rounding that makes decoding stream bf16 or int8 copies
(:func:`use_bf16_weights`, :func:`use_int8_weights`, :func:`rounded_like`), which raises ConfigError on a non-float32
or non-CPU module."""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch
import torch.nn as nn

from spire import kernels
from spire.backend import of as backend_of
from spire.errors import ConfigError


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
