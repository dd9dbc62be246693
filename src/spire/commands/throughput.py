"""The logic behind ``spire throughput`` (kept out of spire.cli; ``spire throughput-figures`` is
:mod:`spire.commands.throughput_figures`)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console
from rich.table import Table

from spire import defaults
from spire.bench.calibrate import load_calibration
from spire.commands.options import floats, ints, names
from spire.errors import ConfigError
from spire.evaluation.tau_file import L_RULE, read_tau_file, select_taus
from spire.paths import check_output_path
from spire.throughput.analysis import growing_rows, read_contexts, sample_contexts
from spire.throughput.cost_model import HOI, CostOptions, RowOptions, throughput_rows
from spire.throughput.hardware import DTYPE_BYTES, Hardware, check_dtype, custom_hardware, get_hardware
from spire.throughput.shapes import ModelShape, Preset, get_preset, preset_from_configs, spire_draft_from_config


@dataclass
class ThroughputArgs:
    """Every option of ``spire throughput``, already split into Python values (None = not given)."""

    preset: str = "paper-67m"
    Bs: list[int] = field(default_factory=lambda: [64])
    Ls: list[int] = field(default_factory=lambda: [512])
    k: int = defaults.K
    hoi: float | None = None
    combine: str = "max"
    taus: dict[str, float] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)
    best_k: int | None = None
    memory_gb: float | None = None
    bytes_per_value: float | None = None
    dtype: str | None = None
    kv_dtype: str | None = None
    hardware: str | None = None
    flops: float | None = None
    bandwidth: float | None = None
    attention_flops: bool = False
    embeddings: bool = False
    draft_window: int | None = None
    config: Path | None = None
    vanilla_config: Path | None = None
    spire_config: Path | None = None
    spire_layers: int | None = None
    contexts: list[int] | None = None
    contexts_file: Path | None = None
    context_dist: str | None = None
    seed: int = 0
    grow: int | None = None
    cost_analysis: bool = False
    calibration: Path | None = None  # a `spire bench calibrate` JSON: measured FLOP/s and bandwidth
    tau_from: Path | None = None  # a `spire tau --out` JSON file: measured τ per draft (explicit taus win)
    tau_temperature: float = 0.0  # which temperature's rows of tau_from
    tau_drafts: dict[str, str] = field(default_factory=dict)  # kind -> measured draft name in tau_from


def resolve_preset(a: ThroughputArgs) -> tuple[Preset, int | None, int]:
    """The preset, with the target / drafts replaced from HF or spire configs; (preset, window, sink)."""
    base = get_preset(a.preset)
    window, sink = a.draft_window, defaults.SINK
    if not (a.config or a.vanilla_config or a.spire_config or a.spire_layers is not None):
        return base, window, sink
    target = ModelShape.from_hf_config_file(a.config) if a.config else base.target
    vanilla = ModelShape.from_hf_config_file(a.vanilla_config) if a.vanilla_config else None
    spire = None
    if a.spire_config:
        spire, sink, cfg_window = spire_draft_from_config(target, a.spire_config)
        window = window or cfg_window
    elif a.spire_layers is not None:
        if not 1 <= a.spire_layers <= target.n_layers:
            raise ConfigError(f"--spire-layers must be in [1, {target.n_layers}], got {a.spire_layers}")
        spire = target.with_layers(a.spire_layers)
    if not a.config:  # keep the preset's drafts unless a new target is given
        vanilla = vanilla or base.drafts["vanilla"]
        spire = spire or base.drafts["spire"]
    name = base.name
    if a.config:
        path = Path(a.config)
        name = (path.name if path.is_dir() else path.resolve().parent.name) or "custom"
    preset = preset_from_configs(target, vanilla, spire, dict(base.taus), name=name)
    return preset, window, sink


def resolve_hardware(a: ThroughputArgs) -> Hardware | None:
    if a.calibration is not None:  # measured on this machine (spire.bench.calibrate)
        if a.hardware or a.flops is not None or a.bandwidth is not None:
            raise ConfigError("give --calibration or --hardware / --flops / --bandwidth, not several")

        cal = load_calibration(a.calibration)
        return cal.hardware(a.dtype if a.dtype is not None and a.dtype in cal.dtypes else None)
    if a.hardware and (a.flops or a.bandwidth):
        raise ConfigError("give --hardware or --flops/--bandwidth, not both")
    if a.hardware:
        return get_hardware(a.hardware)
    if a.flops is not None or a.bandwidth is not None:
        if a.flops is None or a.bandwidth is None:
            raise ConfigError("custom hardware needs both --flops (FLOP/s) and --bandwidth (bytes/s)")
        return custom_hardware(a.flops, a.bandwidth, None, a.dtype or "fp8")
    return None


def build(a: ThroughputArgs) -> tuple[dict[str, Any], list[dict[str, Any]], Preset]:
    """(summary, rows, preset) for ``spire throughput``; the summary is the JSON object's other keys."""
    preset, window, sink = resolve_preset(a)
    if preset.max_positions is not None:
        longest = max([*a.Ls, *(a.contexts or [])], default=0)
        if longest > preset.max_positions:
            raise ConfigError(f"L={longest} exceeds {preset.name}'s {preset.max_positions} positions")
    hw = resolve_hardware(a)
    if a.calibration is not None and a.dtype is None and a.bytes_per_value is None:
        # measured hardware: real bytes per value of the dtype it was measured with

        a = dataclasses.replace(a, dtype="fp32" if "fp32" in hw.flops else next(iter(hw.flops)))
    for dtype in (a.dtype, a.kv_dtype):
        if dtype is not None:
            check_dtype(dtype)
    if a.bytes_per_value is not None and a.dtype is not None:
        raise ConfigError("give --dtype or --bytes-per-value, not both")
    if a.bytes_per_value is not None and not a.bytes_per_value > 0:
        raise ConfigError(f"--bytes-per-value must be positive, got {a.bytes_per_value}")
    weight_bytes = DTYPE_BYTES[a.dtype] if a.dtype else (1 if a.bytes_per_value is None else a.bytes_per_value)
    kv_bytes = DTYPE_BYTES[a.kv_dtype] if a.kv_dtype else weight_bytes
    hoi = a.hoi
    if hoi is None:
        hoi = hw.hoi(a.dtype or "fp8") if hw else HOI
    if a.memory_gb is not None and not a.memory_gb > 0:
        raise ConfigError(f"--memory-gb must be positive, got {a.memory_gb}")
    memory_bytes = a.memory_gb * 1e9 if a.memory_gb is not None else (hw.memory_bytes if hw else None)
    options = CostOptions(weight_bytes=weight_bytes, kv_bytes=kv_bytes, attention_flops=a.attention_flops,
                          embeddings=a.embeddings, sink=sink, window=window)
    sources = [s for s in (a.contexts, a.contexts_file, a.context_dist) if s is not None]
    if len(sources) > 1:
        raise ConfigError("give one of --contexts, --contexts-file, --context-dist")
    contexts = a.contexts
    if a.contexts_file is not None:
        contexts = read_contexts(a.contexts_file)
    elif a.context_dist is not None:
        if len(a.Bs) != 1:
            raise ConfigError("--context-dist draws one batch: give a single -B")
        contexts = sample_contexts(a.context_dist, a.Bs[0], a.seed)
    flops_per_s = hw.flops_for(a.dtype or "fp8") if hw else None
    curves = _tau_curves(a)

    def rows_at(Ls: list[int], taus: dict[str, float]) -> list[dict[str, Any]]:
        return throughput_rows(preset, a.Bs, Ls, RowOptions(
            k=a.k, hoi=hoi, combine=a.combine, taus=taus, memory_bytes=memory_bytes, cost=options, contexts=contexts,
            alphas=a.alphas, best_k_max=a.best_k, flops_per_s=flops_per_s, cost_analysis=a.cost_analysis))

    if not curves or not (a.Bs and a.Ls):
        rows = rows_at(a.Ls, a.taus)
    elif contexts is not None:  # one mixed batch: τ at its rounded mean context length
        rows = rows_at(a.Ls, _file_taus(curves, round(sum(contexts) / len(contexts)), a.taus))
        _mark_file_taus(rows, curves, a)
    else:
        rows = _per_L(a.Bs, a.Ls, lambda L: rows_at([L], _file_taus(curves, L, a.taus)))
        _mark_file_taus(rows, curves, a)
    if a.grow is not None:
        if contexts is not None:
            raise ConfigError("--grow works on a (B, L) grid, not on a mixed batch")
        if curves:
            def grown_at(L: int) -> list[dict[str, Any]]:
                taus = {r["draft"]: r["tau"] for r in rows if r["L"] == L}
                return growing_rows(preset, a.Bs, [L], a.grow, a.k, hoi, a.combine, taus, options)

            grown = _per_L(a.Bs, a.Ls, grown_at)
        else:
            taus = {r["draft"]: r["tau"] for r in rows}
            grown = growing_rows(preset, a.Bs, a.Ls, a.grow, a.k, hoi, a.combine, taus, options)
        for row, g in zip(rows, grown):
            row["G"] = a.grow
            row["growing_multiplier"] = g["multiplier"] if row["multiplier"] is not None else None
    summary = {
        "preset": preset.name, "k": a.k, "hoi": hoi, "combine": a.combine, "memory_bytes": memory_bytes,
        "hardware": hw.name if hw else None, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
        "attention_flops": a.attention_flops, "embeddings": a.embeddings,
        "draft_window": window, "target_body_params": preset.target.body_params(),
    }  # fmt: skip
    if curves:
        summary["tau_from"] = {"file": str(a.tau_from), "temperature": a.tau_temperature, "L_rule": L_RULE,
                               "drafts": {kind: c.name for kind, c in curves.items()},
                               "measured_L": {kind: [p[0] for p in c.points] for kind, c in curves.items()}}
    return summary, rows, preset


