"""Matmul layout by row count, one job: :func:`linear` multiplies x (..., in) by one or more ``nn.Linear`` weights
concatenated, choosing the path by the number of rows M = B·T (on CPU in float32: the panel kernel or the skinny
kernel up to :data:`KERNEL_MAX_M` rows, a transposed-copy GEMV at M = 1, oneDNN with rows padded to
:data:`ONEDNN_ROWS` or ``F.linear`` above), through the copies :mod:`spire.fastpath.weights` keeps; :func:`unembed`
is the vocabulary head's product (float32 logits), and :func:`needs_autograd` says when the plain ops must run
instead."""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from spire import kernels
from spire.backend import of as backend_of
from spire.fastpath.weights import _PANEL_LAYOUT, _copies, autocast_weight


KERNEL_MAX_M = 32
"""On CPU in float32, matmuls with 2 ≤ M ≤ KERNEL_MAX_M rows use :func:`spire.kernels.skinny_linear` when it
is available (one pass over each weight for all rows, no weight copy); more rows use F.linear (BLAS)."""


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


def unembed(h: torch.Tensor, head: nn.Linear, owner: nn.Module) -> torch.Tensor:
    """Normed (B, T, d_model) -> float32 logits (B, T, V) through ``head``: the fast path with the head copies
    kept for ``owner`` unless autograd must see it."""
    if needs_autograd((head,), h):
        return F.linear(h, autocast_weight(head.weight, owner, "head"), head.bias).float()
    return linear(h, (head,), owner, "head").float()
