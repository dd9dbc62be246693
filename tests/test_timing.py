"""spire.timing: the one device-synchronized timer."""

from __future__ import annotations

import pytest
import torch

from spire.timing import Stopwatch, time_calls


def test_time_calls_runs_a_warm_up_then_the_repetitions():
    calls = []
    times = time_calls(lambda: calls.append(1), torch.device("cpu"), "cpu", min_reps=4)
    assert len(times) == 4 and len(calls) == 5 and all(t >= 0 for t in times)
    calls.clear()
    assert len(time_calls(lambda: calls.append(1), torch.device("cpu"), max_reps=7, min_time=1e9)) == 7


def test_stopwatch_reads_both_clocks_and_refuses_others():
    watch = Stopwatch(torch.device("cpu"))
    wall, cpu = watch.stop()
    assert wall >= 0 and cpu >= 0 and watch.seconds("wall") >= wall
    with pytest.raises(KeyError):
        watch.seconds("gpu")
