"""Optional native kernels for CPU decoding (built on first use with the system C compiler, cached).

:func:`skinny_linear` computes ``torch.cat([F.linear(x, W_i) for W_i in weights], -1)`` for a few rows of x
(decoding: M = batch × new tokens ≤ :data:`MAX_ROWS`) with ``cpu_decode.c``: each weight row is read from
memory once and multiplied with all M rows (see the C file). MKL's sgemm re-packs the weight on every call;
on one core of a Zen 3 EPYC the kernel runs SmolLM2's decode matmuls at M = 4 in 42-47 ms and at M = 8 in
60-63 ms where ``F.linear`` takes 68-69 and 80-83 ms (docs/bench.md). At M = 1 MKL's GEMV over a transposed
weight copy is faster and spire.fastpath uses that instead.

:func:`decode_attention` is the attention of a decode step (few query rows per key/value head) with each
cached key and value row read once for all of them.

:class:`DecodeBlock` runs a whole decoder block for a few new tokens in one call (RMSNorm, the fused q/k/v
matmul, RoPE, the KV-cache write, attention over the dense cache with per-row positions and an optional
sink + window view, o projection, SwiGLU MLP, residuals): spire.fastpath uses it for decode steps, verify passes
and MagicDec draft steps, where the ~40 torch ops per block cost as much as the matmuls at B = 1.

The shared library is compiled once per machine into ``<spire cache>/kernels/`` with
``cc -O3 -mavx2 -mfma -fopenmp`` (about a second) and loaded with ctypes after torch, so its OpenMP calls
use torch's libgomp and thread count. Used only for float32 CPU activations whose inner dimension is
contiguous (weights float32 or bf16), on CPUs with AVX2 and FMA; on CPUs with AVX-512F/BW/VL/DQ (detected at run
time, the flags stay the same so the library builds and runs on AVX2-only machines) :func:`skinny_linear`'s
matmuls of 3 to 8 rows take an AVX-512 path that multiplies a tile of 3-6 weight rows with all rows at once
(:func:`set_avx512`, ``SPIRE_AVX512=0`` to keep the AVX2 path).

:func:`pack_panels` / :func:`panel_linear` are the panel matmul (cpu_decode.c, "Panel matmul") over a weight
packed once, which the decode path uses by default (spire.backend.Backend.panel_kernel; DecodeBlock takes packed
weights too): AVX2 code on every CPU, rows bit-identical whatever M.

Anything else (no compiler, another CPU, float16, ``SPIRE_KERNELS=0``) returns None and the caller falls
back to torch. Results agree with torch to float32 rounding (different summation order).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from spire.paths import spire_cache_dir

MAX_ROWS = 64
"""Largest M for which :func:`skinny_linear` is used (above it BLAS is compute-efficient)."""

_SOURCE = Path(__file__).with_name("cpu_decode.c")
_LIB: ctypes.CDLL | None = None
_TRIED = False
_ERROR: str | None = None


def _cpu_ok() -> bool:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        return False
    return cap in ("AVX2", "AVX512")


def _build(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc/gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cc, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-o", tmp, str(_SOURCE)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {res.stderr.strip()[:500]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The kernel library (built if needed), or None when unavailable (reason in :func:`unavailable_reason`) and
    while torch.compile traces (a ctypes call is a graph break: the traced graph takes the torch twin)."""
    global _LIB, _TRIED, _ERROR
    if torch.compiler.is_compiling():
        return None
    if _TRIED:
        return _LIB
    _TRIED = True
    if os.environ.get("SPIRE_KERNELS", "1") in ("0", "off", "false", "no"):
        _ERROR = "disabled by SPIRE_KERNELS=0"
        return None
    if not _cpu_ok():
        _ERROR = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2"
        return None
    try:
        digest = hashlib.sha256(_SOURCE.read_bytes() + b"-O3 -mavx2 -mfma -fopenmp").hexdigest()[:16]
        path = spire_cache_dir() / "kernels" / f"cpu_decode-{digest}.so"
        if not path.is_file():
            _build(path)
        lib = ctypes.CDLL(str(path))
        for fn in (lib.spire_skinny_gemm, lib.spire_skinny_gemm_bf16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        for fn in (lib.spire_panel_gemm, lib.spire_panel_gemm_bf16, lib.spire_panel_gemm_i8):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        lib.spire_rms_norm.restype = ctypes.c_int
        lib.spire_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
        for name in ("spire_attn_scores", "spire_attn_pv"):
            getattr(lib, name).restype = ctypes.c_int
        lib.spire_attn_scores.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
            ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_float]
        lib.spire_attn_pv.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
            ctypes.c_void_p] + [ctypes.c_int64] * 5
        P, I = ctypes.c_void_p, ctypes.c_int64
        lib.spire_decode_block.restype = ctypes.c_int
        lib.spire_decode_block.argtypes = ([P, P, I, I, P, I, I, P, P, I, P, P, P, P, ctypes.c_float, P, P, P, P,
                                            ctypes.c_int] + [I] * 5 + [P, P, I, I, I, ctypes.c_float, P])
        lib.spire_block_kv.restype = ctypes.c_int
        lib.spire_block_kv.argtypes = ([P, I, I, P, P, P, P, P, ctypes.c_float, P, ctypes.c_int] + [I] * 4
                                       + [P, P, I, I, I, P])
        lib.spire_set_avx512.restype = ctypes.c_int
        lib.spire_set_avx512.argtypes = [ctypes.c_int]
        lib.spire_scatter_columns.restype = ctypes.c_int
        lib.spire_scatter_columns.argtypes = [P, I, I, P, I, P]
        lib.spire_ring_claim_mask.restype = ctypes.c_int
        lib.spire_ring_claim_mask.argtypes = [P, I, I, P, I, I, I, I, ctypes.c_int, P, P]
        lib.spire_mixed_loss.restype = ctypes.c_int
        lib.spire_mixed_loss.argtypes = [P, P, I, I, ctypes.c_float, P, P, P]
        lib.spire_cross_entropy.restype = ctypes.c_int
        lib.spire_cross_entropy.argtypes = [P, P, I, I, P, P]
        if os.environ.get("SPIRE_AVX512", "1") in ("0", "off", "false", "no"):
            lib.spire_set_avx512(0)
        _LIB = lib
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        _ERROR = str(e)
        _LIB = None
    return _LIB


