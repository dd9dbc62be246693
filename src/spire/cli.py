"""The ``spire`` command line. One function per command; each is a thin call into the library.

Any :class:`spire.errors.SpireError` is printed as one line ``error: <message>`` on stderr, exit code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from spire.errors import ConfigError, SpireError

app = typer.Typer(
    name="spire",
    help="Throughput-oriented speculative decoding (SPIRe, Neelam et al. 2025, arXiv 2504.06419).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

GOLDEN_LS = "8,16,32,64,128,256,512,1024,2048,4096,8192"  # the L of the paper's B = 64 table
GRID_HELP = "Repeat the option or comma-separate values: -B 1 -B 8,64."


@app.callback()
def _root() -> None:
    """Throughput-oriented speculative decoding (SPIRe, arXiv 2504.06419)."""


def _ints(name: str, values: list[str]) -> list[int]:
    """Integers from repeated and/or comma-separated option values: ``-B 1 -B 8,64`` -> [1, 8, 64]."""
    out = []
    for value in values:
        for item in value.split(","):
            try:
                out.append(int(item.strip()))
            except ValueError:
                raise ConfigError(f"{name}: {item.strip()!r} is not an integer") from None
    return out


def _taus(values: list[str]) -> dict[str, float]:
    """τ overrides from ``DRAFT=VALUE`` strings."""
    taus = {}
    for value in values:
        draft, sep, number = value.partition("=")
        try:
            if not sep:
                raise ValueError
            taus[draft.strip()] = float(number)
        except ValueError:
            raise ConfigError(f"--tau expects DRAFT=VALUE (e.g. spire=3.4), got {value!r}") from None
    return taus


@app.command()
def throughput(
    preset: Annotated[str, typer.Option(help="Model preset: paper-67m, paper-70b or smollm2-135m.")] = "paper-67m",
    B: Annotated[list[str], typer.Option("-B", "--batch", metavar="INT[,INT...]", help=GRID_HELP)] = ["64"],
    L: Annotated[list[str], typer.Option("-L", "--context", metavar="INT[,INT...]", help=GRID_HELP)] = [GOLDEN_LS],
    k: Annotated[int, typer.Option("--k", "-k", help="Speculation depth: draft tokens per round.")] = 4,
    hoi: Annotated[float, typer.Option(help="Hardware operational intensity, FLOPs per byte.")] = 600.0,
    combine: Annotated[
        Literal["max", "sum"], typer.Option(help="Overlap compute and memory fully (max) or not at all (sum).")
    ] = "max",
    tau: Annotated[
        list[str], typer.Option(metavar="DRAFT=VALUE", help="Override τ of vanilla, magicdec or spire; repeatable.")
    ] = [],
    memory_gb: Annotated[
        Optional[float], typer.Option(help="Device memory in GB (1e9 bytes); marks points that do not fit.")
    ] = None,
    bytes_per_value: Annotated[int, typer.Option(help="Bytes per weight / KV value, for --memory-gb.")] = 1,
    fmt: Annotated[Literal["table", "json"], typer.Option("--format", help="Rich table or one JSON object.")] = "table",
    plot: Annotated[Optional[Path], typer.Option(help="Also write a PNG heatmap of the multiplier here.")] = None,
) -> None:
    """Throughput multiplier τ/Δt of vanilla SD, MagicDec and SPIRe from the paper's cost model."""
    from spire.throughput import get_preset, throughput_rows

    chosen = get_preset(preset)
    if memory_gb is not None and not memory_gb > 0:
        raise ConfigError(f"--memory-gb must be positive, got {memory_gb}")
    memory_bytes = None if memory_gb is None else memory_gb * 1e9
    rows = throughput_rows(
        chosen, _ints("-B", B), _ints("-L", L), k=k, hoi=hoi, combine=combine, taus=_taus(tau),
        memory_bytes=memory_bytes, bytes_per_value=bytes_per_value,
    )  # fmt: skip
    if plot is not None:
        from spire.throughput.plots import plot_multiplier_heatmaps

        title = f"{chosen.name}: throughput multiplier (k={k}, HOI={hoi:g}, {combine})"
        typer.echo(f"wrote {plot_multiplier_heatmaps(rows, plot, title)}", err=True)
    if fmt == "json":
        summary = {"preset": chosen.name, "k": k, "hoi": hoi, "combine": combine, "memory_bytes": memory_bytes}
        typer.echo(json.dumps({**summary, "rows": rows}))
    else:
        _print_table(chosen.name, chosen.description, rows)


def _print_table(name: str, description: str, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{name}: {description}", caption="multiplier = τ / Δt (throughput over AD)")
    for column in ("draft", "B", "L", "τ", "Δt", "multiplier", "memory (GB)"):
        table.add_column(column, justify="left" if column == "draft" else "right")
    for r in rows:
        memory = f"{r['memory_bytes_needed'] / 1e9:.3g}"
        if r["fits"] is False:
            dt, m, memory = "-", "does not fit", f"[red]{memory}[/red]"
        else:
            dt, m = f"{r['delta_t']:.3f}", f"{r['multiplier']:.2f}"
        table.add_row(r["draft"], str(r["B"]), str(r["L"]), f"{r['tau']:.3f}", dt, m, memory)
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app; a SpireError becomes one ``error:`` line on stderr, exit 2."""
    try:
        app(args=argv, prog_name="spire")
    except SpireError as e:
        message = " ".join(str(e).splitlines())
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
