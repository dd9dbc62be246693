"""Output of ``spire bench``: a rich table, the JSON object and a markdown report (predicted vs measured)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from spire.paths import atomic_write

COLUMNS = [  # (header, row key, format) of the table and the markdown report
    ("B", "B", "{}"),
    ("L", "L", "{}"),
    ("draft", "draft", "{}"),
    ("t_AD ms", "t_ad_s", "ms"),
    ("t_verify ms", "t_verify_s", "ms"),
    ("t_draft ms", "t_draft_s", "ms"),
    ("Δt meas.", "delta_t_measured", "{:.2f}"),
    ("Δt pred.", "delta_t_predicted", "{:.2f}"),
    ("pred/meas", "delta_t_ratio", "{:.2f}"),
    ("Δt pred. sum", "delta_t_predicted_sum", "{:.2f}"),
    ("τ", "tau", "{:.2f}"),
    ("AD tok/s", "ad_tokens_per_s", "{:.1f}"),
    ("SD tok/s", "sd_tokens_per_s", "{:.1f}"),
    ("mult. meas.", "multiplier_measured", "{:.2f}"),
    ("mult. pred.", "multiplier_predicted", "{:.2f}"),
    ("pred/meas ", "multiplier_ratio", "{:.2f}"),
    ("regime", "memory_bound", "regime"),
]


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    if fmt == "ms":
        return f"{v * 1e3:.1f}"
    if fmt == "regime":
        return "memory" if v else "compute"
    return fmt.format(v)


def print_table(result: dict[str, Any], title: str = "spire bench") -> None:
    """A rich table of every (B, L, draft) row, predicted beside measured."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption="Δt = (k·t_draft + t_verify)/t_AD; multiplier = SD tok/s ÷ AD tok/s "
                                       "(pred.: τ ÷ predicted Δt); regime: verify on the cost model's roofline")
    for header, _, _ in COLUMNS:
        table.add_column(header, justify="left" if header in ("draft", "regime") else "right")
    for r in result["rows"]:
        cells = [_cell(r, key, fmt) for _, key, fmt in COLUMNS]
        ratio = r.get("delta_t_ratio")
        if ratio is not None and r["memory_bound"]:
            style = "green" if abs(ratio - 1) <= 0.2 else "red"
            cells[8] = f"[{style}]{cells[8]}[/{style}]"  # the pred/meas column
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def markdown(result: dict[str, Any], summary: dict[str, Any]) -> str:
    """The markdown report: setup, the predicted-vs-measured table, goals, a note per cell."""
    cfg = result["config"]
    hw = result.get("calibration") or {}
    lines = ["# spire bench: measured vs predicted throughput", ""]
    wb = result.get("weight_bytes")
    bf16w = " with weight-only bf16 (2 bytes per weight value)" if wb == 2 and result["dtype"] == "fp32" else ""
    dwb = result.get("draft_weight_bytes", wb)
    if dwb != wb:
        name = result.get("draft_weights") or ("bf16" if dwb == 2 else None)
        bf16w += f"; the SPIRe / vanilla draft's own weights at {dwb:g} bytes per value" + (f" ({name})" if name else "")
    lines.append(f"Target `{result.get('target', '?')}`, dtype {result['dtype']}{bf16w}, device {result['device']}"
                 + (f" ({hw.get('device_name')})" if hw else "") + f", k = {cfg['k']}, G = {cfg['G']} tokens per "
                 f"row, MagicDec sink {cfg['sink']} + window {cfg['window']}, {cfg['reps']} timed reps per forward"
                 + (f"; τ and tokens/s over {cfg['contexts']} groups of B held-out contexts"
                    if cfg.get("contexts", 1) > 1 else "") + ".")
    if hw:
        d = hw["dtypes"].get(result["dtype"], {})
        lines.append(f"Calibration: matmul {d.get('matmul_flops', 0) / 1e9:,.1f} GFLOP/s, read bandwidth "
                     f"{d.get('bandwidth', 0) / 1e9:,.1f} GB/s → HOI {result['hoi']:.2f} FLOP/byte"
                     + (" (quick calibration: cache-resident, indicative only)" if hw.get("quick") else "") + ".")
    else:
        given = "the paper's" if result["hoi"] == 600 else "given"
        lines.append(f"No calibration: HOI {result['hoi']:g} FLOP/byte ({given}).")
    if result.get("threads"):
        lines.append(f"torch threads: {result['threads']}; clock: {cfg.get('clock', 'wall')}.")
    lines.append("")
    for name, source in (result.get("drafts") or {}).items():
        lines.append(f"- draft {name}: {source}")
    for msg in result.get("skipped", []):
        lines.append(f"- skipped {msg}")
    lines += ["", "| " + " | ".join(h.strip() for h, _, _ in COLUMNS) + " |",
              "|" + "---|" * len(COLUMNS)]
    for r in result["rows"]:
        lines.append("| " + " | ".join(_cell(r, key, fmt) for _, key, fmt in COLUMNS) + " |")
    lines += ["", "Δt meas. = (k·t_draft + t_verify)/t_AD from timed forwards; Δt pred. = the cost model for the "
              "same shapes on the calibrated roofline (real bytes per value, unembedding and attention FLOPs "
              f"counted, combine {cfg['combine']}); Δt pred. sum = the same with compute and memory time added "
              "(no overlap); mult. meas. = SD tokens/s ÷ AD tokens/s of real greedy runs (prefill excluded); "
              "mult. pred. = τ ÷ Δt pred.", ""]
    lines.append("## Goals")
    lines.append("")
    lines.append(f"- Δt predicted within {summary['tolerance']:.0%} in memory-bound cells: "
                 f"{summary['within_tolerance']} of {summary['memory_bound_cells']}"
                 + (f" (geometric mean of pred/meas over all cells {summary['delta_t_ratio_geomean']:.2f})"
                    if summary.get("delta_t_ratio_geomean") else "") + ".")
    g = summary.get("long_context_batch_goal")
    if g is None:
        lines.append("- (B, L) = (16, 4096), SPIRe ≥ 1.5× AD and above MagicDec: not measured in this run "
                     "(cell or SPIRe draft missing).")
    else:
        md = g["magicdec_multiplier"]
        lines.append(f"- (B, L) = (16, 4096): SPIRe {g['spire_multiplier']:.2f}× AD, MagicDec "
                     + (f"{md:.2f}×" if md is not None else "-") + f": {'met' if g['met'] else 'not met'}.")
    identical = [r for r in result["rows"] if r.get("identical_to_ad") is False]
    if result["dtype"] == "fp32":
        lines.append(f"- Greedy SD output identical to AD (float32): "
                     f"{'yes, every row' if not identical else f'NO in {len(identical)} rows'}.")
    lines += ["", "## Per cell", ""]
    for r in result["rows"]:
        lines.append(f"- B={r['B']}, L={r['L']}, {r['draft']}: {r['note']}.")
    return "\n".join(lines) + "\n"


def write_outputs(result: dict[str, Any], summary: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``out/bench.json`` (everything) and ``out/BENCH.md`` atomically; returns both paths."""
    out = Path(out)
    j = atomic_write(out / "bench.json", None, text=json.dumps({**result, "summary": summary}, indent=1) + "\n")
    m = atomic_write(out / "BENCH.md", None, text=markdown(result, summary))
    return j, m
