"""The SPIRe paper's throughput cost model (arXiv 2504.06419, §"evaluation"), its presets and plots."""

from spire.throughput.cost_model import (  # noqa: F401
    HOI,
    Cost,
    CostOptions,
    batch_costs,
    resident_bytes,
    saving_units,
    tau_from_alpha,
    RoundCosts,
    RowOptions,
    critical_batch_size,
    delta_t,
    forward_time,
    multiplier,
    round_costs,
    throughput_rows,
    verify_operational_intensity,
)
from spire.throughput.hardware import HARDWARE, Hardware, get_hardware  # noqa: F401
from spire.throughput.shapes import DRAFTS, PAPER_DRAFTS, PRESETS, ModelShape, Preset, get_preset, preset_from_configs  # noqa: F401
