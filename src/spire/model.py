"""spire's own Llama-family transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings.

References: Touvron et al. 2023 (Llama), Su et al. 2021 (RoPE), Ainslie et al. 2023 (GQA), Shazeer 2020
(SwiGLU). Parameter names follow Hugging Face's ``LlamaForCausalLM`` so that any HF Llama-family
safetensors checkpoint loads without renaming (see :mod:`spire.loading`). Logits match HF transformers
to 1e-4 in float32 (tests/test_model.py).

Families (:data:`FAMILIES`; tests/test_families.py checks each against HF): Llama 2/3.x (RoPE scaling
``llama3``, ``linear``, ``yarn``; ``attention_bias``, ``mlp_bias``), Mistral (sliding window), Qwen2/2.5
(q/k/v biases), Qwen3 (q/k RMSNorm), Phi-3 (fused q/k/v and gate/up weights, split at load), SmolLM3 (layers
without RoPE), Gemma 3 text (sliding-window layers with their own RoPE base, q/k norm, norms before and after
attention and MLP, norm weights as offsets from 1, scaled embedding, GeGLU, query_pre_attn_scalar). What a
family changes is a :class:`ModelConfig` field read by a small piece (``Attention.q_norm``, ``Block.sandwich``,
``ScaledEmbedding``, :func:`rope_inv_freq`, ``Transformer._layer_masks``); reading a config.json and refusing,
by name, a feature spire lacks is :mod:`spire.families`' job. The fused native block computes plain Llama blocks only
(:attr:`ModelConfig.plain_blocks`): other families decode through the per-op path below.

Shapes: B batch, T new tokens, S key positions, H query heads, KV key/value heads, D head dim, V vocab.

Inference fast path (no autograd needed: ``torch.no_grad()`` or frozen weights). The same arithmetic with
fewer, better-shaped kernels (docs/bench.md has the measurements):

- on CPU in float32 with a dense :class:`KVCache` and at most KERNEL_MAX_M new tokens (decode steps, verify
  passes, MagicDec draft steps), each decoder block is one native call (:data:`FUSED_BLOCK`,
  :class:`spire.kernels.DecodeBlock`) doing everything below for that block (the SPIRe draft's step over its
  ring cache uses the same call through :func:`fused_block`); otherwise (prefills, other devices and dtypes,
  autograd) the block runs as the torch ops below:
- q/k/v and gate/up projections run as one matmul each over weights concatenated along the output dimension;
- on CPU in float32 the matmul follows the number of rows M = B·T: M = 1 multiplies by a transposed
  (in, out) copy of the weights (a GEMV MKL streams faster than ``F.linear``'s), 2 ≤ M ≤ 32 uses spire's
  skinny-matmul kernel (:mod:`spire.kernels`, one pass over each weight for all rows; MKL re-packs the
  weight on every call), larger M ``F.linear`` on the fused weights; other devices and dtypes ``F.linear``
  on the fused weights;
- RoPE is applied to q and k in one op set; the cache is written by slice when every row writes the same
  contiguous positions; the attention mask is dropped when nothing is masked; a sink + window view
  (MagicDec) gathers only its sink + window (+ T - 1) entries, so its cost does not grow with the context;
- logits are computed lazily (:class:`ForwardOutput`), so a prefill whose logits nobody reads skips the
  unembedding.

The fused / transposed weight copies are built on first use and rebuilt whenever a source parameter changes
(data pointer, version counter, dtype, device), so training in place stays correct; they are not buffers
(never saved) and a deepcopy starts without them. They cost up to one extra copy of the weights in memory.
With autograd active on trainable weights every layer runs the plain reference path.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from spire.errors import ConfigError
from spire.families import ACTIVATION_NAMES, FAMILIES, hf_fields  # noqa: F401 (FAMILIES: part of this API)
from spire.kv_cache import KVCache, SinkWindow, attention_mask


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder (read from an HF ``config.json`` by :meth:`from_hf`).

    The fields after ``eos_ids`` describe how a family departs from Llama (their defaults are Llama's):
    biases on the q/k/v, o and MLP projections (Qwen2: q/k/v; Llama ``attention_bias``: q/k/v/o), RMSNorm
    over each query and key head before RoPE (``qk_norm``: Qwen3, Gemma 3), norms after attention and MLP as
    well as before (``sandwich_norm``: Gemma 3), norm weights stored as an offset from 1 (``norm_offset`` 1:
    Gemma), a scaled embedding (``embed_scale``: Gemma's sqrt(d_model)), the MLP activation (``act``), the
    attention scale (``attn_scale``, default d_head^-1/2; Gemma 3: query_pre_attn_scalar^-1/2), and per layer
    the RoPE variant (``layer_ropes``: Llama 3.x / linear / YaRN scaling, Gemma 3's local and global bases,
    SmolLM3's layers without RoPE) and the sliding window (``layer_windows``: Mistral, Phi-3, Gemma 3's local
    layers). None means every layer is the same (default RoPE with ``rope_theta``; full attention).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_positions: int = 2048
    tie_embeddings: bool = True
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    family: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    act: str = "silu"
    attn_scale: float | None = None
    layer_ropes: list[dict] | None = None
    layer_windows: list[int | None] | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from an HF config.json dict (best: as transformers normalizes it, ``AutoConfig.to_dict()``,
        which :func:`spire.loading.load_target` passes; :func:`spire.families.hf_fields` reads it). Raises
        CheckpointError for an unsupported architecture or a configuration feature spire does not implement,
        naming it."""
        return cls(**hf_fields(cfg))

    def to_dict(self) -> dict:
        return asdict(self)

    def rope_of(self, layer: int) -> dict:
        """The RoPE spec of ``layer`` (see :func:`rope_inv_freq`)."""
        if self.layer_ropes is None:
            return {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        return self.layer_ropes[layer]

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys j > p - window for a query at p), None for full attention."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    def without_layers(self, n_layers: int) -> "ModelConfig":
        """The same architecture with ``n_layers`` layers (a shallower model, e.g. a vanilla draft): per-layer
        RoPE and windows follow the source's pattern from its first layer on (repeated when deeper)."""
        from dataclasses import replace

        def cut(xs: list | None) -> list | None:
            return None if xs is None else [xs[i % len(xs)] for i in range(n_layers)]

        return replace(self, n_layers=n_layers, layer_ropes=cut(self.layer_ropes), layer_windows=cut(self.layer_windows))

    @property
    def plain_blocks(self) -> bool:
        """Whether every block is a plain Llama block (what :class:`spire.kernels.DecodeBlock` computes): no
        biases, no q/k norms, pre-norms only with weights used as stored, SiLU, the default attention scale."""
        return not (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm or self.sandwich_norm
                    or self.norm_offset or self.act != "silu" or self.attn_scale is not None)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (weight + offset), computed in float32 (as HF Llama does; Gemma stores
    its norm weights as an offset from 1: ``offset`` 1)."""

    def __init__(self, d: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.offset = float(offset)

    def scale(self) -> torch.Tensor:
        """The (d,) factor applied after normalizing: weight + offset."""
        return self.weight + self.offset if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.scale()
        if (x.device.type == "cpu" and x.dtype == torch.float32 and RMSNORM_KERNEL
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            from spire import kernels

            y = kernels.rms_norm(x, w, self.eps)
            if y is not None:
                return y
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x.to(dtype)


RMSNORM_KERNEL = True
"""On CPU in float32 inference, RMSNorm is one call of :func:`spire.kernels.rms_norm` (~7 small torch ops)."""


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu_pytorch_tanh": _gelu_tanh}
"""HF ``hidden_act`` names -> the gated MLP's activation: SwiGLU (Llama, Qwen, Mistral, Phi-3, SmolLM3) and
GeGLU with the tanh approximation (Gemma 3)."""
assert set(ACTIVATIONS) == set(ACTIVATION_NAMES)


class ScaledEmbedding(nn.Embedding):
    """Token embedding times ``scale`` (Gemma multiplies by sqrt(d_model); 1 elsewhere). (B, T) -> (B, T, d)."""

    def __init__(self, vocab_size: int, d_model: int, scale: float = 1.0) -> None:
        super().__init__(vocab_size, d_model)
        self.scale = float(scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = super().forward(tokens)
        if self.scale != 1.0:  # as HF: the scale rounded to the weights' dtype, then one multiply
            x = x * torch.tensor(self.scale, dtype=torch.float32).to(x.dtype)
        return x


_INV_FREQ: dict[tuple, tuple[torch.Tensor, float]] = {}


def _default_inv_freq(d_head: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, d_head, 2, device=device, dtype=torch.int64).float() / d_head))


def rope_inv_freq(spec: dict, d_head: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies (D/2,) float32 and the factor applied to cos and sin, for one RoPE spec
    (:meth:`ModelConfig.rope_of`): "default" theta^(-2i/D) (Su et al. 2021); "linear" divided by ``factor``
    (position interpolation, Chen et al. 2023); "llama3" (Meta's Llama 3.1 low/high-frequency interpolation);
    "yarn" (Peng et al. 2023, with its attention factor). The same formulas as transformers'
    ``modeling_rope_utils`` (so that logits match HF's). Cached per (spec, D, device)."""
    key = (tuple(sorted(spec.items())), d_head, str(device))
    hit = _INV_FREQ.get(key)
    if hit is not None:
        return hit
    kind, theta = spec["rope_type"], spec.get("rope_theta", 10000.0)
    inv = _default_inv_freq(d_head, theta, device)
    scale = 1.0
    if kind == "linear":
        inv = inv / spec["factor"]
    elif kind == "llama3":
        factor, lo, hi = spec["factor"], spec["low_freq_factor"], spec["high_freq_factor"]
        old = spec["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        factor, orig = spec["factor"], spec["original_max_position_embeddings"]

        def correction_dim(rotations: float) -> float:
            return (d_head * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(spec["beta_fast"]), correction_dim(spec["beta_slow"])
        if spec["truncate"]:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d_head - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d_head // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
        pos_freqs = theta ** (torch.arange(0, d_head, 2, device=device).float() / d_head)
        extrapolation = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        scale = spec["attention_factor"]
    elif kind != "default":
        raise ConfigError(f"unknown RoPE type {kind!r}")
    _INV_FREQ[key] = (inv, scale)
    return inv, scale


def rope_cos_sin(pos: torch.Tensor, d_head: int, theta: float | dict, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for absolute positions. pos: (B, T) -> cos, sin: (B, 1, T, D) (half-split layout, as HF).
    ``theta``: a base (default RoPE) or a RoPE spec (:func:`rope_inv_freq`); {"rope_type": "none"} gives
    cos 1, sin 0 (no rotation, exactly)."""
    spec = {"rope_type": "default", "rope_theta": float(theta)} if not isinstance(theta, dict) else theta
    B, T = pos.shape
    if spec["rope_type"] == "none":
        return (torch.ones(B, 1, T, d_head, dtype=dtype, device=pos.device),
                torch.zeros(B, 1, T, d_head, dtype=dtype, device=pos.device))
    inv_freq, scale = rope_inv_freq(spec, d_head, pos.device)
    freqs = pos.float()[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, D)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rope_tables(pos: torch.Tensor, ropes: Sequence[dict], d_head: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables of every distinct RoPE of a model (:attr:`Transformer.ropes`), stacked: pos (B, T) ->
    cos, sin: (R, B, 1, T, D); block i reads index ``Block.rope_id``."""
    tables = [rope_cos_sin(pos, d_head, spec, dtype) for spec in ropes]
    if len(tables) == 1:  # one RoPE for every layer (most families): a view, no copy
        return tables[0][0][None], tables[0][1][None]
    return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, D) rotated by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ---------------------------------------------------------------------------------------- inference fast path

KERNEL_MAX_M = 32
"""On CPU in float32, matmuls with 2 ≤ M ≤ KERNEL_MAX_M rows use :func:`spire.kernels.skinny_linear` when it
is available (one pass over each weight for all rows, no weight copy); more rows use F.linear (BLAS)."""

TRANSPOSED_GEMV = True
"""On CPU in float32, M = 1 multiplies by a transposed (in, out) copy of the weights: MKL streams that GEMV
about 1.2-1.4x faster than F.linear's (one extra copy of the weights in memory)."""


FUSED_BLOCK = True
"""On CPU in float32 with a dense :class:`KVCache`, a forward of at most KERNEL_MAX_M new tokens (a decode step,
a verify pass, a MagicDec draft step) runs each decoder block as one call of
:class:`spire.kernels.DecodeBlock` (norms, fused matmuls, RoPE, cache write, attention over the cache in
place with per-row positions and an optional sink + window view, MLP, residuals): the same arithmetic without
the ~40 torch ops per block and their dispatch. The SPIRe draft's step (ring cache) uses it too
(spire.drafts.spire). Prefills and other caches take the per-op path below. Set False to compare."""

ATTENTION_KERNEL = True
ATTENTION_KERNEL_ROWS = 4
"""On CPU in float32, attention with at most ATTENTION_KERNEL_ROWS query rows per key/value head (a decode
step: the query heads sharing a KV head) uses :func:`spire.kernels.decode_attention` (each key and value row
read once for all of them); verify passes and prefills use torch's SDPA."""


class WeightCache:
    """Inference copies of one or more ``nn.Linear`` weights: concatenated along the output dimension, in
    (out, in) layout ("N") and/or transposed to a contiguous (in, out) layout ("T").

    A copy is rebuilt whenever a source parameter changes: its key holds each weight's data pointer,
    version counter (bumped by every in-place update, e.g. an optimizer step or ``load_state_dict``), dtype
    and device. Not an ``nn.Module`` buffer, so never saved; ``copy.deepcopy`` gives an empty cache.
    """

    def __init__(self, weight_dtype: torch.dtype | None = None) -> None:
        self._store: dict[str, tuple[tuple, torch.Tensor]] = {}
        self.weight_dtype = weight_dtype  # torch.bfloat16: weight-only bf16 (see use_bf16_weights)

    def __deepcopy__(self, memo) -> "WeightCache":
        return WeightCache(self.weight_dtype)

    def clear(self) -> None:
        self._store.clear()

    def get(self, linears: Sequence[nn.Linear], layout: str) -> torch.Tensor:
        """The (out_total, in) ("N"), (in, out_total) ("T") or bf16 (out_total, in) ("B") weight of
        ``linears`` concatenated."""
        ws = [lin.weight for lin in linears]
        if layout == "N" and len(ws) == 1:
            return ws[0]
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
        hit = self._store.get(layout)
        if hit is not None and hit[0] == key:
            return hit[1]
        self._store.pop(layout, None)  # free the stale copy before building the new one
        with torch.no_grad():
            w = ws[0].detach() if len(ws) == 1 else torch.cat([w.detach() for w in ws])
            w = (w.t().contiguous() if layout == "T" else w.to(torch.bfloat16).contiguous() if layout == "B"
                 else w.contiguous())
        self._store[layout] = (key, w)
        return w

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
        self._store["bias"] = (key, b)
        return b


def _needs_autograd(linears: Sequence[nn.Linear], x: torch.Tensor | None = None) -> bool:
    """Whether autograd must see this computation: grad mode on and a weight (or the input) requires grad.
    The fast path (native kernels, cached weight copies) is taken only when it need not."""
    return torch.is_grad_enabled() and (any(lin.weight.requires_grad for lin in linears)
                                        or (x is not None and x.requires_grad))


def fast_linear(x: torch.Tensor, linears: Sequence[nn.Linear], cache: WeightCache) -> torch.Tensor:
    """x: (..., in) -> (..., sum of out) = concat of ``lin(x)`` over ``linears`` (biases added), for inference.

    The layout is picked by the row count M = x.numel() / in (module docstring). Mathematically the same
    product as ``F.linear``; the float32 summation order may differ (differences ~1e-7 relative).
    """
    lead, d_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d_in)
    M = x2.shape[0]
    y = None
    if x.device.type == "cpu" and x2.dtype == torch.float32:
        if cache.weight_dtype == torch.bfloat16 and M <= KERNEL_MAX_M:
            from spire import kernels

            y = kernels.skinny_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), [cache.get(linears, "B")])
        elif M == 1 and TRANSPOSED_GEMV:
            y = x2 @ cache.get(linears, "T")
        elif M <= KERNEL_MAX_M:
            from spire import kernels

            y = kernels.skinny_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), [lin.weight for lin in linears])
    b = cache.bias(linears)
    if y is None:
        y = F.linear(x2, cache.get(linears, "N"), b)
    elif b is not None:
        y = y + b
    return y.reshape(*lead, y.shape[-1])


