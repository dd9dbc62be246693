"""Plots of cost-model rows (from :func:`spire.throughput.cost_model.throughput_rows`) as PNG files.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch). Files are written
atomically: to a temporary file in the destination folder, then renamed over the destination.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from spire.paths import atomic_write
from spire.errors import ConfigError

Row = dict[str, Any]


def _drafts(rows: Sequence[Row]) -> list[str]:
    """Draft kinds in the order they first appear in ``rows``."""
    if not rows:
        raise ConfigError("nothing to plot: no rows")
    return list(dict.fromkeys(r["draft"] for r in rows))


def _value(row: Row) -> float:
    """The row's multiplier, NaN for a point that does not fit in memory."""
    return math.nan if row["multiplier"] is None else row["multiplier"]


def _save_atomic(fig: Figure, path: str | os.PathLike) -> Path:
    """Write ``fig`` as a PNG to ``path`` atomically."""
    return atomic_write(path, lambda f: FigureCanvasAgg(fig).print_png(f))


def plot_multiplier_heatmaps(rows: Sequence[Row], path: str | os.PathLike, title: str = "") -> Path:
    """One heatmap panel per draft of the throughput multiplier over B (rows) × L (columns).

    Cells are annotated with their value; all panels share one colour scale. Points that do not fit in
    memory (null multiplier) are grey, hatched and marked "OOM".
    """
    drafts = _drafts(rows)
    Bs = sorted({r["B"] for r in rows})
    Ls = sorted({r["L"] for r in rows})
    grids = {d: np.full((len(Bs), len(Ls)), np.nan) for d in drafts}
    missing = {d: np.ones((len(Bs), len(Ls)), dtype=bool) for d in drafts}
    for r in rows:
        i, j = Bs.index(r["B"]), Ls.index(r["L"])
        grids[r["draft"]][i, j] = _value(r)
        missing[r["draft"]][i, j] = False
    finite = np.concatenate([g[np.isfinite(g)] for g in grids.values()])
    vmin, vmax = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)

    cell = 0.55
    width = max(4.0, cell * len(Ls) + 1.5) * len(drafts)
    fig = Figure(figsize=(width, max(3.0, cell * len(Bs) + 2.0)), layout="constrained")
    axes = fig.subplots(1, len(drafts), squeeze=False)[0]
    cmap = _colormap()
    for ax, draft in zip(axes, drafts):
        grid = grids[draft]
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            if missing[draft][i, j]:
                continue
            if math.isnan(value):
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="0.4", lw=0))
                ax.text(j, i, "OOM", ha="center", va="center", fontsize=7, color="0.2")
            else:
                colour = _text_colour(value, vmin, vmax)
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
        ax.set_title(draft)
        ax.set_xticks(range(len(Ls)), [str(L) for L in Ls], rotation=90)
        ax.set_yticks(range(len(Bs)), [str(B) for B in Bs])
        ax.set_xlabel("context length L")
        ax.set_ylabel("batch size B")
    fig.colorbar(image, ax=list(axes), label="throughput multiplier τ/Δt")
    if title:
        fig.suptitle(title)
    return _save_atomic(fig, path)


def plot_multiplier_vs_L(rows: Sequence[Row], path: str | os.PathLike, B: int, title: str = "") -> Path:
    """Throughput multiplier against context length L (log2 axis) at batch size B, one line per draft.

    A horizontal line at 1.0 marks autoregressive decoding; points that do not fit in memory are gaps.
    """
    selected = [r for r in rows if r["B"] == B]
    if not selected:
        raise ConfigError(f"no rows with B = {B} to plot")
    fig = Figure(figsize=(6.0, 4.0), layout="constrained")
    ax = fig.subplots()
    for draft in _drafts(selected):
        points = sorted((r["L"], _value(r)) for r in selected if r["draft"] == draft)
        ax.plot(*zip(*points), marker="o", label=draft)
    ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1, label="AD")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length L")
    ax.set_ylabel("throughput multiplier τ/Δt")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title or f"B = {B}")
    return _save_atomic(fig, path)


def _colormap():
    """viridis with grey for points that do not fit."""
    return colormaps["viridis"].with_extremes(bad="0.85")


def _text_colour(value: float, vmin: float, vmax: float) -> str:
    """White text on the dark half of viridis, black on the light half."""
    return "white" if vmax == vmin or (value - vmin) / (vmax - vmin) < 0.6 else "black"


def plot_operational_intensity(data: dict[str, Any], path: str | os.PathLike, title: str = "") -> Path:
    """Paper Figure 3: operational intensity of verification OI(B) (FLOPs/byte, log axes) per context
    length L, against the hardware's HOI; B_crit (where a curve crosses HOI) is marked.

    ``data`` comes from :func:`spire.throughput.analysis.operational_intensity_data`.
    """
    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.subplots()
    Bs = data["B"]
    for curve in data["curves"]:
        label = f"L = {curve['L']}" + (f" (B_crit = {curve['B_crit']})" if curve["B_crit"] else " (never)")
        (line,) = ax.plot(Bs, curve["oi"], label=label)
        if curve["B_crit"] and Bs[0] <= curve["B_crit"] <= Bs[-1]:
            ax.plot([curve["B_crit"]], [data["hoi"]], marker="o", color=line.get_color())
    ax.axhline(data["hoi"], color="black", linestyle="--", linewidth=1.2, label=f"HOI = {data['hoi']:g}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("verification operational intensity (FLOPs / byte)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    L_crit = data.get("L_crit")
    ax.set_title(title or f"k = {data['k']}: compute-bound only for L ≤ {L_crit}")
    return _save_atomic(fig, path)


def plot_ablation(rows: Sequence[Row], path: str | os.PathLike, title: str = "") -> Path:
    """Paper Figure 5: throughput multiplier against L (log2 axis) per ablated SPIRe variant; the analytic
    "without sparse KV cache" curve is dashed. ``rows`` from :func:`spire.throughput.analysis.ablation_rows`."""
    if not rows:
        raise ConfigError("nothing to plot: no rows")
    fig = Figure(figsize=(9.5, 4.5), layout="constrained")
    ax = fig.subplots()
    for variant in dict.fromkeys(r["variant"] for r in rows):
        points = sorted((r["L"], r["multiplier"]) for r in rows if r["variant"] == variant)
        tau = next(r["tau"] for r in rows if r["variant"] == variant)
        style = "--" if variant.startswith("without") else "-"
        ax.plot(*zip(*points), style, marker="o", markersize=3, label=f"{variant} (τ = {tau:.3f})")
    ax.axhline(1.0, color="0.3", linestyle=":", linewidth=1, label="AD")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length L")
    ax.set_ylabel("throughput multiplier τ/Δt")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or f"ablations, B = {rows[0]['B']}")
    return _save_atomic(fig, path)
