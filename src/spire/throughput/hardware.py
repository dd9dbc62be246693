"""Accelerator presets and data types for the cost model (beyond the paper; off by default).

The paper's model needs one number from the hardware: HOI, FLOPs per byte of memory bandwidth (600, "H100
SXM dense FP8 over HBM bandwidth"). A :class:`Hardware` gives peak dense FLOP/s per data type, memory
bandwidth in bytes/s and device memory in bytes, so that HOI = FLOP/s ÷ bytes/s for the compute dtype, the
memory check of CASES.md 10 uses the device size, and times in FLOP-equivalents turn into seconds.

Figures are vendor datasheet peaks for one chip, dense (no 2:4 sparsity); use ``custom_hardware`` for
measured values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from spire.errors import ConfigError

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
"""Bytes per stored value of each data type (weights or KV cache)."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator chip. flops: peak dense FLOP/s per compute dtype; bandwidth: memory bytes/s;
    memory_bytes: device memory in bytes (None = unknown, no capacity check)."""

    name: str
    flops: Mapping[str, float]
    bandwidth: float
    memory_bytes: float | None
    description: str = ""
    notes: dict[str, Any] = field(default_factory=dict)

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; int4 runs at the int8 rate where there is no int4 rate."""
        check_dtype(dtype)
        if dtype in self.flops:
            return self.flops[dtype]
        if dtype == "int4" and "int8" in self.flops:
            return self.flops["int8"]
        raise ConfigError(f"hardware {self.name} has no {dtype} peak; it has {', '.join(self.flops)}")

    def hoi(self, dtype: str) -> float:
        """Hardware operational intensity for ``dtype`` compute, FLOPs per byte = FLOP/s ÷ bytes/s."""
        return self.flops_for(dtype) / self.bandwidth


def _hw(name, flops_tf, tb_s, gb, description):
    return Hardware(name, {d: v * 1e12 for d, v in flops_tf.items()}, tb_s * 1e12, gb * 1e9, description)


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        _hw("h100-sxm", {"fp8": 1979, "int8": 1979, "bf16": 989, "fp16": 989, "fp32": 67}, 3.35, 80,
            "NVIDIA H100 SXM 80 GB HBM3 (the paper's HOI 600 ≈ 1979 TFLOP/s FP8 ÷ 3.35 TB/s)"),
        _hw("h200", {"fp8": 1979, "int8": 1979, "bf16": 989, "fp16": 989, "fp32": 67}, 4.8, 141,
            "NVIDIA H200 SXM 141 GB HBM3e"),
        _hw("b200", {"fp8": 4500, "int8": 4500, "bf16": 2250, "fp16": 2250, "fp32": 75}, 8.0, 180,
            "NVIDIA B200 (HGX) 180 GB HBM3e"),
        _hw("a100", {"int8": 624, "bf16": 312, "fp16": 312, "fp32": 19.5}, 2.039, 80,
            "NVIDIA A100 SXM 80 GB HBM2e (no FP8)"),
        _hw("tpu-v5e", {"int8": 394, "bf16": 197}, 0.819, 16, "Google TPU v5e, 16 GB HBM2"),
        _hw("mi300x", {"fp8": 2614.9, "int8": 2614.9, "bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4}, 5.3, 192,
            "AMD Instinct MI300X 192 GB HBM3"),
    )
}


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")


def get_hardware(name: str) -> Hardware:
    """The hardware preset ``name``; :class:`ConfigError` listing the known ones otherwise."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None


def custom_hardware(flops: float, bandwidth: float, memory_bytes: float | None = None, dtype: str = "fp8") -> Hardware:
    """A chip from measured numbers: ``flops`` FLOP/s for ``dtype``, ``bandwidth`` bytes/s, memory in bytes."""
    check_dtype(dtype)
    for label, value in (("flops", flops), ("bandwidth", bandwidth), ("memory", memory_bytes)):
        if value is None and label == "memory":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"custom hardware: {label} must be a positive number, got {value!r}")
    return Hardware("custom", {dtype: float(flops)}, float(bandwidth), memory_bytes, "custom FLOP/s and bytes/s")