def _tau_curves(a: ThroughputArgs) -> dict:
    """Measured τ curves from --tau-from for the drafts without an explicit --tau / --alpha ({} without it)."""
    if a.tau_from is None:
        if a.tau_drafts:
            raise ConfigError("--tau-draft needs --tau-from")
        return {}
    if not a.tau_temperature >= 0:
        raise ConfigError(f"--tau-temperature must be >= 0, got {a.tau_temperature}")
    curves = select_taus(read_tau_file(a.tau_from), a.tau_temperature, a.k, a.tau_drafts, path=a.tau_from)
    return {kind: c for kind, c in curves.items() if kind not in a.taus and kind not in a.alphas}


def _file_taus(curves: dict, L: int, explicit: dict[str, float]) -> dict[str, float]:
    """τ overrides at context length L: the file's (interpolated) τ, then the explicit --tau on top."""
    return {**{kind: c.at(L)[0] for kind, c in curves.items()}, **explicit}


def _mark_file_taus(rows: list[dict[str, Any]], curves: dict, a: ThroughputArgs) -> None:
    """Rows whose τ came from the file: tau_source says which measurement, plus its 95 % CI."""
    for r in rows:
        c = curves.get(r["draft"])
        if c is None:
            continue
        _, lo, hi, how = c.at(r["L"])  # a mixed batch's row has L = its rounded mean context length
        r["tau_source"] = f"measured {Path(a.tau_from).name}: {c.name}, T={c.temperature:g}, {how}"
        r["tau_ci_low"], r["tau_ci_high"] = lo, hi


