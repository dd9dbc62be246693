"""``spire throughput-figures``: every figure of the paper's throughput analysis, and their data as JSON.

The command's options are declared here and registered by :mod:`spire.cli`; the library is imported inside the
function.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spire import defaults
from spire.paths import check_output_path


def headline(h: dict) -> str:
    """The summary line of ``figures.json``'s "headline": SPIRe's multiplier at its (B, L), its gain over vanilla
    and MagicDec in percent, and its saving in training units."""
    return (f"(B, L) = ({h['B']}, {h['L']}): SPIRe {h['multiplier']['spire']:.2f}x, "
            f"+{h['spire_gain_vs_vanilla_pct']:.1f} % vs vanilla, +{h['spire_gain_vs_magicdec_pct']:.1f} % vs "
            f"MagicDec; saving {h['spire_saving_units']:.2f} training units")


def throughput_figures(
    out: Annotated[Path, typer.Option(help="Folder for the PNGs and figures.json.")] = Path("spire-figures"),
    preset: Annotated[str, typer.Option(help="Model preset of Figures 1, 3, 4, 5.")] = "paper-67m",
    extrapolation: Annotated[str, typer.Option(help="Preset of Figure 6.")] = "llama3-70b",
    k: Annotated[int, typer.Option("--k", "-k", help="Speculation depth.")] = defaults.K,
    hoi: Annotated[float, typer.Option(help="Hardware operational intensity, FLOPs per byte.")] = 600.0,
    G: Annotated[int, typer.Option("-G", help="Generated tokens for the growing-context metric.")] = 64,
) -> None:
    """Every figure of the paper's throughput analysis (Figures 1, 3, 4, 5, 6, growing context) + JSON."""
    from spire.throughput import get_preset
    from spire.throughput.figures import write_figures

    check_output_path(out, "--out", folder=True)
    data = write_figures(out, get_preset(preset), get_preset(extrapolation), k=k, hoi=hoi, G=G)
    typer.echo(f"wrote {len(data['files'])} figures and figures.json to {out}")
    typer.echo(headline(data["headline"]))
