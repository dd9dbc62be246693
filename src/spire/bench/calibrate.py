"""Roofline calibration: this machine's sustained matmul FLOP/s and memory bandwidth per data type.

The cost model (SPIRe paper §"evaluation"; spire.throughput.cost_model) needs the hardware's FLOP/s and
memory bytes/s: HOI = FLOP/s ÷ bytes/s, and a forward takes max(C / FLOP/s, bytes / bytes/s) seconds
(Williams et al. 2009, "Roofline"). Vendor peaks (spire.throughput.hardware) are upper bounds; this
module measures what torch actually sustains here:

- ``matmul_flops``: 2·n³ / t of an (n × n) @ (n × n) matmul, the median over repetitions, the best n of a
  growing ladder (the ladder stops once one product takes longer than a per-size budget, so a dtype the
  chip emulates slowly, e.g. bf16 on an AVX2-only CPU, costs seconds, not minutes);
- ``bandwidth``: bytes / t of reading a buffer far larger than the last-level cache (``x.sum()``), the
  number the cost model uses (weights and KV cache are read once per forward);
- ``copy_bandwidth``: 2·bytes / t of ``y.copy_(x)`` (read + write), for reference;
- ``gemv_bandwidth``: weight bytes / t of ``F.linear(x, W)`` with one row x, the effective bandwidth of a
  batch-1 decode step's matmuls, for reference.

Results are saved as JSON (:meth:`Calibration.save`; default ``<spire cache>/calibration/<device>.json``)
and turned into a :class:`spire.throughput.hardware.Hardware` by :meth:`Calibration.hardware`, which
``spire throughput --calibration FILE`` and ``spire bench`` use.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from spire.errors import ConfigError
from spire.paths import atomic_write, spire_cache_dir
from spire.throughput.hardware import DTYPE_BYTES, Hardware
from spire.timing import CLOCKS, Stopwatch, time_calls

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Data types ``spire bench calibrate`` can measure (names as in spire.throughput.hardware.DTYPE_BYTES)."""

DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The cost model's name of a torch dtype (torch.float32 -> "fp32"). Raises ConfigError otherwise."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ConfigError(f"no cost-model name for {dtype}; known: {', '.join(map(str, DTYPE_NAMES))}") from None


