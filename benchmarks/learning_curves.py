"""Learning curves of trained drafts: held-out α against training tokens and against training seconds.

Reads the ``train_log.jsonl`` of run folders (``spire train`` or the main job's runs under
``$SPIRE_CACHE/drafts/``), draws held-out α at the first drafted position and its mean over the k positions,
and, for SPIRe runs on a preset's target, the modeled throughput multiplier at ``--at B,L`` (the paper's cost
model, HOI 600): τ estimated from the held-out α by drafted position as 1 + α1 + α1·α2 + ... (each position's
acceptance given the earlier ones accepted, as at T = 1), over the Δt of a draft of the run's layer count. This
is the number that decides a draft's size: a smaller draft has a smaller Δt and trains faster, a larger one a
higher α. ``--magicdec-tau`` draws ratio × MagicDec's multiplier for comparison. Writes ``curves.json`` +
``curves.png``.

    python benchmarks/learning_curves.py first2+last6=~/.cache/spire/drafts/smollm2-135m-spire-XXXX \\
        last8=runs/last8 --out measurements/learning-curves --magicdec-tau 3.094
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spire.paths import atomic_write

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # benchmarks/_provenance.py


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


def spire_settings(run: Path) -> dict | None:
    """The SPIRe run's saved settings (its TrainConfig as a dict), or None: not a SPIRe run, or no saved state."""
    state = run / "checkpoint" / "train_state.json"
    if not state.is_file():
        return None
    cfg = json.loads(state.read_text()).get("config", {})
    return cfg if cfg.get("draft") == "spire" else None


def modeled_layers(cfg: dict | None) -> int | None:
    """The layer count the cost model's SPIRe draft takes for a run, or None where that model does not describe
    the draft (not SPIRe; a dense draft KV cache, which the paper's Δt does not count)."""
    if cfg is None:
        return None
    spire = cfg.get("spire") or {}
    if spire.get("window") is None:
        return None
    return len(spire["layers"]) if spire.get("layers") else spire.get("n_draft_layers")


def tau_estimate(alphas: list[float]) -> float:
    """1 + Σ_j Π_{i<=j} α_i: expected tokens per round when drafted position i is accepted with probability α_i
    given the earlier ones were (bonus included; :func:`spire.throughput.cost_model.tau_from_alpha` for i.i.d. α)."""
    tau, run = 1.0, 1.0
    for a in alphas:
        run *= a
        tau += run
    return tau