def use_bf16_weights(*modules: nn.Module | None) -> int:
    """Weight-only bf16 for float32 CPU inference: round every ``nn.Linear`` and ``nn.Embedding`` weight of
    the ``modules`` (targets or drafts; None entries are skipped) to the nearest bf16 value, in place, and let decoding matmuls (M ≤
    KERNEL_MAX_M rows) stream a bf16 copy through :mod:`spire.kernels` -- half the weight bytes of float32,
    float32 activations and arithmetic. Larger matmuls (prefill) use the float32 weights, which now hold the
    same bf16 values, so every path computes the same model. The rounding is irreversible (reload the
    checkpoint for the float32 model); norms and caches stay float32. Without the kernels (no AVX2 or C
    compiler, SPIRE_KERNELS=0) the model is still rounded and runs through torch at float32 speed.

    Returns the number of weight tensors rounded. Raises ConfigError on a non-float32 or non-CPU module.
    """
    subs = [m for module in modules if module is not None for m in module.modules()]
    params = {id(m.weight): m.weight for m in subs if isinstance(m, (nn.Linear, nn.Embedding))}
    for w in params.values():
        if w.dtype != torch.float32 or w.device.type != "cpu":
            raise ConfigError(f"bf16 weights need a float32 model on the CPU, got {w.dtype} on {w.device.type}")
    with torch.no_grad():
        for w in params.values():
            w.copy_(w.to(torch.bfloat16).float())
    for m in subs:
        for wc in [*getattr(m, "_wc", {}).values(), getattr(m, "_head_wc", None)]:
            if isinstance(wc, WeightCache):
                wc.weight_dtype = torch.bfloat16
                wc.clear()
    return len(params)


