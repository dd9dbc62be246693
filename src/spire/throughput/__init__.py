"""The SPIRe paper's throughput cost model (arXiv 2504.06419, §"evaluation"), its presets and plots."""

from spire.throughput.cost_model import (  # noqa: F401
    HOI,
    Cost,
    RoundCosts,
    critical_batch_size,
    delta_t,
    forward_time,
    memory_values,
    multiplier,
    round_costs,
    throughput_rows,
    verify_operational_intensity,
)
from spire.throughput.shapes import DRAFTS, PRESETS, ModelShape, Preset, get_preset  # noqa: F401