def resolve_device(device: str = "auto") -> torch.device:
    """"auto" -> cuda when available, else cpu; otherwise the named device. Raises ConfigError for an
    unknown or unavailable device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: spire bench runs on cpu or cuda")
    return dev


def device_name(device: torch.device) -> str:
    """Human-readable name of the chip: the GPU's name, or the CPU model from /proc/cpuinfo."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_memory_bytes(device: torch.device) -> float | None:
    """Device memory in bytes (GPU total memory, or MemTotal of /proc/meminfo), None when unknown."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def measure_matmul(dtype: torch.dtype, device: torch.device, sizes: list[int], per_size_s: float = 1.0,
                   clock: str = "wall") -> tuple[float, int]:
    """Sustained FLOP/s of square matmuls: (best over sizes of 2·n³ / median time, that n).

    The ladder stops at the first n whose single product took longer than ``per_size_s``."""
    best, best_n = 0.0, sizes[0]
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        watch = Stopwatch(device)
        a @ b
        single = watch.seconds()
        times = time_calls(lambda: a @ b, device, clock, min_reps=2, max_reps=20,
                           min_time=min(per_size_s, max(0.05, 3 * single)))
        flops = 2 * n**3 / statistics.median(times)
        if flops > best:
            best, best_n = flops, n
        if single > per_size_s:
            break
    return best, best_n


def measure_bandwidth(dtype: torch.dtype, device: torch.device, nbytes: int, clock: str = "wall"
                      ) -> dict[str, float]:
    """Memory bandwidth in bytes/s over a ``nbytes`` buffer: read (``x.sum()``), copy (read + write, counted
    as 2·nbytes) and one-row matmul over a square weight matrix of about nbytes (weight bytes / time)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    n = max(1024, nbytes // elem)
    x = torch.randn(n, device=device).to(dtype)
    y = torch.empty_like(x)
    read = nbytes_actual = n * elem
    t_read = statistics.median(time_calls(lambda: x.sum(), device, clock, min_time=0.3))
    t_copy = statistics.median(time_calls(lambda: y.copy_(x), device, clock, min_time=0.3))
    y = None  # free the copy target
    side = max(64, int((n) ** 0.5))
    W = x[: side * side].view(side, side)
    v = torch.randn(1, side, device=device).to(dtype)
    t_gemv = statistics.median(time_calls(lambda: torch.nn.functional.linear(v, W), device, clock, min_time=0.3))
    return {"bandwidth": read / t_read, "copy_bandwidth": 2 * nbytes_actual / t_copy,
            "gemv_bandwidth": side * side * elem / t_gemv, "buffer_bytes": float(nbytes_actual)}


@dataclass
class Calibration:
    """Measured roofline of one device.

    dtypes: name ("fp32", "bf16", ...) -> {"matmul_flops" (FLOP/s), "matmul_size" (n), "bandwidth" (bytes/s,
    read), "copy_bandwidth", "gemv_bandwidth", "buffer_bytes"}. memory_bytes: device memory (None unknown).
    """

    device: str
    device_name: str
    dtypes: dict[str, dict[str, float]]
    memory_bytes: float | None = None
    threads: int = 1
    torch_version: str = torch.__version__
    created: str = ""
    quick: bool = False
    notes: dict[str, Any] = field(default_factory=dict)

    def default_dtype(self) -> str:
        """fp32 when measured, else the first measured dtype."""
        return "fp32" if "fp32" in self.dtypes else next(iter(self.dtypes))

    def hardware(self, dtype: str | None = None) -> Hardware:
        """A cost-model :class:`Hardware`: FLOP/s of every measured dtype, the read bandwidth measured with
        ``dtype`` (default :meth:`default_dtype`), the device memory. Raises ConfigError for an unmeasured
        dtype."""
        dtype = dtype or self.default_dtype()
        if dtype not in self.dtypes:
            raise ConfigError(f"the calibration of {self.device_name} has no {dtype} measurement; it has "
                              f"{', '.join(self.dtypes)} (run `spire bench calibrate --dtype {dtype}`)")
        return Hardware(f"calibrated {self.device}", {d: v["matmul_flops"] for d, v in self.dtypes.items()},
                        self.dtypes[dtype]["bandwidth"], self.memory_bytes,
                        f"measured on {self.device_name} ({self.created})")

    def hoi(self, dtype: str | None = None) -> float:
        """Hardware operational intensity FLOP/byte = matmul FLOP/s ÷ read bandwidth, for ``dtype``."""
        return self.hardware(dtype).hoi(dtype or self.default_dtype())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hoi"] = {name: self.hoi(name) for name in self.dtypes}
        return d

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the JSON atomically to ``path`` (default :func:`default_path` for this device)."""
        path = Path(path) if path is not None else default_path(self.device, self.device_name)
        return atomic_write(path, None, text=json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Calibration":
        """Raises ConfigError when keys or values are missing or not positive numbers."""
        try:
            dtypes = {str(k): {kk: float(vv) for kk, vv in v.items()} for k, v in d["dtypes"].items()}
            cal = cls(device=str(d["device"]), device_name=str(d.get("device_name", d["device"])), dtypes=dtypes,
                      memory_bytes=None if d.get("memory_bytes") is None else float(d["memory_bytes"]),
                      threads=int(d.get("threads", 1)), torch_version=str(d.get("torch_version", "")),
                      created=str(d.get("created", "")), quick=bool(d.get("quick", False)),
                      notes=dict(d.get("notes", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"not a spire calibration: {type(e).__name__} {e}") from None
        if not dtypes:
            raise ConfigError("calibration has no dtype measurements")
        for name, v in dtypes.items():
            if name not in DTYPE_BYTES:
                raise ConfigError(f"calibration: unknown dtype {name!r}")
            for key in ("matmul_flops", "bandwidth"):
                if not 0 < v.get(key, 0) < float("inf"):
                    raise ConfigError(f"calibration: {name} {key} must be a positive number, got {v.get(key)!r}")
        return cal


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:60] or "device"


def default_path(device: str, name: str = "") -> Path:
    """``<spire cache>/calibration/<device type>[-<chip>].json`` (one file per kind of device)."""
    kind = device.split(":")[0]
    stem = kind if kind == "cpu" else f"{kind}-{_slug(name)}"
    return spire_cache_dir() / "calibration" / f"{stem}.json"


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read a calibration JSON. Raises ConfigError when the file is missing or invalid."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read calibration {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"calibration {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"calibration {path} must hold a JSON object")
    return Calibration.from_dict(data)


def cached_calibration(device: torch.device) -> Calibration | None:
    """The saved calibration of this device from the cache (``default_path``), or None."""
    path = default_path(str(device), device_name(device))
    if not path.is_file():
        return None
    try:
        return load_calibration(path)
    except ConfigError:
        return None


def calibrate(dtypes: list[str] | tuple[str, ...] = ("fp32", "bf16"), device: str | torch.device = "auto",
              quick: bool = False, buffer_bytes: int | None = None, sizes: list[int] | None = None,
              per_size_s: float = 1.0, log: Callable[[str], None] | None = None, clock: str = "wall"
              ) -> Calibration:
    """Measure matmul FLOP/s and memory bandwidth for each dtype on ``device`` (see the module docstring).

    Args:
        dtypes: names from :data:`TORCH_DTYPES`.
        device: "auto", "cpu", "cuda", "cuda:1", or a torch.device.
        quick: small sizes (seconds; numbers are cache-resident, for tests and smoke runs only).
        buffer_bytes: bandwidth buffer size (default 256 MiB on CPU, 1 GiB on GPU; quick 4 MiB).
        sizes: matmul ladder (default CPU 256..2048, GPU 1024..8192; quick 64, 128).
        per_size_s: stop growing the matmul once one product takes longer than this (seconds).
        clock: "wall", or "cpu" (process CPU time; single-threaded runs on a shared machine).
    Raises:
        ConfigError: unknown dtype, device or clock, or clock "cpu" on a GPU.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    if clock not in CLOCKS:
        raise ConfigError(f"clock must be wall or cpu, got {clock!r}")
    if clock == "cpu" and dev.type != "cpu":
        raise ConfigError("clock cpu measures CPU time: only for the CPU")
    for d in dtypes:
        if d not in TORCH_DTYPES:
            raise ConfigError(f"cannot calibrate dtype {d!r}; choose from {', '.join(TORCH_DTYPES)}")
    if not dtypes:
        raise ConfigError("give at least one dtype to calibrate")
    gpu = dev.type == "cuda"
    if sizes is None:
        sizes = [64, 128] if quick else ([1024, 2048, 4096, 8192] if gpu else [256, 512, 1024, 2048])
    if buffer_bytes is None:
        buffer_bytes = 4 << 20 if quick else ((1 << 30) if gpu else (256 << 20))
    results: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name in dtypes:
            dt = TORCH_DTYPES[name]
            flops, n = measure_matmul(dt, dev, sizes, per_size_s, clock)
            bw = measure_bandwidth(dt, dev, buffer_bytes, clock)
            results[name] = {"matmul_flops": flops, "matmul_size": float(n), **bw}
            if log:
                log(f"{name}: matmul {flops / 1e9:,.1f} GFLOP/s (n={n}), read {bw['bandwidth'] / 1e9:,.1f} GB/s, "
                    f"copy {bw['copy_bandwidth'] / 1e9:,.1f} GB/s, 1-row matmul {bw['gemv_bandwidth'] / 1e9:,.1f} GB/s")
    return Calibration(device=str(dev), device_name=device_name(dev), dtypes=results,
                       memory_bytes=device_memory_bytes(dev), threads=torch.get_num_threads(),
                       created=time.strftime("%Y-%m-%dT%H:%M:%S"), quick=quick,
                       notes={"sizes": sizes, "per_size_s": per_size_s, "clock": clock})
