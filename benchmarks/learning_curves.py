"""Learning curves of trained drafts: held-out α against training tokens and against training seconds.

Reads the ``train_log.jsonl`` of run folders (``spire train`` or the main job's runs under
``$SPIRE_CACHE/drafts/``), draws held-out α at the first drafted position and its mean over the k positions,
and writes ``curves.json`` + ``curves.png``.

    python benchmarks/learning_curves.py first2+last6=~/.cache/spire/drafts/smollm2-135m-spire-XXXX \\
        last8=runs/last8 --out measurements/learning-curves
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spire.paths import atomic_write


def read_curve(run: Path) -> dict:
    """{"eval": [{"step", "tokens", "elapsed_s", "alpha_per_position"}], "tokens_per_s"} of one run folder
    (elapsed_s: training seconds at that step, evaluation excluded)."""
    rows = [json.loads(ln) for ln in (run / "train_log.jsonl").read_text().splitlines() if ln.strip()]
    elapsed = {r["step"]: r["elapsed_s"] for r in rows if r.get("event") == "train"}
    evals = [{"step": r["step"], "tokens": r["tokens"], "elapsed_s": elapsed.get(r["step"], 0.0),
              "alpha_per_position": r["alpha_per_position"]} for r in rows if r.get("event") == "eval"]
    last = max(elapsed) if elapsed else 0
    tokens = next((r["tokens"] for r in rows if r.get("event") == "train" and r["step"] == last), 0)
    return {"eval": evals, "tokens_per_s": tokens / max(elapsed.get(last, 0.0), 1e-9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    ap.add_argument("--out", type=Path, default=Path("curves"))
    a = ap.parse_args()
    curves = {}
    for spec in a.runs:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"error: expected LABEL=RUN_DIR, got {spec!r}")
        run = Path(path).expanduser()
        if not (run / "train_log.jsonl").is_file():
            raise SystemExit(f"error: {run} has no train_log.jsonl")
        curves[label] = read_curve(run)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax_tok, ax_s = fig.subplots(1, 2, sharey=True)
    for label, c in curves.items():
        ev = c["eval"]
        first = [e["alpha_per_position"][0] for e in ev]
        mean = [sum(e["alpha_per_position"]) / len(e["alpha_per_position"]) for e in ev]
        for ax, x in ((ax_tok, [e["tokens"] / 1e3 for e in ev]), (ax_s, [e["elapsed_s"] / 60 for e in ev])):
            line, = ax.plot(x, first, "o-", ms=3, label=f"{label}: 1st drafted")
            ax.plot(x, mean, "s--", ms=3, color=line.get_color(), label=f"{label}: mean over k")
    ax_tok.set_xlabel("training tokens (thousands)")
    ax_s.set_xlabel("training minutes (this machine)")
    ax_tok.set_ylabel("held-out α = E[Σ min(p, q)]")
    for ax in (ax_tok, ax_s):
        ax.grid(alpha=0.3)
    ax_s.legend(fontsize=7, loc="lower right")
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write(a.out / "curves.png", lambda f: fig.savefig(f, format="png", dpi=120))
    atomic_write(a.out / "curves.json", None, json.dumps(curves, indent=1))
    for label, c in curves.items():
        e = c["eval"][-1] if c["eval"] else None
        print(f"{label}: {len(c['eval'])} evaluations, {c['tokens_per_s']:.0f} training tokens/s"
              + (f", last at {e['tokens']:,} tokens: α " + " / ".join(f"{x:.3f}" for x in e["alpha_per_position"])
                 if e else ""))
    print(f"wrote {a.out / 'curves.png'} and curves.json")


if __name__ == "__main__":
    main()
