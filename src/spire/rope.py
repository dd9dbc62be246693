"""Rotary position embeddings (RoPE; Su et al. 2021) and the scaled variants Llama-family checkpoints use.

A RoPE spec is a dict as :meth:`spire.model.ModelConfig.rope_of` gives it: ``{"rope_type": "default" | "linear" |
"llama3" | "yarn" | "none", "rope_theta": ..., <the variant's own keys>}`` (read from an HF config.json by
:mod:`spire.families`). The formulas are transformers' ``modeling_rope_utils`` ones, so logits match HF's.

Shapes: B batch, T positions, D head dim, R distinct RoPE specs of a model's layers.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from spire.errors import ConfigError

_INV_FREQ: dict[tuple, tuple[torch.Tensor, float]] = {}
"""rope_inv_freq's results by (spec, D, device)."""


def rope_inv_freq(spec: dict, d_head: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies (D/2,) float32 and the factor applied to cos and sin, for one RoPE spec
    (:meth:`spire.model.ModelConfig.rope_of`): "default" theta^(-2i/D) (Su et al. 2021); "linear" divided by ``factor``
    (position interpolation, Chen et al. 2023); "llama3" (Meta's Llama 3.1 low/high-frequency interpolation);
    "yarn" (Peng et al. 2023, with its attention factor). The same formulas as transformers'
    ``modeling_rope_utils`` (so that logits match HF's). Cached per (spec, D, device)."""
    key = (tuple(sorted(spec.items())), d_head, str(device))
    hit = _INV_FREQ.get(key)
    if hit is not None:
        return hit
    kind, theta = spec["rope_type"], spec.get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (torch.arange(0, d_head, 2, device=device, dtype=torch.int64).float() / d_head))
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
    """The RoPE tables of every distinct RoPE of a model (:attr:`spire.model.Transformer.ropes`), stacked: pos (B, T) ->
    cos, sin: (R, B, 1, T, D); block i reads index ``Block.rope_id``."""
    tables = [rope_cos_sin(pos, d_head, spec, dtype) for spec in ropes]
    if len(tables) == 1:  # one RoPE for every layer (most families): a view, no copy
        return tables[0][0][None], tables[0][1][None]
    return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, D) rotated by position; cos, sin: (B, 1, T, D) from :func:`rope_cos_sin` -> (B, heads, T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