def _per_L(Bs: list[int], Ls: list[int], rows_for_L) -> list[dict[str, Any]]:
    """Rows of a (B, L) grid built one L at a time (``rows_for_L(L)``: rows for every B at that L, B
    outermost, then draft), reassembled in throughput_rows' order: B outermost, then L, then draft."""
    per = {L: rows_for_L(L) for L in dict.fromkeys(Ls)}
    n = len(per[Ls[0]]) // len(Bs)  # rows per (B, L): one per draft
    return [dict(r) for i in range(len(Bs)) for L in Ls for r in per[L][i * n: (i + 1) * n]]


def write_plot(summary: dict[str, Any], rows: list[dict[str, Any]], preset: Preset, path: Path) -> Path:
    """A PNG heatmap of the rows' multiplier at ``path`` (``--plot``). Returns its path."""
    from spire.throughput.plots import plot_multiplier_heatmaps  # lazy: matplotlib's import, for --plot only

    title = f"{preset.name}: throughput multiplier (k={summary['k']}, HOI={summary['hoi']:g}, {summary['combine']})"
    return plot_multiplier_heatmaps(rows, path, title)


def to_json(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """One JSON object: the summary's keys and "rows" (the skeleton issue's contract)."""
    return json.dumps({**summary, "rows": rows})


def to_csv(rows: list[dict[str, Any]]) -> str:
    """CSV with a header; nested "contexts" becomes contexts_n, contexts_min, contexts_mean, contexts_max."""
    flat = []
    for r in rows:
        r = dict(r)
        for key, value in (r.pop("contexts", None) or {}).items():
            r[f"contexts_{key}"] = value
        flat.append(r)
    columns = list(dict.fromkeys(key for r in flat for key in r))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    return buffer.getvalue()


EXTRA_COLUMNS = [  # (row key, header, format)
    ("growing_multiplier", "grow G", "{:.2f}"),
    ("best_k", "best k", "{}"),
    ("best_k_multiplier", "best-k mult.", "{:.2f}"),
    ("saving_units", "saving", "{:.2f}"),
    ("sd_tokens_per_s", "SD tok/s", "{:,.0f}"),
]


def print_table(name: str, description: str, rows: list[dict[str, Any]]) -> None:
    """A rich table of the rows; extra columns appear when a row has them; the caption says where each draft's τ
    came from (the rows' ``tau_source``)."""
    extras = [c for c in EXTRA_COLUMNS if any(c[0] in r for r in rows)]
    drafts_of: dict[str, list[str]] = {}
    for r in rows:
        names = drafts_of.setdefault(str(r.get("tau_source")), [])
        if r["draft"] not in names:
            names.append(r["draft"])
    if len(drafts_of) == 1:
        where = f"; τ: {next(iter(drafts_of))}"
    else:
        where = "; τ of " + "; of ".join(f"{', '.join(names)}: {src}" for src, names in drafts_of.items())
    caption = "multiplier = τ / Δt (throughput over AD)" + (where if drafts_of else "")
    table = Table(title=f"{name}: {description}", caption=caption)
    for column in ("draft", "B", "L", "τ", "Δt", "multiplier", "memory (GB)", *(c[1] for c in extras)):
        table.add_column(column, justify="left" if column == "draft" else "right")
    for r in rows:
        memory = f"{r['memory_bytes_needed'] / 1e9:.3g}"
        if r["fits"] is False:
            dt, m, memory = "-", "does not fit", f"[red]{memory}[/red]"
        else:
            dt, m = f"{r['delta_t']:.3f}", f"{r['multiplier']:.2f}"
        L = f"{r['L']} (mean)" if "contexts" in r else str(r["L"])
        cells = [fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in extras]
        table.add_row(r["draft"], str(r["B"]), L, f"{r['tau']:.3f}", dt, m, memory, *cells)

    Console(width=None if sys.stdout.isatty() else 160).print(table)  # no truncated columns in pipes


PARSED_HERE = ("B", "L", "tau", "alpha", "contexts", "tau_draft")
"""`spire throughput` options that are strings to parse (grids, DRAFT=VALUE lists), not ThroughputArgs fields."""


def command(p: dict[str, Any], log: Callable[[str], None]) -> None:
    """`spire throughput` from its options ``p`` (by parameter name, as typer parsed them): the rows, written as
    ``p["fmt"]`` (table, json, csv) on stdout, and with ``p["plot"]`` a PNG heatmap (its path through ``log``).
    Raises ConfigError for a malformed option, before any work."""
    plot = p["plot"]
    if plot is not None:
        check_output_path(plot, "--plot")
    given = {name: value for name, value in p.items() if name not in ("fmt", "plot", *PARSED_HERE)}
    parsed = {"Bs": ints("-B", p["B"]), "Ls": ints("-L", p["L"]), "taus": floats(p["tau"], "--tau"),
              "alphas": floats(p["alpha"], "--alpha"),
              "contexts": None if p["contexts"] is None else ints("--contexts", [p["contexts"]]),
              "tau_drafts": names(p["tau_draft"])}
    summary, rows, chosen = build(ThroughputArgs(**given, **parsed))
    if plot is not None:
        log(f"wrote {write_plot(summary, rows, chosen, plot)}")
    if p["fmt"] == "json":
        typer.echo(to_json(summary, rows))
    elif p["fmt"] == "csv":
        typer.echo(to_csv(rows), nl=False)
    else:
        print_table(chosen.name, chosen.description, rows)