def unavailable_reason() -> str | None:
    """Why the kernel is not used (None when it is loaded or not tried yet)."""
    return _ERROR


def set_avx512(on: bool) -> bool:
    """Use the AVX-512 few-row matmul path (cpu_decode.c) when the CPU has AVX-512F/BW/VL/DQ (on, the default
    unless ``SPIRE_AVX512=0``) or the AVX2 paths (off). Returns whether the AVX-512 path is now used (False when
    the kernels are unavailable or the CPU lacks AVX-512). For A/B timing and tests."""
    lib = load()
    return bool(lib.spire_set_avx512(int(on))) if lib is not None else False


def available() -> bool:
    return load() is not None


def skinny_linear(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """x: (M, K) float32 CPU with unit inner stride, M ≤ MAX_ROWS; weights: (N_i, K) contiguous CPU tensors,
    all float32 or all bfloat16 -> (M, ΣN_i) float32 = concat of x @ W_iᵀ (bf16 weights are widened exactly,
    arithmetic in float32); None when the kernel does not apply (caller falls back to torch)."""
    M, K = x.shape
    if (M > MAX_ROWS or M == 0 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1
            or len(weights) > 16 or not weights):
        return None
    wdtype = weights[0].dtype
    for w in weights:
        if (w.dtype != wdtype or wdtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu"
                or not w.is_contiguous() or w.shape[1] != K):
            return None
    lib = load()
    if lib is None:
        return None
    gemm = lib.spire_skinny_gemm if wdtype == torch.float32 else lib.spire_skinny_gemm_bf16
    ns = [w.shape[0] for w in weights]
    y = torch.empty(M, sum(ns), dtype=torch.float32)
    ptrs = (ctypes.c_void_p * len(weights))(*[w.data_ptr() for w in weights])
    sizes = (ctypes.c_int64 * len(weights))(*ns)
    gemm(x.data_ptr(), x.stride(0), M, K, len(weights), ptrs, sizes, y.data_ptr(), y.shape[1])
    return y


PANEL_TILE = 32
"""Output columns per tile of a packed weight (``PANEL_TILE`` in cpu_decode.c): four panels of eight."""


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """The (N, K) row-major weight w (float32 or bfloat16, CPU) packed for :func:`panel_linear` and
    :class:`DecodeBlock`: shape (ceil(N / 32), 4, K, 8), element [q, s, k, c] = w[32 q + 8 s + c, k], zero rows
    padding N to a multiple of 32 (cpu_decode.c, "Panel matmul"). Same dtype, a new contiguous tensor."""
    if w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu":
        raise ValueError(f"pack_panels: a 2-D float32 or bfloat16 CPU weight, got {tuple(w.shape)} {w.dtype} "
                         f"on {w.device.type}")
    w = _pad_tiles(w)
    return w.reshape(w.shape[0] // PANEL_TILE, 4, 8, w.shape[1]).transpose(2, 3).contiguous()


def _pad_tiles(w: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (32 ceil(N / 32), K): zero rows appended up to whole 32-column tiles (w itself when none)."""
    N, K = w.shape
    pad = -N % PANEL_TILE
    return torch.cat([w.detach(), w.new_zeros(pad, K)]) if pad else w.detach()


INT8_GROUP = 64
"""Inputs per scale of an int8 weight (``PANEL_KB`` in cpu_decode.c): one float32 scale per output column and
group of 64 consecutive inputs, the groups starting at input 0."""


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise int8 of an (N, K) float32 weight: (values (N, K) int8 in [-127, 127], scales
    (N, ceil(K / 64)) float32) with w ≈ values · scales[:, k // 64], scale = max |w| over the group / 127
    (1 for an all-zero group), values = round(w / scale). The format of :func:`pack_panels_int8`
    (weight-only int8 as in LLM.int8() / GPTQ's grouped scales, here round-to-nearest)."""
    if w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError(f"quantize_int8: a 2-D float32 weight, got {tuple(w.shape)} {w.dtype}")
    N, K = w.shape
    ng = -(-K // INT8_GROUP)
    with torch.no_grad():
        wp = torch.cat([w, w.new_zeros(N, ng * INT8_GROUP - K)], 1) if ng * INT8_GROUP != K else w
        g = wp.reshape(N, ng, INT8_GROUP)
        scale = g.abs().amax(-1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8)
        return q.reshape(N, ng * INT8_GROUP)[:, :K].contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 values and (N, ceil(K / 64)) scales (:func:`quantize_int8`) -> the (N, K) float32 weight."""
    return q.float() * scale.repeat_interleave(INT8_GROUP, 1)[:, : q.shape[1]]


def int8_tile_bytes(K: int) -> int:
    """Bytes of one 32-column tile of :func:`pack_panels_int8` with K (even) inputs: 32·K values, then 32
    float32 scales per group of 64 inputs."""
    return PANEL_TILE * K + 4 * PANEL_TILE * (-(-K // INT8_GROUP))


def pack_panels_int8(w: torch.Tensor) -> torch.Tensor:
    """The (N, K) float32 weight w quantized by :func:`quantize_int8` and packed for :func:`panel_linear` and
    :class:`DecodeBlock`: an int8 tensor (ceil(N / 32), :func:`int8_tile_bytes`(K)); row q holds tile q's
    values, panel s (8 columns) after panel s - 1, each panel the K / 2 input pairs in order, each pair the 8
    columns' two values side by side (element [s, j, c, e] = value[32 q + 8 s + c, 2 j + e]), then the tile's
    float32 scales [group][32 columns] as bytes (cpu_decode.c, "int8 panel matmul"). Zero columns pad N to a
    multiple of 32. Raises ValueError for an odd K (the inputs go in pairs, and the packed shape must pin K)."""
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[1] % 2:
        raise ValueError(f"pack_panels_int8: a 2-D float32 CPU weight with an even number of inputs, got "
                         f"{tuple(w.shape)} {w.dtype} on {w.device.type}")
    K = w.shape[1]
    q, scale = quantize_int8(_pad_tiles(w))
    nt = q.shape[0] // PANEL_TILE
    vals = q.reshape(nt, 4, 8, K // 2, 2).permute(0, 1, 3, 2, 4).reshape(nt, PANEL_TILE * K)
    sc = scale.reshape(nt, PANEL_TILE, -1).transpose(1, 2).contiguous().view(torch.int8).reshape(nt, -1)
    return torch.cat([vals, sc], 1).contiguous()


def _packed_ok(packed: torch.Tensor, n: int, K: int) -> bool:
    nt = -(-n // PANEL_TILE)
    if packed.dtype == torch.int8:
        return K % 2 == 0 and tuple(packed.shape) == (nt, int8_tile_bytes(K))
    return packed.dtype in (torch.float32, torch.bfloat16) and tuple(packed.shape) == (nt, 4, K, 8)


def panel_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor | None:
    """x: (M, K) float32 CPU with unit inner stride, 1 ≤ M ≤ MAX_ROWS; packed: :func:`pack_panels` (float32 or
    bf16) or :func:`pack_panels_int8` of an (n, K) weight W -> (M, n) float32 = x @ Wᵀ (int8: W = values ·
    scales). Each output is summed in the same order whatever M (blocks of 64 k steps), so a row's result is the
    same bit for bit whatever other rows share the call. None when the kernel does not apply (caller falls back
    to torch)."""
    M, K = x.shape
    if (M > MAX_ROWS or M == 0 or K == 0 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1
            or not packed.is_contiguous() or not _packed_ok(packed, n, K)):
        return None
    lib = load()
    if lib is None:
        return None
    gemm = {torch.float32: lib.spire_panel_gemm, torch.bfloat16: lib.spire_panel_gemm_bf16,
            torch.int8: lib.spire_panel_gemm_i8}[packed.dtype]
    y = torch.empty(M, n, dtype=torch.float32)
    if gemm(x.data_ptr(), x.stride(0), M, K, packed.data_ptr(), n, y.data_ptr(), n) != 0:
        return None  # refused (sizes) or out of memory: the caller falls back to torch
    return y


def mixed_loss_rows(z: torch.Tensor, logp: torch.Tensor, omega: float, grad: bool = True
                    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
    """MixedLoss(omega) per row in one native pass (cpu_decode.c, "MixedLoss rows"; the formulas of
    :class:`spire.training.losses._MixedLoss`): draft logits z and the target's log-probabilities logp, both
    (n, N) float32 contiguous CPU -> (grad (n, N) float32: d(omega·distill − (1 − omega)·alpha)/dz of each
    row (None with ``grad=False``: the loss only), distill (n,) float64: −Σ p log q, alpha (n,) float64:
    Σ min(p, q)). None when the kernel does not apply (the caller computes it with torch)."""
    if (z.dim() != 2 or z.shape != logp.shape or z.numel() == 0 or z.dtype != torch.float32
            or logp.dtype != torch.float32 or z.device.type != "cpu" or logp.device.type != "cpu"
            or not z.is_contiguous() or not logp.is_contiguous()):
        return None
    lib = load()
    if lib is None:
        return None
    n, N = z.shape
    g = torch.empty_like(z) if grad else None
    distill, alpha = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    if lib.spire_mixed_loss(z.data_ptr(), logp.data_ptr(), n, N, float(omega), None if g is None else g.data_ptr(),
                            distill.data_ptr(), alpha.data_ptr()):
        return None
    return g, distill, alpha


def cross_entropy_rows(z: torch.Tensor, y: torch.Tensor, grad: bool = True
                       ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """Cross-entropy per row in one native call (cpu_decode.c, "Cross-entropy rows"): logits z (n, N) float32
    contiguous CPU and target columns y (n,) int64 (negative: ignored) -> (grad (n, N) float32: softmax(z) minus
    the one-hot of y, zero on ignored rows; None with ``grad=False``, loss (n,) float64: logsumexp(z) - z[y], 0 on
    ignored rows). None when the kernel does not apply or a column y >= N (the caller computes it with torch, which
    raises)."""
    if (z.dim() != 2 or z.numel() == 0 or z.dtype != torch.float32 or z.device.type != "cpu"
            or not z.is_contiguous() or y.shape != z.shape[:1] or y.dtype != torch.int64 or y.device.type != "cpu"):
        return None
    lib = load()
    if lib is None:
        return None
    y = y.contiguous()
    n, N = z.shape
    g = torch.empty_like(z) if grad else None
    loss = torch.empty(n, dtype=torch.float64)
    rc = lib.spire_cross_entropy(z.data_ptr(), y.data_ptr(), n, N, None if g is None else g.data_ptr(),
                                 loss.data_ptr())
    return None if rc else (g, loss)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x: (..., d) float32 CPU with unit inner stride, weight: (d,) -> x / sqrt(mean(x²) + eps) · weight, a new
    contiguous tensor of x's shape; None when the kernel does not apply (caller falls back to torch)."""
    d = x.shape[-1]
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or weight.device.type != "cpu" or x.stride(-1) != 1 or not weight.is_contiguous() or x.numel() == 0):
        return None
    x2 = x.reshape(-1, d)  # a view when rows are evenly strided
    if x2.stride(-1) != 1:
        return None
    lib = load()
    if lib is None:
        return None
    y = torch.empty(x2.shape, dtype=torch.float32)
    lib.spire_rms_norm(x2.data_ptr(), x2.stride(0), weight.data_ptr(), y.data_ptr(), x2.shape[0], d, eps)
    return y.view(x.shape)


def scatter_columns(src: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor | None:
    """src (..., N) float32 CPU, ids (N,) int64 distinct in [0, V) (not checked here) -> (..., V) float32: -inf
    everywhere, src's columns at ids (``new_full(-inf).index_copy_(-1, ids, src)`` in one pass). None when the
    kernel does not apply."""
    if (src.dtype != torch.float32 or src.device.type != "cpu" or ids.dtype != torch.int64
            or ids.device.type != "cpu" or ids.dim() != 1 or src.shape[-1] != ids.shape[0]):
        return None
    lib = load()
    if lib is None:
        return None
    x = src.reshape(-1, src.shape[-1]).contiguous()
    ids = ids.contiguous()
    out = torch.empty(*src.shape[:-1], V, dtype=torch.float32)
    lib.spire_scatter_columns(x.data_ptr(), x.shape[0], x.shape[1], ids.data_ptr(), V, out.data_ptr())
    return out


def ring_claim_mask(tags: torch.Tensor, pos: torch.Tensor, sink: int, ring: int, window: int, self_attend: bool
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A ring cache's step bookkeeping in one call (cpu_decode.c, spire_ring_claim_mask): tags (B, S) int64
    contiguous CPU, updated in place with the slots of pos (B, T) int64 -> (slots (B, T) int64, mask (B, 1, T, S)
    bool: which slots each query reads under the sink + window rule, without its own key when not
    ``self_attend``), exactly as RingKVCache.claim, attention_mask and spire.kv_cache.self_mask. None when the
    kernel does not apply (the caller runs those)."""
    if (tags.dtype != torch.int64 or pos.dtype != torch.int64 or tags.device.type != "cpu"
            or pos.device.type != "cpu" or not tags.is_contiguous() or pos.dim() != 2 or tags.dim() != 2
            or pos.shape[0] != tags.shape[0]):
        return None
    lib = load()
    if lib is None:
        return None
    B, T = pos.shape
    S = tags.shape[1]
    pos = pos.contiguous()
    slots = torch.empty(B, T, dtype=torch.int64)
    mask = torch.empty(B, 1, T, S, dtype=torch.bool)
    if lib.spire_ring_claim_mask(tags.data_ptr(), B, S, pos.data_ptr(), T, sink, ring, window, int(self_attend),
                                 slots.data_ptr(), mask.data_ptr()) != 0:
        return None
    return slots, mask


MAX_QUERY_ROWS = 64
"""Largest number of query rows per key/value head (query heads per KV head × new tokens) for
:func:`decode_attention`; prefills use torch's SDPA."""


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor | None:
    """softmax(scale · q kᵀ, masked) v for decoding, reading every key / value row once for all query rows.

    q: (B, H, G, D) float32 (G query rows per key/value head); k, v: (B, H, S, D) float32 with unit inner
    stride (e.g. a slice of a preallocated cache); mask: None or bool (B | 1, 1, G, S), True = attend.
    Returns (B, H, G, D) float32, or None when the kernel does not apply (caller falls back to SDPA).
    Rows whose keys are all masked give NaN, as SDPA does."""
    B, H, G, D = q.shape
    S = k.shape[2]
    if (G > MAX_QUERY_ROWS or D % 8 or D > 256 or S == 0 or q.dtype != torch.float32 or q.device.type != "cpu"
            or k.dtype != torch.float32 or v.dtype != torch.float32 or k.stride(-1) != 1 or v.stride(-1) != 1
            or k.shape != (B, H, S, D) or v.shape != (B, H, S, D)):
        return None
    lib = load()
    if lib is None:
        return None
    q = q.contiguous()
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape[-2:] != (G, S) or mask.shape[0] not in (1, B):
            return None
        m8 = mask.view(torch.uint8)
        m_ptr, mb, mg, ms = m8.data_ptr(), (m8.stride(0) if mask.shape[0] == B else 0), m8.stride(2), m8.stride(3)
    else:
        m_ptr, mb, mg, ms = None, 0, 0, 0
    scores = torch.empty(B * H, G, S, dtype=torch.float32)
    lib.spire_attn_scores(q.data_ptr(), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2), m_ptr, mb, mg, ms,
                          scores.data_ptr(), B, H, G, S, D, scale)
    probs = torch.softmax(scores, -1)
    out = torch.empty(B, H, G, D, dtype=torch.float32)
    lib.spire_attn_pv(probs.data_ptr(), v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), out.data_ptr(),
                      B, H, G, S, D)
    return out


BLOCK_MAX_ROWS = 32
"""Largest number of query rows per key/value head (H / KV × T) for :class:`DecodeBlock` (``ATT_MAX_ROWS`` in
cpu_decode.c); its matmuls take up to :data:`MAX_ROWS` rows M = B × T."""


class DecodeBlock:
    """One decoder block's arguments to ``spire_decode_block`` (cpu_decode.c), for M = B × T ≤ :data:`MAX_ROWS`
    new tokens with at most :data:`BLOCK_MAX_ROWS` query rows per key/value head: RMSNorm, fused q/k/v matmul,
    RoPE, the cache write, attention over the dense cache in place (full causal or sink + window, per-row
    positions), o projection, residual, RMSNorm, SwiGLU MLP and residual in one call.

    Args:
        ln1, ln2: (d,) float32 norm weights; eps: their epsilon.
        wqkv: ((H + 2 KV) D, d); wo: (d, H D); wgu: (2 F, d); wdown: (d, F): row-major, all float32 or all
            bfloat16 (float32 arithmetic either way), or all four packed by :func:`pack_panels` (the panel
            matmul: faster at every M on an AVX2 core, and row-count invariant), or all four int8 by
            :func:`pack_panels_int8`.
        k_cache, v_cache: (B, KV, S, D) float32 with unit inner stride (a :class:`spire.kv_cache.KVCache` layer).
        n_heads: H.
        d_ff: F (needed with int8 weights, whose packed shape does not give it).
    The weights are kept alive by the object; the cache is not (so that holding the object does not hold a
    finished generation's cache): it must stay alive, at the same address, while the object is used
    (spire.fastpath.native_block checks the address before every forward). :func:`available` must be True.
    Raises ValueError for shapes or dtypes the kernel does not take (spire.fastpath.decode_step checks
    beforehand).
    """

    __slots__ = ("_args", "_fn", "_kv_fn", "_keep", "d", "H", "KV", "D", "F", "nq", "rope_id")

    def __init__(self, ln1: torch.Tensor, ln2: torch.Tensor, eps: float, wqkv: torch.Tensor, wo: torch.Tensor,
                 wgu: torch.Tensor, wdown: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 n_heads: int, d_ff: int | None = None) -> None:
        lib = load()
        if lib is None:
            raise ValueError(f"spire kernels unavailable: {_ERROR}")
        B, KV, S, D = k_cache.shape
        int8 = wqkv.dtype == torch.int8
        packed = int8 or wqkv.dim() == 4
        d, H = ln1.shape[0], n_heads
        F = d_ff if d_ff is not None else -1 if int8 else wdown.shape[2] if packed else wdown.shape[1]
        bf16 = wqkv.dtype == torch.bfloat16
        ws = (wqkv, wo, wgu, wdown)
        shapes = (((H + 2 * KV) * D, d), (d, H * D), (2 * F, d), (d, F))
        if int8:
            shapes = tuple((-(-n // PANEL_TILE), int8_tile_bytes(k)) for n, k in shapes)
        elif packed:
            shapes = tuple((-(-n // PANEL_TILE), 4, k, 8) for n, k in shapes)
        if (any(w.dtype != wqkv.dtype or not w.is_contiguous() or w.device.type != "cpu" for w in ws)
                or wqkv.dtype not in (torch.float32, torch.bfloat16, torch.int8)
                or tuple(tuple(w.shape) for w in ws) != shapes or H % KV or D % 8 or D > 256
                or k_cache.dtype != torch.float32 or v_cache.shape != k_cache.shape or v_cache.dtype != torch.float32
                or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.device.type != "cpu"
                or ln1.dtype != torch.float32 or ln2.dtype != torch.float32):
            raise ValueError("decode_block: shapes, dtypes or layouts the kernel does not take")
        self.d, self.H, self.KV, self.D, self.F = d, H, KV, D, F
        self.nq = (H + 2 * KV) * D
        self.rope_id = 0  # which of a model's RoPE tables the block reads (spire.fastpath.DecodeStep)
        self._fn, self._kv_fn = lib.spire_decode_block, lib.spire_block_kv
        self._keep = (ln1, ln2, *ws)  # not the cache: a finished generation's cache must be freeable
        sb, sh, ss, _ = k_cache.stride()
        self._args = (ln1.data_ptr(), ln2.data_ptr(), float(eps), wqkv.data_ptr(), wo.data_ptr(), wgu.data_ptr(),
                      wdown.data_ptr(), int(bf16) | (2 if packed else 0) | (4 if int8 else 0), d, H, KV, D, F, k_cache.data_ptr(), v_cache.data_ptr(), sb, sh,
                      ss, D ** -0.5)

    def work_size(self, M: int) -> int:
        """Floats of scratch one call with M rows needs."""
        return M * (2 * self.d + self.nq + self.H * self.D + 2 * self.F)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, sink: int, window: int, cos: torch.Tensor,
                 sin: torch.Tensor, work: torch.Tensor, slots: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (M, d) contiguous float32 residual stream entering the block, M = B × T; pos: (B, T) int64
        contiguous absolute positions (< the cache length: checked by the caller); window 0 = full causal
        attention, else a sink + window view; cos, sin: (M, D) contiguous float32 RoPE tables; work: at least
        :meth:`work_size` float32 scratch. Writes the new keys/values into the cache and returns the (M, d)
        residual stream leaving the block.

        A ring cache (:class:`spire.kv_cache.RingKVCache`) passes ``slots``: (B, T) int64 cache entries that
        receive the new keys/values, and ``mask``: (B, T, S) contiguous uint8 over the S cache entries, nonzero
        where the query may read the entry; the position rule (sink, window) is then not used."""
        B, T = pos.shape
        (ln1, ln2, eps, wqkv, wo, wgu, wdown, bf16, d, H, KV, D, F, kc, vc, sb, sh, ss, scale) = self._args
        out = torch.empty_like(x)
        n_slots = 0 if mask is None else mask.shape[-1]
        rc = self._fn(x.data_ptr(), out.data_ptr(), B, T, pos.data_ptr(), sink, window,
                      None if slots is None else slots.data_ptr(), None if mask is None else mask.data_ptr(), n_slots,
                      cos.data_ptr(), sin.data_ptr(),
                      ln1, ln2, eps, wqkv, wo, wgu, wdown, bf16, d, H, KV, D, F, kc, vc, sb, sh, ss, scale,
                      work.data_ptr())
        if rc != 0:
            raise ValueError(f"spire_decode_block: unsupported sizes (B={B}, T={T}, H={H}, KV={KV}, D={D})")
        return out

    def write_kv(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, work: torch.Tensor,
                 slots: torch.Tensor | None = None) -> None:
        """The block's keys/values of residual-stream vectors (``Block.memory_kv``: the block's input norm, its
        k/v projections, RoPE) into the cache, without attention or MLP: the SPIRe draft's memory.
        x: (M, d) contiguous float32, M = B × T; pos: (B, T) int64 contiguous positions (RoPE); cos, sin: (M, D);
        slots: None (cache entry = position) or (B, T) int64 cache entries; work as for a call."""
        B, T = pos.shape
        (ln1, ln2, eps, wqkv, wo, wgu, wdown, bf16, d, H, KV, D, F, kc, vc, sb, sh, ss, scale) = self._args
        rc = self._kv_fn(x.data_ptr(), B, T, pos.data_ptr(), None if slots is None else slots.data_ptr(),
                         cos.data_ptr(), sin.data_ptr(), ln1, eps, wqkv, bf16, d, H, KV, D, kc, vc, sb, sh, ss,
                         work.data_ptr())
        if rc != 0:
            raise ValueError(f"spire_block_kv: unsupported sizes (H={H}, KV={KV}, D={D})")