def add_multipliers(curves: dict, preset: str, B: int, L: int) -> float:
    """Adds "n_draft_layers", "delta_t" and per evaluation "tau_estimate" and "multiplier" to SPIRe curves;
    returns MagicDec's Δt at (B, L)."""
    from spire.throughput.cost_model import delta_t
    from spire.throughput.shapes import get_preset

    from spire.errors import ConfigError

    try:
        p = get_preset(preset)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    for label, c in curves.items():
        n = c.get("n_draft_layers")
        if n is None:
            continue
        top = max(c.get("source_layers") or [0])
        if n > p.target.n_layers or top >= p.target.n_layers:
            raise SystemExit(f"error: run {label!r} prunes target layers up to {top}, beyond the {p.target.n_layers} "
                             f"layers of preset {preset!r}: give the run's own target with --preset")
        c["delta_t"] = delta_t((p.target, p.target.with_layers(n)), "spire", B, L, k=c["k"])
        for e in c["eval"]:
            e["tau_estimate"] = tau_estimate(e["alpha_per_position"])
            e["multiplier"] = e["tau_estimate"] / c["delta_t"]
    ks = {c["k"] for c in curves.values() if "delta_t" in c}
    return delta_t(p, "magicdec", B, L, k=ks.pop() if len(ks) == 1 else 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    ap.add_argument("--out", type=Path, default=Path("curves"))
    ap.add_argument("--preset", default="smollm2-135m", help="target shapes of the cost model")
    ap.add_argument("--at", default="64,512", metavar="B,L", help="where the multiplier is modeled")
    ap.add_argument("--magicdec-tau", type=float, help="MagicDec's measured τ: draws ratio x its multiplier")
    ap.add_argument("--ratio", type=float, default=1.35, help="the line drawn at ratio x MagicDec's multiplier")
    a = ap.parse_args()
    try:
        B, L = (int(v) for v in a.at.split(","))
    except ValueError:
        raise SystemExit(f"error: --at expects B,L (e.g. 64,512), got {a.at!r}") from None
    if B < 1 or L < 1:
        raise SystemExit(f"error: --at expects a positive batch size and context length, got {a.at!r}")
    curves = {}
    for spec in a.runs:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"error: expected LABEL=RUN_DIR, got {spec!r}")
        run = Path(path).expanduser()
        if not (run / "train_log.jsonl").is_file():
            raise SystemExit(f"error: {run} has no train_log.jsonl")
        if label.startswith("_"):
            raise SystemExit(f"error: a label may not start with '_' (curves.json keeps its metadata there): {label!r}")
        settings = spire_settings(run)
        spire = (settings or {}).get("spire") or {}
        curves[label] = {**read_curve(run), "n_draft_layers": modeled_layers(settings),
                         "k": (settings or {}).get("k", 4), "source_layers": spire.get("layers")}
    md_dt = add_multipliers(curves, a.preset, B, L)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 3.6), layout="constrained")
    ax_tok, ax_s, ax_m = fig.subplots(1, 3)
    ax_s.sharey(ax_tok)
    for label, c in curves.items():
        ev = c["eval"]
        first = [e["alpha_per_position"][0] for e in ev]
        mean = [sum(e["alpha_per_position"]) / len(e["alpha_per_position"]) for e in ev]
        for ax, x in ((ax_tok, [e["tokens"] / 1e3 for e in ev]), (ax_s, [e["elapsed_s"] / 60 for e in ev])):
            line, = ax.plot(x, first, "o-", ms=3, label=f"{label}: 1st drafted")
            ax.plot(x, mean, "s--", ms=3, color=line.get_color(), label=f"{label}: mean over k")
        if "delta_t" in c:
            ax_m.plot([e["elapsed_s"] / 60 for e in ev], [e["multiplier"] for e in ev], "o-", ms=3,
                      color=line.get_color(), label=f"{label} ({c['n_draft_layers']} layers, Δt {c['delta_t']:.3f})")
    if a.magicdec_tau:
        for r, style in ((1.0, ":"), (a.ratio, "--")):
            ax_m.axhline(r * a.magicdec_tau / md_dt, color="gray", ls=style, lw=1,
                         label=f"{r:g} × MagicDec (τ {a.magicdec_tau:g})")
    ax_m.set_xlabel("training minutes (this machine)")
    ax_m.set_ylabel(f"modeled multiplier at (B, L) = ({B}, {L})")
    ax_m.grid(alpha=0.3)
    if ax_m.get_legend_handles_labels()[0]:
        ax_m.legend(fontsize=7, loc="lower right")
    else:
        ax_m.text(0.5, 0.5, "no SPIRe run with a sink + window cache to model", ha="center", va="center",
                  transform=ax_m.transAxes, fontsize=8)
    ax_tok.set_xlabel("training tokens (thousands)")
    ax_s.set_xlabel("training minutes (this machine)")
    ax_tok.set_ylabel("held-out α = E[Σ min(p, q)]")
    for ax in (ax_tok, ax_s):
        ax.grid(alpha=0.3)
    ax_s.legend(fontsize=7, loc="lower right")
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write(a.out / "curves.png", lambda f: fig.savefig(f, format="png", dpi=120))
    meta = {"at": {"B": B, "L": L}, "preset": a.preset, "magicdec_tau": a.magicdec_tau,
            "magicdec_delta_t": md_dt, "ratio": a.ratio}
    atomic_write(a.out / "curves.json", None, json.dumps({**curves, "_model": meta}, indent=1))
    write_provenance(a.out)
    for label, c in curves.items():
        e = c["eval"][-1] if c["eval"] else None
        print(f"{label}: {len(c['eval'])} evaluations, {c['tokens_per_s']:.0f} training tokens/s"
              + (f", last at {e['tokens']:,} tokens: α " + " / ".join(f"{x:.3f}" for x in e["alpha_per_position"])
                 if e else "")
              + (f"; τ est. {e['tau_estimate']:.3f}, modeled multiplier {e['multiplier']:.3f} at ({B}, {L})"
                 if e and "multiplier" in e else ""))
    if a.magicdec_tau:
        print(f"MagicDec (τ {a.magicdec_tau:g}): multiplier {a.magicdec_tau / md_dt:.3f}; {a.ratio:g}× that is "
              f"{a.ratio * a.magicdec_tau / md_dt:.3f}")
    print(f"wrote {a.out / 'curves.png'} and curves.json")


if __name__ == "__main__":
    main()
