"""Measured throughput on real hardware against the paper's cost model (issue 7).

- :mod:`spire.bench.calibrate`: this machine's sustained matmul FLOP/s and memory bandwidth per dtype
  (``spire bench calibrate``), saved as JSON and usable by the cost model as a :class:`Hardware`.
- :mod:`spire.bench.run`: ``spire bench``: over a (B, L) grid on real held-out contexts, measured t_AD,
  t_verify, t_draft, Δt, τ and tokens/s of AD and SD per draft, beside the cost model's prediction.
- :mod:`spire.bench.report`: the rich table, JSON and markdown report.
- :mod:`spire.bench.hf_compare`: spire's AD / SD loops against HF transformers ``generate`` on the same
  model, dtype, prompts and batch (``benchmarks/decode_vs_hf.py``).
"""

from spire.bench.calibrate import Calibration, calibrate, load_calibration

__all__ = ["Calibration", "calibrate", "load_calibration"]
