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


@app.command()
def reproduce(
    preset: Annotated[str, typer.Option(help="Target preset (the embedded default: smollm2-135m).")] = "smollm2-135m",
    out: Annotated[Path, typer.Option(help="Output folder for REPORT.md, results.json and PNGs.")] = Path("spire-out"),
    quick: Annotated[bool, typer.Option("--quick", help="Smoke-test settings: about 5 minutes on 2 cores.")] = False,
    budget: Annotated[Optional[float], typer.Option(help="SPIRe training budget in seconds.")] = None,
    n_contexts: Annotated[Optional[int], typer.Option(help="Held-out contexts per τ measurement.")] = None,
    L: Annotated[Optional[int], typer.Option("-L", "--context", help="Context length for τ (tokens).")] = None,
    G: Annotated[Optional[int], typer.Option("-G", "--generate", help="Tokens generated per context.")] = None,
    k: Annotated[int, typer.Option("--k", "-k", help="Draft tokens per round.")] = 4,
    n_draft_layers: Annotated[int, typer.Option(help="Target layers pruned into the SPIRe draft.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed for data windows, training and sampling.")] = 0,
) -> None:
    """The main job: data, SPIRe training, τ for MagicDec and SPIRe, cost model, REPORT.md."""
    from spire.pipeline import ReproduceConfig, reproduce as run

    overrides = {name: value for name, value in (("budget_s", budget), ("n_contexts", n_contexts), ("L", L),
                                                  ("G", G)) if value is not None}
    overrides.update(preset=preset, out=out, k=k, n_draft_layers=n_draft_layers, seed=seed)
    cfg = ReproduceConfig.quick_config(**overrides) if quick else ReproduceConfig(**overrides)
    run(cfg, log=lambda msg: typer.echo(msg, err=True))
    typer.echo(f"wrote {out / 'REPORT.md'}, {out / 'results.json'} and figures")


@app.command()
def data(
    target: Annotated[str, typer.Option(help="Checkpoint whose tokenizer is used (preset, .gguf or HF folder).")]
    = "smollm2-135m",
    heldout_fraction: Annotated[float, typer.Option(help="Fraction of documents held out per source.")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed of the document split.")] = 0,
) -> None:
    """Prepare token windows from registry texts, held out by document (cached)."""
    from spire.data import data_summary_table, prepare_data
    from spire.loading import load_target
    from spire.pipeline import document_separator_id

    if not 0 < heldout_fraction < 1:
        raise ConfigError(f"--heldout-fraction must be in (0, 1), got {heldout_fraction}")
    _, tokenizer, _ = load_target(target)
    td = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), heldout_fraction=heldout_fraction,
                      seed=seed)
    typer.echo(data_summary_table(td))


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