def _rope_qk(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope over a (B, heads, T, D) stack of query and key heads at once (same arithmetic)."""
    half = y.shape[-1] // 2
    return y * cos + torch.cat((-y[..., half:], y[..., :half]), -1) * sin


class Attention(nn.Module):
    """Grouped-query attention with RoPE: H query heads share KV key/value heads (head h reads KV head
    h // (H / KV)). Family options (:class:`ModelConfig`): q/k/v and o biases, per-head q/k RMSNorm before RoPE,
    the attention scale."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.d_head, cfg.d_model, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each query / key head (D), before RoPE
            self.q_norm = RMSNorm(cfg.d_head, cfg.rms_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.d_head, cfg.rms_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.d_head ** -0.5 if cfg.attn_scale is None else float(cfg.attn_scale)
        self._wc = {"qkv": WeightCache(), "o": WeightCache(), "kv": WeightCache()}

    def fast(self, h: torch.Tensor | None = None) -> bool:
        """Whether the inference fast path applies (no autograd through these weights or the input h)."""
        return not _needs_autograd((self.q_proj, self.k_proj, self.v_proj, self.o_proj), h)

    def project_qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inference: ``project_q`` and ``project_kv`` in one fused matmul. h: (B, T, d_model) normed input ->
        rotated q (B, H, T, D), rotated k and v (B, KV, T, D)."""
        B, T, _ = h.shape
        H, KV = self.n_heads, self.n_kv
        y = fast_linear(h, (self.q_proj, self.k_proj, self.v_proj), self._wc["qkv"])
        y = y.view(B, T, H + 2 * KV, self.d_head)
        if self.qk_norm:
            y = torch.cat([self.q_norm(y[:, :, :H]), self.k_norm(y[:, :, H:H + KV]), y[:, :, H + KV:]], 2)
        y = y.transpose(1, 2)  # (B, H + 2 KV, T, D)
        qk = _rope_qk(y[:, : H + KV], cos, sin)
        return qk[:, :H], qk[:, H:], y[:, H + KV:]

    def attend_fast(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                    ) -> torch.Tensor:
        """Inference ``attend``; mask may be None (nothing masked). Query heads are grouped per KV head
        (H = KV·g, head h reads KV head h // g, as HF's repeat_kv) so no K/V copy is made for GQA."""
        B, H, T, D = q.shape
        KV = k.shape[1]
        g = H // KV
        if g > 1:
            q = q.reshape(B, KV, g * T, D)
            if mask is not None:
                mask = mask.expand(mask.shape[0], 1, T, mask.shape[-1]).repeat(1, 1, g, 1)
        y = None
        if ATTENTION_KERNEL and q.device.type == "cpu" and q.dtype == torch.float32 and g * T <= ATTENTION_KERNEL_ROWS:
            from spire import kernels

            y = kernels.decode_attention(q, k, v, mask, self.scale)
        if y is None:
            y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=self.scale)
        y = y.view(B, H, T, D).transpose(1, 2).reshape(B * T, H * D)
        return fast_linear(y, (self.o_proj,), self._wc["o"]).view(B, T, -1)

    def _heads(self, y: torch.Tensor, n: int, norm: RMSNorm | None = None) -> torch.Tensor:
        B, T, _ = y.shape
        y = y.view(B, T, n, self.d_head)
        if norm is not None:
            y = norm(y)
        return y.transpose(1, 2)  # (B, n, T, D)

    def project_q(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h: (B, T, d_model) normed input -> rotated queries (B, H, T, D)."""
        return apply_rope(self._heads(self.q_proj(h), self.n_heads, self.q_norm if self.qk_norm else None), cos, sin)

    def project_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (B, T, d_model) normed input -> rotated keys, values (B, KV, T, D)."""
        if _needs_autograd((self.k_proj, self.v_proj), h):
            k, v = self.k_proj(h), self.v_proj(h)
        else:  # inference (SPIRe's memory keys/values): one fused matmul on the fast path
            k, v = fast_linear(h, (self.k_proj, self.v_proj), self._wc["kv"]).split(self.n_kv * self.d_head, -1)
        k = self._heads(k, self.n_kv, self.k_norm if self.qk_norm else None)
        return apply_rope(k, cos, sin), self._heads(v, self.n_kv)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: (B, H, T, D); k, v: (B, KV, S, D); mask: (B|1, 1, T, S) bool -> (B, T, d_model)."""
        y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           enable_gqa=self.n_heads != self.n_kv, scale=self.scale)
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.d_head))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act SiLU (SwiGLU, Shazeer 2020) or tanh-GELU (GeGLU, Gemma)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)
        self.act_name = cfg.act
        self._wc = {"gu": WeightCache(), "down": WeightCache()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ACTIVATIONS[self.act_name]
        if _needs_autograd((self.gate_proj, self.up_proj, self.down_proj), x):
            return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
        gu = fast_linear(x, (self.gate_proj, self.up_proj), self._wc["gu"])
        d_ff = self.gate_proj.out_features
        return fast_linear(act(gu[..., :d_ff]) * gu[..., d_ff:], (self.down_proj,), self._wc["down"])


# A KV source: given this block's new keys/values (B, KV, T, D), return the keys/values to attend over
# (B, KV, S, D). The dense cache writes then reads; the SPIRe draft prepends its memory.
KVSource = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)). With ``sandwich_norm`` (Gemma 3) the
    attention and MLP outputs are normed too: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))); the norm
    before the MLP is then ``pre_feedforward_layernorm`` and ``post_attention_layernorm`` norms the attention
    output (HF's names). ``rope_id`` picks this block's RoPE tables (:func:`rope_tables`)."""

    def __init__(self, cfg: ModelConfig, rope_id: int = 0) -> None:
        super().__init__()
        off = cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps, off)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps, off)
        self.sandwich = cfg.sandwich_norm
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps, off)
            self.post_feedforward_layernorm = RMSNorm(cfg.d_model, cfg.rms_eps, off)
        self.mlp = MLP(cfg)
        self.rope_id = rope_id

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_source: KVSource,
                mask: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d_model) residual stream entering the block -> leaving it. cos, sin: (R, B, 1, T, D) RoPE
        tables (:func:`rope_tables`), or this block's own (B, 1, T, D) ones. mask: (B|1, 1, T, S) bool, or None when no key is masked (inference fast
        path only)."""
        cos, sin = self._tables(cos, sin)
        h = self.input_layernorm(x)
        attn = self.self_attn
        if attn.fast(h):
            q, k, v = attn.project_qkv(h, cos, sin)
            k, v = kv_source(k, v)
            a = attn.attend_fast(q, k, v, mask)
        else:
            q = attn.project_q(h, cos, sin)
            k, v = kv_source(*attn.project_kv(h, cos, sin))
            if mask is None:
                mask = torch.ones(1, 1, q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
            a = attn.attend(q, k, v, mask)
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))

    def memory_kv(self, m: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values (B, KV, T, D) this block derives from residual-stream vectors m: (B, T, d_model);
        cos, sin as for :meth:`forward`."""
        return self.self_attn.project_kv(self.input_layernorm(m), *self._tables(cos, sin))

    def _tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This block's (B, 1, T, D) RoPE tables out of a model's stacked (R, B, 1, T, D) ones."""
        return (cos[self.rope_id], sin[self.rope_id]) if cos.dim() == 5 else (cos, sin)


def fused_block_applies(cfg: ModelConfig, x: torch.Tensor, bt: tuple[int, int], k_cache: torch.Tensor) -> bool:
    """Whether :class:`spire.kernels.DecodeBlock` takes B × T = ``bt`` new tokens of a model shaped by ``cfg``
    over a cache layer like ``k_cache`` (:data:`FUSED_BLOCK` on, plain Llama blocks (:attr:`ModelConfig.plain_blocks`:
    a family with biases, q/k norms or Gemma's norms runs per op), float32 on the CPU, few rows, kernels built).
    Autograd and sliding windows are the caller's checks (the kernel computes no gradients)."""
    from spire import kernels

    B, T = bt
    if (not FUSED_BLOCK or not cfg.plain_blocks or x.device.type != "cpu" or x.dtype != torch.float32
            or B * T > min(KERNEL_MAX_M, kernels.MAX_ROWS) or cfg.d_head % 8 or cfg.d_head > 256
            or cfg.n_heads % cfg.n_kv_heads or cfg.n_heads // cfg.n_kv_heads * T > kernels.BLOCK_MAX_ROWS
            or k_cache.dtype != torch.float32 or k_cache.device.type != "cpu" or k_cache.stride(-1) != 1):
        return False
    return kernels.available()


def fused_block(block: "Block", k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, store: dict, i: int):
    """The :class:`spire.kernels.DecodeBlock` of ``block`` over one cache layer, kept in ``store[i]`` and
    rebuilt when a weight copy or the cache storage changes (the kernel reads parameters in place, so
    in-place updates are seen). Weights: the block's fused float32 copies, or its bf16 copies after
    :func:`use_bf16_weights`."""
    from spire import kernels

    attn, mlp = block.self_attn, block.mlp
    layout = "B" if attn._wc["qkv"].weight_dtype == torch.bfloat16 else "N"
    ws = (attn._wc["qkv"].get((attn.q_proj, attn.k_proj, attn.v_proj), layout),
          attn._wc["o"].get((attn.o_proj,), layout), mlp._wc["gu"].get((mlp.gate_proj, mlp.up_proj), layout),
          mlp._wc["down"].get((mlp.down_proj,), layout))
    ln1, ln2 = block.input_layernorm.weight, block.post_attention_layernorm.weight
    key = (*(w.data_ptr() for w in ws), ln1.data_ptr(), ln2.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
           tuple(k_cache.shape), k_cache.stride(), v_cache.stride())
    hit = store.get(i)
    if hit is not None and hit[0] == key:
        return hit[1]
    fb = kernels.DecodeBlock(ln1.detach(), ln2.detach(), block.input_layernorm.eps, *(w.detach() for w in ws),
                             k_cache, v_cache, n_heads)
    fb.rope_id = block.rope_id
    store[i] = (key, fb)
    return fb


class FusedStep:
    """What every :class:`spire.kernels.DecodeBlock` call of one forward shares, prepared once: positions
    (B, T) int64, RoPE tables (R, B·T, D) (from :func:`rope_tables`' (R, B, 1, T, D); each block reads its
    ``rope_id``), the scratch buffer, and, for a ring cache, the slots to write.
    :meth:`run` passes a residual stream through blocks; :meth:`write_kv` writes blocks' memory keys/values."""

    def __init__(self, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor | None = None
                 ) -> None:
        B, T = pos.shape
        self.B, self.T = B, T
        self.pos = pos.to(torch.int64).contiguous()
        R = cos.shape[0] if cos.dim() == 5 else 1
        self.cos, self.sin = cos.reshape(R, B * T, -1).contiguous(), sin.reshape(R, B * T, -1).contiguous()
        self.slots = None if slots is None else slots.contiguous()
        self._work: torch.Tensor | None = None

    def _scratch(self, fb) -> torch.Tensor:
        if self._work is None:  # every block of a model has the same sizes: one buffer for the whole forward
            self._work = torch.empty(fb.work_size(self.B * self.T), dtype=torch.float32)
        return self._work

    def block(self, fb, h: torch.Tensor, k_start: torch.Tensor | None = None, view: SinkWindow | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """h: (B·T, d) residual stream entering the block of ``fb`` -> leaving it."""
        sink, window = (0, 0) if view is None else (view.sink, view.window)
        r = fb.rope_id
        return fb(h, self.pos, k_start, sink, window, self.cos[r], self.sin[r], self._scratch(fb), slots=self.slots,
                  mask=mask)

    def write_kv(self, fb, m: torch.Tensor) -> None:
        """The memory keys/values of vectors m: (B, T, d) through the block of ``fb`` into its cache."""
        r = fb.rope_id
        fb.write_kv(m.reshape(self.B * self.T, -1).contiguous(), self.pos, self.cos[r], self.sin[r],
                    self._scratch(fb), self.slots)


class FusedBlocks(dict):
    """Layer -> (key, :class:`spire.kernels.DecodeBlock`) (see :func:`fused_block`). The blocks hold raw
    addresses of a model's weights and cache, so a deepcopy (or pickle) of the model starts without them."""

    def __deepcopy__(self, memo) -> "FusedBlocks":
        return FusedBlocks()

    def __reduce__(self):
        return (FusedBlocks, ())


class ForwardOutput:
    """logits: (B, T, V) float32; hidden: target layer index -> (B, T, d_model) residual stream entering it.

    ``ForwardOutput(logits, hidden)`` holds given logits. :meth:`Transformer.forward` instead passes
    ``compute_logits`` and the logits are computed on first access of ``.logits`` (then kept), so a forward
    whose logits nobody reads (a prefill) skips the unembedding (V·d_model multiply-adds per position).
    """

    __slots__ = ("_logits", "_compute", "hidden")

    def __init__(self, logits: torch.Tensor | None = None, hidden: dict[int, torch.Tensor] | None = None,
                 compute_logits: Callable[[], torch.Tensor] | None = None) -> None:
        if logits is None and compute_logits is None:
            raise ValueError("ForwardOutput needs logits or compute_logits")
        self._logits, self._compute = logits, compute_logits
        self.hidden = {} if hidden is None else hidden

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits, self._compute = self._compute(), None
        return self._logits

    @logits.setter
    def logits(self, value: torch.Tensor) -> None:
        self._logits, self._compute = value, None

    def __repr__(self) -> str:
        state = tuple(self._logits.shape) if self._logits is not None else "lazy"
        return f"ForwardOutput(logits={state}, hidden={sorted(self.hidden)})"


class Transformer(nn.Module):
    """A Llama-family causal LM with an optional KV cache.

    ``forward(tokens, pos, cache, view, hidden_layers)``:
        tokens, pos: (B, T) token ids and absolute positions (positions start at 0 per row).
        cache: a :class:`KVCache` to write the new keys/values into and read the past from; None attends
            among the T tokens only (training, reference computations).
        view: None (full history) or a :class:`SinkWindow` (StreamingLLM view, used by MagicDec). A
            sliding-window layer (:meth:`ModelConfig.window_of`) reads the intersection of the view and its
            window.
        hidden_layers: layer indices whose *input* residual stream to return (SPIRe's memory source);
            index n_layers is the final residual stream (before the final norm).
    Each layer reads its own RoPE tables (:attr:`ropes`, ``Block.rope_id``).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.d_model, cfg.embed_scale)
        specs = [cfg.rope_of(i) for i in range(cfg.n_layers)]
        self.ropes: list[dict] = []  # the distinct RoPE specs of the layers; Block.rope_id indexes it
        for spec in specs:
            if spec not in self.ropes:
                self.ropes.append(spec)
        self.model.layers = nn.ModuleList(Block(cfg, self.ropes.index(spec)) for spec in specs)
        self.model.norm = RMSNorm(cfg.d_model, cfg.rms_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._head_wc = WeightCache()
        self._fused = FusedBlocks()  # layer -> (key, spire.kernels.DecodeBlock), see fused_block

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty dense cache for every layer. Raises ConfigError past the model's positions."""
        if max_len > self.cfg.max_positions:
            raise ConfigError(f"context of {max_len} tokens exceeds the target's {self.cfg.max_positions} positions")
        return KVCache(self.cfg.n_layers, batch_size, self.cfg.n_kv_heads, max_len, self.cfg.d_head,
                       dtype=self.dtype, device=self.device)

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables of every distinct RoPE of the layers: pos (B, T) -> cos, sin (R, B, 1, T, D)."""
        return rope_tables(pos, self.ropes, self.cfg.d_head, dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + unembedding: (B, T, d_model) -> float32 logits (B, T, V)."""
        return self.unembed(self.model.norm(x))

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """Normed (B, T, d_model) -> float32 logits (B, T, V) through lm_head: the inference fast path and its
        cached head copies unless autograd must see it (a SPIRe draft shares them through this method)."""
        if _needs_autograd((self.lm_head,), h):
            return self.lm_head(h).float()
        return fast_linear(h, (self.lm_head,), self._head_wc).float()

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None,
                view: SinkWindow | None = None, hidden_layers: Iterable[int] = (),
                k_start: torch.Tensor | None = None) -> ForwardOutput:
        """See the class docstring. Raises ConfigError when a position is beyond the cache's length.
        Logits are computed lazily (:class:`ForwardOutput`)."""
        want = set(hidden_layers)
        x = self.model.embed_tokens(tokens)  # (B, T, d_model)
        cos, sin = self.rope(pos, x.dtype)
        if self._fused_applies(x, cache, pos):
            views = self._fused_views(pos, view)
            if views is not None:
                return self._forward_fused(x, pos, cos, sin, cache, views, want, k_start)
        windows = self.cfg.layer_windows or [None] * len(self.layers)
        if cache is None:
            mask = attention_mask(pos, pos, view, k_start)  # keys are the T tokens themselves
            sources = [lambda k, v: (k, v)] * len(self.layers)
            masks = self._layer_masks(mask, pos, windows)
        else:
            masks, sources = _CacheAccess(cache, pos, view, k_start).plan(windows)
        hidden: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.layers):
            if i in want:
                hidden[i] = x
            x = block(x, cos, sin, sources[i], masks[i])
        if len(self.layers) in want:  # the final residual stream, before the final norm
            hidden[len(self.layers)] = x
        return self._output(x, hidden)

    @staticmethod
    def _layer_masks(mask: torch.Tensor, pos: torch.Tensor, windows: Sequence[int | None]) -> list[torch.Tensor]:
        """Each layer's mask over the T tokens themselves (no cache): ``mask`` (B|1, 1, T, T), narrowed for a
        sliding-window layer (window W: keys j > p - W for a query at p, HF's sliding_window)."""
        narrowed = {w: mask & (pos[:, None, None, :] > pos[:, None, :, None] - w) for w in set(windows) - {None}}
        return [mask if w is None else narrowed[w] for w in windows]

    def _fused_views(self, pos: torch.Tensor, view: SinkWindow | None) -> list[SinkWindow | None] | None:
        """Per layer, the (sink, window) rule the native block applies: the forward's view, or for a sliding
        layer whose window is reached the window alone (sink 0) -- exact when there is no view or the layer's
        window is within the view's. None when a layer's rule is not one (sink, window) pair (a view with a
        smaller window than the layer's, past the layer's window): the forward then runs per op."""
        windows = self.cfg.layer_windows
        if windows is None:
            return [view] * len(self.layers)
        hi = int(pos.max())
        views: list[SinkWindow | None] = []
        for w in windows:
            if w is None or hi < w:
                views.append(view)
            elif view is None or w <= view.window:
                views.append(SinkWindow(0, w))
            else:
                return None
        return views

    def _output(self, x: torch.Tensor, hidden: dict[int, torch.Tensor]) -> ForwardOutput:
        """The forward's result with lazy logits of the final residual stream x."""
        grad = torch.is_grad_enabled()  # the lazy logits see the autograd mode of this call

        def compute_logits() -> torch.Tensor:
            with torch.set_grad_enabled(grad):
                return self.logits(x)

        return ForwardOutput(hidden=hidden, compute_logits=compute_logits)

    def _fused_applies(self, x: torch.Tensor, cache: KVCache | None, pos: torch.Tensor) -> bool:
        """Whether this forward runs every block through :class:`spire.kernels.DecodeBlock` (module docstring)."""
        if type(cache) is not KVCache or not fused_block_applies(self.cfg, x, pos.shape, cache.k[0]):
            return False
        return not (torch.is_grad_enabled() and any(p.requires_grad for p in self.layers.parameters()))

    def _forward_fused(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: KVCache, views: list[SinkWindow | None], want: set[int], k_start: torch.Tensor | None
                       ) -> ForwardOutput:
        """:meth:`forward` with every block one :class:`spire.kernels.DecodeBlock` call (same arithmetic);
        views: each layer's rule (:meth:`_fused_views`)."""
        B, T = pos.shape
        _check_positions(pos, cache.max_len)
        d = self.cfg.d_model
        run = FusedStep(pos, cos, sin)
        ks = None if k_start is None else k_start.to(torch.int64).contiguous()
        h = x.reshape(B * T, d).contiguous()
        hidden: dict[int, torch.Tensor] = {}
        for i in range(len(self.layers)):
            if i in want:
                hidden[i] = h.view(B, T, d)
            h = run.block(fused_block(self.layers[i], cache.k[i], cache.v[i], self.cfg.n_heads, self._fused, i), h,
                          ks, views[i])
        if len(self.layers) in want:
            hidden[len(self.layers)] = h.view(B, T, d)
        return self._output(h.view(B, T, d), hidden)

    @staticmethod
    def _kv_source(cache: KVCache | None, layer: int, pos: torch.Tensor) -> KVSource:
        """The reference KV source (write all of pos, read positions < max(pos) + 1)."""
        if cache is None:
            return lambda k, v: (k, v)

        def write_then_read(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cache.write(layer, pos, k, v)
            return cache.read(layer, int(pos.max()) + 1)

        return write_then_read

    def num_body_params(self) -> int:
        """Parameters of the transformer blocks (no embedding/unembedding), the paper's N convention."""
        return sum(p.numel() for p in self.layers.parameters())


def _check_positions(pos: torch.Tensor, max_len: int) -> tuple[int, int]:
    """(min, max) of positions pos; raises ConfigError when one is negative or not below the cache length."""
    lo, hi = (int(v) for v in torch.aminmax(pos))
    if hi >= max_len:
        raise ConfigError(f"position {hi} is beyond the cache length {max_len}")
    if lo < 0:
        raise ConfigError(f"negative position {lo}")
    return lo, hi


class _CacheAccess:
    """How one forward writes its keys/values into a dense :class:`KVCache` and what each layer reads back,
    planned once per forward (not per layer).

    Writes: a slice copy when every row writes the same contiguous positions, else one advanced-index
    assignment. Reads: positions < upto = max(pos) + 1 only. With a :class:`SinkWindow` view and a history
    longer than the view, the keys/values are gathered: per row the ``sink`` first positions and the
    ``window + (T - 1)`` positions ending at the row's last query, so a MagicDec step reads
    B·(sink + window) entries per layer whatever the context length. The mask is then built from the
    gathered positions (entries before 0, or duplicating a sink position, are masked out). With no view
    and no k_start, T = 1 and every row at the same position nothing is masked and the mask is None.
    """

    def __init__(self, cache: KVCache, pos: torch.Tensor, view: SinkWindow | None, k_start: torch.Tensor | None
                 ) -> None:
        self.cache, self.pos, self.view, self.k_start = cache, pos, view, k_start
        B, T = pos.shape
        dev = pos.device
        p_first, p_last = pos[:, 0], pos[:, -1]
        lo, hi = _check_positions(pos, cache.max_len)
        self.lo, self.upto = lo, hi + 1
        ar = torch.arange(T, device=dev)
        contiguous = bool(((pos - p_first[:, None]) == ar).all())
        self.slice_at = int(p_first[0]) if contiguous and bool((p_first == p_first[0]).all()) else None
        self.rows = None if self.slice_at is not None else torch.arange(B, device=dev)[:, None].expand(B, T)
        self.gather = None
        span = (p_last - p_first).max() if contiguous else None
        if view is not None and contiguous:
            n_win = view.window + int(span)  # window entries of the row's last query ∪ ... of its first
            if view.sink + n_win < self.upto:
                g = torch.cat([torch.arange(view.sink, device=dev).expand(B, view.sink),
                               (p_last - n_win + 1)[:, None] + torch.arange(n_win, device=dev)], 1)  # (B, S')
                valid = g >= 0
                valid[:, view.sink:] &= g[:, view.sink:] >= view.sink
                self.gather = g.clamp_min(0)
                self.key_pos = g  # (B, S')
                self.mask = attention_mask(pos, g, view, k_start) & valid[:, None, None, :]
                start = int(p_last[0]) - n_win + 1
                # every row reads the same positions (e.g. B = 1): two slices instead of an indexed copy
                self.slices = (view.sink, start) if self.slice_at is not None and start >= view.sink else None
                self.rows_g = torch.arange(B, device=dev)[:, None]
                return
        self.key_pos = cache.positions[: self.upto]  # (S,)
        if view is None and k_start is None and T == 1 and lo == hi:
            self.mask = None
        else:
            self.mask = attention_mask(pos, cache.positions[: self.upto], view, k_start)

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
                base = self.mask if start == 0 and self.mask is not None else \
                    attention_mask(self.pos, kp, self.view, self.k_start)
                kp = kp[None, None, None, :] if kp.dim() == 1 else kp[:, None, None, :]
                masks[w] = base & (kp > self.pos[:, None, :, None] - w)
            starts[w] = start

        def source(layer: int, start: int) -> KVSource:
            def write_then_read(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                self.write(layer, k, v)
                return self.read(layer, start)

            return write_then_read

        return [masks[w] for w in windows], [source(i, starts[w]) for i, w in enumerate(windows)]
