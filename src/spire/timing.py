"""Device-synchronized timing: the one stopwatch of the round loop, the benchmarks and the calibration.

CUDA work runs asynchronously: a clock read right after a launch measures the launch, not the work, so every
reading here synchronizes the device first. Two clocks (:data:`CLOCKS`): ``"wall"`` (``time.perf_counter``)
and ``"cpu"``, the process's CPU time over all its threads (``time.process_time``): on a shared machine a
single-threaded CPU run's CPU time leaves out the time slices other jobs took.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""Clock name -> clock: wall-clock, or the process's CPU time (single-threaded runs on a shared machine)."""


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Seconds since construction on both clocks, the device synchronized at the start and at each reading.

    The CPU clock is read outside the wall-clock interval, so wall-clock times carry no extra clock call.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        sync(device)
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()

    def stop(self) -> tuple[float, float]:
        """(wall-clock seconds, CPU seconds) since construction, after a device sync."""
        sync(self.device)
        wall = time.perf_counter() - self._wall0
        return wall, time.process_time() - self._cpu0

    def seconds(self, clock: str = "wall") -> float:
        """Seconds since construction on ``clock`` ("wall" or "cpu"). Raises KeyError for another name."""
        return dict(zip(CLOCKS, self.stop()))[clock]


def time_calls(fn: Callable[[], Any], device: torch.device, clock: str = "wall", min_reps: int = 3,
               max_reps: int = 50, min_time: float = 0.0) -> list[float]:
    """Seconds of ``fn()`` per call on ``clock`` (each call device-synchronized), after one warm-up call:
    repeated until ``min_time`` seconds have passed, at least ``min_reps`` and at most ``max_reps`` times
    (``min_time`` 0: exactly ``min_reps`` calls)."""
    fn()
    times: list[float] = []
    total = 0.0
    while len(times) < min_reps or (total < min_time and len(times) < max_reps):
        watch = Stopwatch(device)
        fn()
        dt = watch.seconds(clock)
        times.append(dt)
        total += dt
    return times
