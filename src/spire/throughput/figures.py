"""Every figure and number of the paper's throughput analysis in one call: PNGs plus one JSON file
(arXiv 2504.06419, §"evaluation": Figures 1, 3, 4, 5, 6, the alternative metric and the cost analysis)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from spire.paths import atomic_write
from spire.throughput.analysis import (
    ablation_rows,
    growing_rows,
    headline,
    operational_intensity_data,
)
from spire.throughput.cost_model import HOI, RowOptions, throughput_rows
from spire.throughput.plots import (
    plot_ablation,
    plot_multiplier_heatmaps,
    plot_multiplier_vs_L,
    plot_operational_intensity,
)
from spire.throughput.shapes import Preset, get_preset

FIGURE_LS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
FIGURE_BS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
OI_LS = [16, 32, 48, 64, 128, 512]


def write_json_atomic(data: Any, path: str | os.PathLike) -> Path:
    """Write ``data`` as indented JSON to ``path`` atomically."""
    return atomic_write(path, None, json.dumps(data, indent=1))


def write_figures(
    out: str | os.PathLike,
    preset: Preset | None = None,
    extrapolation: Preset | None = None,
    k: int = 4,
    hoi: float = HOI,
    G: int = 64,
    Bs: list[int] | None = None,
    Ls: list[int] | None = None,
) -> dict[str, Any]:
    """Write the paper's figures for ``preset`` (default paper-67m) and the extrapolation to
    ``extrapolation`` (default llama3-70b) into ``out``; returns (and writes as figures.json) their data.

    Files: fig1_b64.png (B = 64 slice), fig3_oi.png (verification OI vs HOI), fig4_heatmaps.png (B × L),
    fig5_ablation.png, fig6_<name>_heatmaps.png and fig6_<name>_b64.png, growing_G<G>.png (alternative
    metric) and figures.json (all rows, the headline and the cost analysis).
    """
    preset = preset or get_preset("paper-67m")
    extrapolation = extrapolation or get_preset("llama3-70b")
    Bs, Ls = Bs or FIGURE_BS, Ls or FIGURE_LS
    out = Path(out)
    options = RowOptions(k=k, hoi=hoi)
    grid = throughput_rows(preset, Bs, Ls, options)
    big = throughput_rows(extrapolation, Bs, Ls, options)
    b64 = 64 if 64 in Bs else Bs[len(Bs) // 2]
    oi = operational_intensity_data(preset.target, OI_LS, [2**i for i in range(13)], k, hoi)
    ablation = ablation_rows(preset, Ls, b64, k, hoi)
    growing = growing_rows(preset, [b64], Ls, G, k, hoi)
    tag = f"k={k}, HOI={hoi:g}"
    files = [
        plot_multiplier_vs_L(grid, out / "fig1_b64.png", b64, f"Figure 1: {preset.name}, B = {b64} ({tag})"),
        plot_operational_intensity(oi, out / "fig3_oi.png",
                                   f"Figure 3: {preset.name} verification OI (k={k}); L_crit = {oi['L_crit']}"),
        plot_multiplier_heatmaps(grid, out / "fig4_heatmaps.png", f"Figure 4: {preset.name} ({tag})"),
        plot_ablation(ablation, out / "fig5_ablation.png", f"Figure 5: {preset.name} ablations, B = {b64}"),
        plot_multiplier_heatmaps(big, out / f"fig6_{extrapolation.name}_heatmaps.png",
                                 f"Figure 6: {extrapolation.name} ({tag})"),
        plot_multiplier_vs_L(big, out / f"fig6_{extrapolation.name}_b64.png", b64,
                             f"Figure 6: {extrapolation.name}, B = {b64}"),
        plot_multiplier_vs_L(growing, out / f"growing_G{G}.png", b64,
                             f"{preset.name}: context grows over G = {G} tokens, B = {b64}"),
    ]  # fmt: skip
    data = {
        "preset": preset.name,
        "extrapolation": extrapolation.name,
        "k": k,
        "hoi": hoi,
        "headline": headline(preset, options=options),
        "figure1_4_rows": grid,
        "figure3": oi,
        "figure5_rows": ablation,
        "figure6_rows": big,
        "growing_rows": growing,
        "files": [p.name for p in files],
    }
    write_json_atomic(data, out / "figures.json")
    return data
