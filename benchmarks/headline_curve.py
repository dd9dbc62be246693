"""The paper's headline against training tokens: τ of SPIRe and EAGLE-3 drafts saved along a long training run,
and SPIRe's modeled multiplier over MagicDec's (and over EAGLE-3's) at (B, L) with paired 95 % CIs.

Each draft (a run folder or a copy of its checkpoint/ taken at some step) is measured with `spire tau` on the main
job's held-out contexts (the same L, G, k, contexts, batch and seed as `spire reproduce`), at T = 0 and T = 1; the
MagicDec τ and the cost model's Δt come from the main job's results.json, whose per-context counts pair every
ratio. Measurements are kept in ``--out/taus/`` (a rerun measures only what is new: resumable), and the curve is
written as ``curve.json`` + ``curve.png``.

    python benchmarks/headline_curve.py --results measurements/reproduce-cpu-long/results.json \\
        spire=/path/to/snap/spire-500 spire=/path/to/snap/spire-1000 spire=RUN_DIR eagle3=... \\
        --out measurements/headline-curve

A draft's tokens are read from its saved train_state.json (checkpoint/), so a copy of a checkpoint taken mid-run
counts the tokens it had seen then. Drafts saved mid-run sit on one cosine schedule: their learning rate was still
high, so they understate what a run that ends at that many tokens would reach.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from spire.evaluation.tau import paired_ratio_ci
from spire.paths import atomic_write

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import portable, write_provenance  # benchmarks/_provenance.py


def train_state(draft: Path) -> dict:
    """The saved training state of a run folder or checkpoint copy (its step, tokens and config)."""
    for path in (draft / "checkpoint" / "train_state.json", draft / "train_state.json"):
        if path.is_file():
            return json.loads(path.read_text())
    raise SystemExit(f"error: {draft} holds no checkpoint/train_state.json")


def measure(kind: str, draft: Path, results: dict, temperatures: list[float], out: Path, threads: int) -> dict:
    """`spire tau` rows of one draft on the main job's contexts, kept in ``out`` (measured once)."""
    if out.is_file():
        return json.loads(out.read_text())
    cfg = results["config"]
    if kind == "spire" and not (draft / "draft.safetensors").is_file():  # a checkpoint copy: its weights
        draft = draft / "checkpoint" / "draft.safetensors"
    cmd = [sys.executable, "-m", "spire", "tau", "--draft", kind, "--draft-path", str(draft), "-L", str(cfg["L"]),
           "-G", str(cfg["G"]), "-k", str(cfg["k"]), "--n-contexts", str(cfg["n_contexts"]), "--seed",
           str(cfg["seed"]), "--batch-size", str(cfg["batch_size"]), "--threads", str(threads),
           "--temperature", ",".join(f"{t:g}" for t in temperatures), "--out", str(out)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def _row(rows: list[dict], draft: str, temperature: float) -> dict | None:
    return next((r for r in rows if r["draft"] == draft and float(r["temperature"]) == temperature), None)


def ratio(a: dict, b: dict, scale: float) -> tuple[float, float, float]:
    """τ_a/τ_b × scale and its paired 95 % bootstrap CI over the shared contexts."""
    arrs = [np.asarray(x, dtype=float) for x in (a["emitted"], a["rounds"], b["emitted"], b["rounds"])]
    lo, hi = paired_ratio_ci(*arrs)
    return a["tau"] / b["tau"] * scale, lo * scale, hi * scale


def curve(results: dict, measured: list[dict], B: int, L: int, temperatures: list[float]) -> list[dict]:
    """One point per (draft, temperature): tokens, τ, and the modeled multiplier over MagicDec's (and SPIRe's over
    the EAGLE-3 draft measured at the nearest tokens, when there is one)."""
    points = []
    for temperature in temperatures:
        key = f"T={temperature:g}"
        cells = {r["draft"]: r for r in results["throughput"]["measured"][key] if r["B"] == B and r["L"] == L}
        magicdec = _row(results["tau"], "magicdec", temperature)
        for m in measured:
            row = _row(m["rows"], m["kind"], temperature)
            if row is None:
                continue
            scale = cells["magicdec"]["delta_t"] / cells[m["kind"]]["delta_t"]
            r, lo, hi = ratio(row, magicdec, scale)
            points.append({"kind": m["kind"], "label": m["label"], "temperature": temperature, "step": m["step"],
                           "tokens": m["tokens"], "train_s": m["train_s"], "tau": row["tau"], "tau_ci": [row["ci_low"], row["ci_high"]],
                           "multiplier": row["tau"] / cells[m["kind"]]["delta_t"],
                           "vs_magicdec": r, "vs_magicdec_ci": [lo, hi]})
    return points


def plot(points: list[dict], path: Path, B: int, L: int, line: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"spire": "tab:blue", "eagle3": "tab:green"}
    for kind, color in styles.items():
        for temperature, marker in ((0.0, "o"), (1.0, "s")):
            pts = sorted((p for p in points if p["kind"] == kind and p["temperature"] == temperature),
                         key=lambda p: p["tokens"])
            if not pts:
                continue
            x = [p["tokens"] / 1e6 for p in pts]
            for ax, y, ci in ((axes[0], "tau", "tau_ci"), (axes[1], "vs_magicdec", "vs_magicdec_ci")):
                v = np.array([p[y] for p in pts])
                err = np.array([[p[y] - p[ci][0] for p in pts], [p[ci][1] - p[y] for p in pts]])
                ax.errorbar(x, v, yerr=err, color=color, marker=marker, capsize=3,
                            label=f"{kind} T={temperature:g}", linestyle="-" if temperature == 0 else "--")
    axes[0].set(xlabel="training tokens (M)", ylabel="τ (tokens per round)", title="τ at L = %d (95 %% CI)" % L)
    axes[1].axhline(line, color="gray", linestyle=":", label=f"{line}× (the paper's claim)")
    axes[1].axhline(1.0, color="black", linewidth=0.5)
    axes[1].set(xlabel="training tokens (M)", ylabel="modeled multiplier / MagicDec's",
                title=f"over MagicDec at (B, L) = ({B}, {L}) (paired 95 % CI)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafts", nargs="+", metavar="KIND=PATH", help="spire=... or eagle3=...: a run folder or a "
                    "checkpoint copy (with checkpoint/train_state.json)")
    ap.add_argument("--results", type=Path, required=True, help="the main job's results.json (MagicDec's τ, Δt)")
    ap.add_argument("--out", type=Path, default=Path("headline-curve"))
    ap.add_argument("--at", default="64,512", metavar="B,L")
    ap.add_argument("--line", type=float, default=1.35)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    results = json.loads(a.results.read_text())
    B, L = (int(x) for x in a.at.split(","))
    temperatures = [float(t) for t in results["config"]["temperatures"]]
    (a.out / "taus").mkdir(parents=True, exist_ok=True)
    measured = []
    for spec in a.drafts:
        kind, _, path = spec.partition("=")
        if kind not in ("spire", "eagle3") or not path:
            raise SystemExit(f"error: expected spire=PATH or eagle3=PATH, got {spec!r}")
        draft = Path(path).expanduser().resolve()
        state = train_state(draft)
        label = f"{kind}-{draft.name}-step{state['step']}"
        got = measure(kind, draft, results, temperatures, a.out / "taus" / f"{label}.json", a.threads)
        measured.append({"kind": kind, "label": label, "path": str(draft), "step": state["step"],
                         "tokens": state["tokens"], "train_s": state.get("elapsed_s"), "rows": got["rows"]})
    points = curve(results, measured, B, L, temperatures)
    for p in sorted(points, key=lambda p: (p["temperature"], p["kind"], p["tokens"])):
        print(f"T={p['temperature']:g} {p['kind']:6s} {p['tokens']:>10,} tokens: tau {p['tau']:.3f} "
              f"[{p['tau_ci'][0]:.3f}, {p['tau_ci'][1]:.3f}]  x MagicDec {p['vs_magicdec']:.3f} "
              f"[{p['vs_magicdec_ci'][0]:.3f}, {p['vs_magicdec_ci'][1]:.3f}]")
    atomic_write(a.out / "curve.json", None, text=json.dumps(
        {"at": [B, L], "line": a.line, "results": portable(str(a.results)), "command": portable(" ".join(sys.argv)),
         "points": points}, indent=1))
    write_provenance(a.out)
    plot(points, a.out / "curve.png", B, L, a.line)
    print(a.out / "curve.json")


if __name__ == "__main__":
    main()
