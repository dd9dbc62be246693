"""REPORT.md, results.json and figures of ``spire reproduce``. Every file is written atomically."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

import spire.registry as registry
from spire.backend import summary_of as backend_line
from spire.evaluation.diagnose import diagnosis_markdown, plot_diagnosis
from spire.evaluation.tau import paired_ratio_ci
from spire.paper import PAPER_ABLATION_TAU
from spire.paths import atomic_write, spire_cache_dir
from spire.throughput import RowOptions, get_preset, throughput_rows
from spire.throughput.cost_model import delta_t
from spire.throughput.analysis import NO_SPARSE_KV, ablation_rows
from spire.throughput.shapes import PAPER_TAUS, ModelShape, Preset
from spire.throughput.plots import plot_ablation, plot_multiplier_heatmaps, plot_multiplier_vs_L

MEASURED = registry.names(drafts_only=True)  # the draft kinds whose τ the main job measures (those it has)
PAPER_TAU = {n: registry.kind(n).paper_tau for n in MEASURED if registry.kind(n).paper_tau}  # 67M target, L = 512
ABLATION_LABELS = {"none": "SPIRe (same budget)", "no-feedback": "no feedback memory", "no-feedback-no-target": "no feedback, no target activations",
                   "omega1": "ω = 1 (pure distillation)", "hard-loss": "HardTargetLoss",
                   "random-init": "random initialization", "full-kv": "full KV cache (no sparse KV)"}


def _tau_of(results: dict, draft: str, temperature: float) -> dict | None:
    return next((t for t in results["tau"] if t["draft"] == draft and t["temperature"] == temperature), None)


def alpha_for_tau(tau: float, k: int) -> float | None:
    """The per-token acceptance α with τ = (1 − α^(k+1)) / (1 − α) (Leviathan et al. 2023, i.i.d. model);
    None when τ is outside [1, k + 1). Bisection, to 1e-6."""
    if not 1.0 <= tau < k + 1:
        return None
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(60):
        a = (lo + hi) / 2
        if (1 - a ** (k + 1)) / (1 - a) < tau:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def goal_check(rows: list[dict], B: int, L: int, k: int, target_ratio: float = 1.35) -> dict | None:
    """Issue 6's goal at (B, L): SPIRe's multiplier over MagicDec's and vanilla's, the share of grid cells where
    SPIRe is the best option, and the τ (and i.i.d. α) SPIRe would need for ``target_ratio`` × MagicDec."""
    at = {r["draft"]: r for r in rows if r["B"] == B and r["L"] == L}
    base = registry.BASELINE
    if not {"spire", base} <= set(at):
        return None
    cells = {(r["B"], r["L"]) for r in rows}

    def winner(c) -> str:  # autoregressive decoding wins a cell where no draft's multiplier exceeds 1
        top = max((r for r in rows if (r["B"], r["L"]) == c), key=lambda r: r["multiplier"])
        return top["draft"] if top["multiplier"] > 1.0 else "ad"
    best = [winner(c) for c in cells]
    need = target_ratio * at[base]["multiplier"] * at["spire"]["delta_t"]
    return {"B": B, "L": L, "spire_vs_magicdec": at["spire"]["multiplier"] / at[base]["multiplier"],
            "spire_vs_vanilla": (at["spire"]["multiplier"] / at["vanilla"]["multiplier"]) if "vanilla" in at else None,
            "spire_best_share": best.count("spire") / len(best), "tau_needed": need,
            "alpha_needed": alpha_for_tau(need, k)}


def multiplier_ratio_ci(results: dict, rows: list[dict], temperature: float, B: int, L: int, a: str = "spire",
                        b: str = registry.BASELINE) -> list[float] | None:
    """95 % CI of draft a's modeled multiplier over draft b's at (B, L) (default SPIRe over MagicDec): the paired
    bootstrap CI of τ_a / τ_b over the shared contexts (:func:`spire.evaluation.tau.paired_ratio_ci`) times
    Δt_b / Δt_a (the cost model's Δt has no sampling error). None when either τ or its per-context counts are
    missing (a τ taken from an older measurement cache)."""
    s, m = _tau_of(results, a, temperature), _tau_of(results, b, temperature)
    if not (s and m and s.get("emitted") and m.get("emitted")) or len(s["emitted"]) != len(m["emitted"]):
        return None
    at = {r["draft"]: r for r in rows if r["B"] == B and r["L"] == L}
    lo, hi = paired_ratio_ci(*(np.asarray(x, dtype=float) for x in (s["emitted"], s["rounds"], m["emitted"],
                                                                   m["rounds"])))
    if a not in at or b not in at:
        return None
    scale = at[b]["delta_t"] / at[a]["delta_t"]
    return [lo * scale, hi * scale]


def best_k_rows(results: dict, preset: Preset, Bs, Ls) -> list[dict]:
    """The best k per (B, L) and draft from the measured τ-vs-k sweep (greedy, at the job's L): the k that
    maximizes τ(k)/Δt(k) under the cost model, with that multiplier. [] without a sweep."""
    sweep = results.get("tau_vs_k") or []
    taus: dict[str, dict[int, float]] = {}
    for r in sweep:
        taus.setdefault(r["draft"], {})[int(r["k"])] = float(r["tau"])
    rows = []
    for B in Bs:
        for L in Ls:
            for d in (n for n in MEASURED if n in taus):
                mult = {k: tau / delta_t(preset, d, B, L, k) for k, tau in taus[d].items()}
                best = max(mult, key=mult.get)
                rows.append({"draft": d, "B": B, "L": L, "best_k": best, "tau": taus[d][best],
                             "multiplier": mult[best], "multiplier_by_k": mult})
    return rows


def target_preset(target: dict, n_draft_layers: int) -> Preset:
    """Cost-model shapes of the measured target: SPIRe = its last n_draft_layers blocks, vanilla ≈ 1/8 of
    its layers at the same width (the paper's vanilla draft has about 1/8 of the body parameters)."""
    c = target["config"]
    shape = ModelShape(c["n_layers"], c["d_model"], c["n_heads"] // c["n_kv_heads"], c["n_kv_heads"],
                       c["d_head"], c["d_ff"])
    return Preset(name=target["name"], target=shape,
                  drafts={"vanilla": shape.with_layers(max(1, round(c["n_layers"] / 8))),
                          "spire": shape.with_layers(n_draft_layers)},
                  taus=dict(PAPER_TAUS), tau_source="measured", description=f"{target['name']} shapes")


def _plot_training(history: list[dict], path: Path, heldout: list[dict] | None = None) -> None:
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    tokens = [h["tokens"] / 1e3 for h in history]
    ax.plot(tokens, [h["alpha"] for h in history], label="train α (EMA)")
    if heldout:
        x = [h["tokens"] / 1e3 for h in heldout]
        ax.plot(x, [h["alpha_per_position"][0] for h in heldout], "o-", ms=3, label="held-out α, 1st drafted")
        ax.plot(x, [sum(h["alpha_per_position"]) / len(h["alpha_per_position"]) for h in heldout], "s--", ms=3,
                label="held-out α, mean over k")
    ax.set_xlabel("training tokens (thousands)")
    ax.set_ylabel("α = E[Σ min(p, q)]")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")  # α rises from low values: the top left stays clear of the curves
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))


def _plot_tau_vs_k(rows: list[dict], path: Path, title: str) -> None:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for d in MEASURED:
        pts = sorted((r["k"], r["tau"], r["ci_low"], r["ci_high"]) for r in rows if r["draft"] == d)
        if pts:
            ks, t, lo, hi = zip(*pts)
            ax.errorbar(ks, t, yerr=[np.subtract(t, lo), np.subtract(hi, t)], marker="o", capsize=3, label=d)
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("τ (tokens per round)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_tau_vs_L(rows: list[dict], path: Path, title: str) -> None:
    fig = Figure(figsize=(6.5, 3.4), layout="constrained")
    ax = fig.subplots()
    for d in MEASURED:
        pts = sorted((r["L"], r["tau"], r["ci_low"], r["ci_high"]) for r in rows if r["draft"] == d)
        if pts:
            L, tau, lo, hi = zip(*pts)
            ax.errorbar(L, tau, yerr=[[t - a for t, a in zip(tau, lo)], [b - t for t, b in zip(tau, hi)]],
                        marker="o", capsize=3, label=d)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel("τ (tokens per round)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))


def _ablation_rows(results: dict, cfg, preset: Preset, temperature: float) -> list[dict]:
    """Figure 5 from measured τ: each trained ablation's multiplier over L at B = 64 (full-KV ablation with a
    full draft KV cache in the cost model, the others with SPIRe's sink + window costs)."""
    ref = "spire-none" if "none" in cfg.ablations else "spire"
    taus = {"SPIRe": _tau_of(results, ref, temperature)["tau"]}
    for a in cfg.ablations:
        if a not in ("full-kv", "none"):
            taus[ABLATION_LABELS[a]] = _tau_of(results, f"spire-{a}", temperature)["tau"]
    Ls = sorted(set(cfg.grid_L) | {cfg.L})
    rows = [r for r in ablation_rows(preset, Ls, 64, cfg.k, taus=taus) if r["variant"] != NO_SPARSE_KV]
    if "full-kv" in cfg.ablations:
        tau_full = _tau_of(results, "spire-full-kv", temperature)["tau"]
        rows += [dict(r, variant=ABLATION_LABELS["full-kv"]) for r in
                 ablation_rows(preset, Ls, 64, cfg.k, taus={"SPIRe": tau_full}) if r["variant"] == NO_SPARSE_KV]
    return rows


def write_report(results: dict, cfg, t_start: float) -> Path:
    """Compute the throughput grids from the measured τ, draw the figures, write results.json and REPORT.md
    (last) into cfg.out. Returns the report path."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = target_preset(results["target"], cfg.n_draft_layers)
    name = results["target"]["name"]
    figures, grids, goals, ablations = [], {}, {}, {}
    B_main = 64 if 64 in cfg.grid_B else max(cfg.grid_B)
    for temperature in cfg.temperatures:
        key = f"T={temperature:g}"
        taus = {d: _tau_of(results, d, temperature)["tau"] for d in MEASURED if _tau_of(results, d, temperature)}
        rows = [dict(r, tau_source=f"measured ({key}, L={cfg.L})")
                for r in throughput_rows(preset, cfg.grid_B, sorted(set(cfg.grid_L) | {cfg.L}),
                                          RowOptions(k=cfg.k, taus=taus))
                if r["draft"] in MEASURED]
        grids[key] = rows
        goals[key] = goal_check(rows, B_main, cfg.L, cfg.k)
        if goals[key] is not None:
            goals[key]["spire_vs_magicdec_ci"] = multiplier_ratio_ci(results, rows, temperature, B_main, cfg.L)
            at = {r["draft"]: r for r in rows if r["B"] == B_main and r["L"] == cfg.L}
            if "eagle3" in at:
                goals[key]["spire_vs_eagle3"] = at["spire"]["multiplier"] / at["eagle3"]["multiplier"]
                goals[key]["spire_vs_eagle3_ci"] = multiplier_ratio_ci(results, rows, temperature, B_main, cfg.L,
                                                                       "spire", "eagle3")
        fig = f"throughput_measured_T{temperature:g}.png"
        plot_multiplier_heatmaps(rows, out / fig, f"{name}, measured τ ({key}): "
                                                  f"modeled throughput multiplier τ/Δt (HOI 600)")
        figures.append(fig)
        fig = f"multiplier_vs_L_measured_T{temperature:g}.png"
        plot_multiplier_vs_L(rows, out / fig, B=B_main, title=f"{name}, measured τ ({key})")
        figures.append(fig)
        if cfg.ablations:
            ablations[key] = _ablation_rows(results, cfg, preset, temperature)
            fig = f"fig5_ablations_measured_T{temperature:g}.png"
            plot_ablation(ablations[key], out / fig, f"Figure 5 on {name}: measured τ of each ablation ({key}), "
                                                     "B = 64")
            figures.append(fig)
    if results.get("diagnosis"):
        plot_diagnosis(results["diagnosis"], out / "diagnosis_T1.png")
        figures.append("diagnosis_T1.png")
    if results.get("tau_vs_L"):
        _plot_tau_vs_L(results["tau_vs_L"], out / "tau_vs_L.png",
                       f"{name}: τ against context length (greedy, G = {cfg.G}, k = {cfg.k})")
        figures.append("tau_vs_L.png")
    paper = get_preset("paper-67m")
    paper_rows = throughput_rows(paper, sorted({*cfg.grid_B, 64}), [2 ** i for i in range(3, 14)], RowOptions(k=4))
    plot_multiplier_heatmaps(paper_rows, out / "throughput_paper67m.png",
                             "Paper 67M target with the paper's τ (L = 512): the paper's setting")
    figures.append("throughput_paper67m.png")
    if results["training"]["history"]:
        _plot_training(results["training"]["history"], out / "training_alpha.png",
                       results["training"].get("heldout_curve"))
        figures.append("training_alpha.png")
    best_k = best_k_rows(results, preset, cfg.grid_B, sorted(set(cfg.grid_L) | {cfg.L}))
    if results.get("tau_vs_k"):
        _plot_tau_vs_k(results["tau_vs_k"], out / "tau_vs_k.png",
                       f"{name}: τ against k (greedy, L = {cfg.L}, G = {cfg.G})")
        figures.append("tau_vs_k.png")
    results["throughput"] = {"measured": grids, "paper_67m": paper_rows, "goal": goals, "ablations": ablations,
                             "best_k": best_k}
    results["figures"] = figures
    results["timings"]["total_s"] = time.time() - t_start
    atomic_write(out / "results.json", None, json.dumps(results, indent=1))
    report = out / "REPORT.md"
    atomic_write(report, None, _markdown(results, cfg))
    return report


def _flatness_lines(rows: list[dict]) -> list[str]:
    """Does τ stay flat with L? Per draft: flat when one value lies inside every L's 95 % CI (the CIs share
    a point), else the L with the lowest and highest τ. Each L uses its own contexts, so content differs too."""
    lines = ["Does τ stay flat with L (the paper's assumption)? Each L has its own contexts (cut from documents long "
             "enough for it), so a difference between two L mixes context length with content; `spire tau "
             "--nested` measures every L on the same texts (docs/tau.md).", ""]
    for d in MEASURED:
        by_L = sorted((r for r in rows if r["draft"] == d), key=lambda r: r["L"])
        if len(by_L) < 2:
            continue
        lo, hi = min(by_L, key=lambda r: r["tau"]), max(by_L, key=lambda r: r["tau"])
        span = f"lowest τ {lo['tau']:.2f} at L = {lo['L']}, highest {hi['tau']:.2f} at L = {hi['L']}"
        if max(r["ci_low"] for r in by_L) <= min(r["ci_high"] for r in by_L):
            lines.append(f"- {d}: flat within the 95 % CIs over L = {by_L[0]['L']}..{by_L[-1]['L']} ({span}).")
        else:
            lines.append(f"- {d}: not flat: {span}; some CIs do not overlap.")
    return lines + [""]


def _reuse_note(results: dict) -> str:
    """Say which numbers this run took from the caches (finished drafts, earlier τ measurements)."""
    rows = results.get("tau", []) + results.get("tau_vs_L", [])
    n_cached = sum(1 for r in rows if r.get("cached"))
    if not n_cached:
        return ""
    return (f" {n_cached} of {len(rows)} τ measurements were taken from the measurement cache "
            f"(`{spire_cache_dir() / 'tau'}`, same target, draft run, contexts and settings) rather than measured "
            "again, "
            "so the wall time is not the cost of the job.")


def _fmt_tau(t: dict | None) -> str:
    return "–" if t is None else f"{t['tau']:.3f} [{t['ci_low']:.3f}, {t['ci_high']:.3f}]"


def _training_lines(results: dict, cfg) -> list[str]:
    trs = results.get("trainings") or {"spire": results["training"]}
    lines = ["| draft | body params | loss | steps | tokens | minutes | tokens/s | held-out α by drafted position |",
             "|---|---|---|---|---|---|---|---|"]
    for label, tr in trs.items():
        loss = {"mixed": f"MixedLoss(ω = {tr['omega']})", "hard": "HardTargetLoss",
                "kl": "KL over the draft vocabulary (speculators)"}.get(tr.get("loss", "mixed"), tr.get("loss"))
        lines.append(f"| {label} | {tr['draft_body_params'] / 1e6:.1f} M | {loss} | {tr['steps']} | {tr['tokens']:,} | "
                     f"{tr['elapsed_s'] / 60:.1f} | {tr['tokens'] / max(tr['elapsed_s'], 1e-9):.0f} | "
                     + ", ".join(f"{a:.3f}" for a in tr["heldout_alpha_per_position"]) + " |")
    tr = trs["spire"]
    first = getattr(cfg, "first_layers", 0)
    layers = tr.get("source_layers")
    origin = (f"the target's last {cfg.n_draft_layers}" if not first else
              f"the target's first {first} and last {cfg.n_draft_layers - first}")
    beyond = []
    if first:
        beyond.append(f"**beyond the paper**: the pruned blocks are {origin} layers{f' {layers}' if layers else ''} "
                      "(the paper prunes the last layers; `--first-layers 0` gives that back)")
    if tr.get("draft_vocab"):
        beyond.append(f"**beyond the paper**: the draft's head covers the {tr['draft_vocab']:,} most frequent "
                      "training tokens (q = 0 elsewhere, verification stays lossless; `--draft-vocab 0` gives the "
                      "whole vocabulary)")
    if tr.get("bridge"):
        b, src = tr["bridge"], layers or []
        into = f" (target layer {src[b['layer']]})" if b["layer"] < len(src) else ""
        beyond.append(f"**beyond the paper**: the residual stream entering draft layer {b['layer']}{into} passes an "
                      f"affine map (trained), first fitted by least squares to the target's own stream there "
                      f"(in-sample R² {b['r2']:.3f} on 32 training windows); `--no-bridge` gives the paper's draft")
    if tr.get("hidden_weight"):
        beyond.append(f"**beyond the paper**: SPIRe's loss adds {tr['hidden_weight']:g} × the mismatch between a "
                      "drafted position's residual stream entering each draft layer and the target's entering that "
                      "layer's source layer (`--hidden-loss 0` gives the paper's loss)")
    if tr.get("target_cache"):
        c = tr["target_cache"]
        beyond.append(f"the target ran once over {c['batches']} batches ({c['tokens']:,} tokens, stored as "
                      f"{c['dtype']}) and SPIRe trained {tr['tokens'] / max(c['tokens'], 1):.1f} epochs over them "
                      f"(ablations reuse the same cache)")
    shares = ""
    if "vanilla" in trs:
        shares = (f" Vanilla got {trs['vanilla']['tokens'] / max(tr['tokens'], 1):.2f}× SPIRe's training tokens "
                  f"({trs['vanilla']['tokens']:,} against {tr['tokens']:,}).")
    by_steps = getattr(cfg, "steps", None) is not None
    if "eagle3" in trs:
        e3 = trs["eagle3"]
        how = ("(the step counts the main job fixes: each is what the draft trained in the same 600 s budget when the "
               "job trained by time)" if by_steps else
               "(the same budget: equal training compute by the clock)")
        shares += (f" EAGLE-3 trained for {e3['elapsed_s']:.0f} s against SPIRe's {tr['elapsed_s']:.0f} s {how} and "
                   f"got {e3['tokens'] / max(tr['tokens'], 1):.2f}× "
                   f"its tokens ({e3['tokens']:,}): one decoder layer over the fused target layers "
                   f"{e3.get('source_layers') or []}, random initialization but for the target's embedding, final "
                   "norm and head rows, full KV cache (speculators' Eagle3; arXiv 2503.01840).")
    return [
        f"SPIRe: pruned from {origin} of {results['target']['layers']} layers "
        f"({results['target']['body_params'] / 1e6:.1f} M body parameters in the target), sink {cfg.sink} + window "
        f"{cfg.window}, feedback memory, target activations for the verified past. Vanilla: "
        f"round(layers / 8) blocks of the target's width, random initialization, full KV cache. AdamW, lr "
        f"{tr['lr']}, warmup then cosine, batches of {tr['batch_size']} × {tr['seq_len']} tokens, bf16 autocast "
        f"{'on' if tr['bf16'] else 'off'}"
        + (f", torch.compile on (compiling took {tr['compile_s']:.0f} s, outside the budget)" if tr.get("compile_s")
           is not None else "")
        + (f", data parallel in {tr['processes']} processes × {tr['threads_per_process']} thread(s)"
           if tr.get("processes", 1) > 1 else "")
        + f". α = E[Σ min(p, q)] on {cfg.alpha_windows} held-out windows." + shares,
        "",
        ("**Trained by step counts, not by time**: each draft trained the tokens of the table whatever this machine's "
         "speed and load; the minutes are the wall time they took here. The same commit trains the same drafts on "
         "any machine: bit for bit where the CPU's kernels and the process and thread counts are the same, "
         "otherwise to float rounding, and τ then agrees within its CIs (expected; not measured across machines "
         "by this run)." if by_steps else
         "**Trained by time budgets** (`--budget`): the tokens each draft trained, and so its α and τ, depend on "
         "this machine's speed and load (without `--budget` the job trains fixed step counts instead)."),
        "",
    ] + [f"- {b}" for b in beyond] + ([""] if beyond else []) + lines + [""]


def _ablation_lines(results: dict, cfg) -> list[str]:
    if not cfg.ablations:
        return ["No ablations in this run (`spire reproduce --ablations all` trains and measures each of the "
                "paper's Figure 5 ablations with `--ablation-budget` seconds).", ""]
    ref = "spire-none" if "none" in cfg.ablations else "spire"
    amount = (f"{cfg.ablation_steps} steps" if cfg.ablation_steps else f"{cfg.ablation_budget_s:.0f} s")
    lines = [f"Each ablated draft trained for {amount}; the reference is "
             + ("the full method trained the same way (`none`)" if ref == "spire-none" else
                "the main SPIRe draft (a fair comparison only if its budget equals the ablations')")
             + f"; τ at L = {cfg.L}.", "",
             "| draft | " + " | ".join(f"τ T = {t:g}" for t in cfg.temperatures)
             + " | held-out α (mean over drafted positions) | paper τ | paper drop |",
             "|---|" + "---|" * (len(cfg.temperatures) + 3)]
    full = PAPER_ABLATION_TAU["none"]
    trainings = results.get("trainings") or {}

    def alpha(label: str) -> float | None:
        a = (trainings.get(label) or {}).get("heldout_alpha_per_position")
        return sum(a) / len(a) if a else None

    def fmt_alpha(label: str) -> str:
        return "–" if alpha(label) is None else f"{alpha(label):.3f}"

    lines.append("| SPIRe (reference) | " + " | ".join(_fmt_tau(_tau_of(results, ref, t)) for t in cfg.temperatures)
                 + f" | {fmt_alpha(ref)} | {full:.3f} | – |")
    drops, alpha_drops = {}, {}
    for a in cfg.ablations:
        if a == "none":
            continue
        paper = PAPER_ABLATION_TAU.get(a)
        lines.append(f"| {ABLATION_LABELS[a]} | " + " | ".join(_fmt_tau(_tau_of(results, f"spire-{a}", t))
                                                               for t in cfg.temperatures)
                     + f" | {fmt_alpha(f'spire-{a}')}"
                     + (f" | {paper:.3f} | {full - paper:+.3f} |" if paper else " | (cost only) | – |"))
        drops[a] = _tau_of(results, ref, cfg.temperatures[0])["tau"] - \
            _tau_of(results, f"spire-{a}", cfg.temperatures[0])["tau"]
        if alpha(ref) is not None and alpha(f"spire-{a}") is not None:
            alpha_drops[a] = alpha(ref) - alpha(f"spire-{a}")
    if not drops:
        return lines + ["", "(Only the reference was trained: add ablations to rank them.)", ""]
    ours = sorted(drops, key=lambda a: -drops[a])
    paper_order = [a for a in sorted(PAPER_ABLATION_TAU, key=PAPER_ABLATION_TAU.get) if a in drops]
    lines += ["", f"Order of importance by measured τ drop (T = {cfg.temperatures[0]:g}, largest first): "
              + " > ".join(f"{ABLATION_LABELS[a]} ({drops[a]:+.3f})" for a in ours) + "."]
    if alpha_drops:
        lines.append("By held-out α drop (finer: every position of the held-out windows, largest first): "
                     + " > ".join(f"{ABLATION_LABELS[a]} ({alpha_drops[a]:+.3f})"
                                  for a in sorted(alpha_drops, key=lambda a: -alpha_drops[a])) + ".")
    lines += ["Paper's order by τ drop among these: " + " > ".join(ABLATION_LABELS[a] for a in paper_order)
              + " (the paper ranks the sparse KV cache first through its cost, not its τ).", ""]
    return lines


def _throughput_lines(results: dict, cfg, measured: list[str]) -> list[str]:
    """REPORT.md's modeled-throughput section: the multiplier against L at B = 64, the best option per (B, L) and
    the goal check, for each temperature's τ."""
    lines = [
        "## Modeled throughput (the paper's cost model, HOI 600, max)",
        "",
        f"Multiplier τ/Δt over autoregressive decoding for {results['target']['name']} shapes with the τ measured "
        f"at L = {cfg.L} above (τ taken as independent of L, as in the paper; see the τ-vs-L table for how far "
        "that holds).",
        "",
    ]
    B = 64 if 64 in cfg.grid_B else max(cfg.grid_B)
    for key, rows in results["throughput"]["measured"].items():
        Ls = sorted({r["L"] for r in rows})
        lines += [f"B = {B}, {key}:", "", "| draft | " + " | ".join(f"L={x}" for x in Ls) + " |",
                  "|---|" + "---|" * len(Ls)]
        for d in measured:
            vals = {r["L"]: r["multiplier"] for r in rows if r["draft"] == d and r["B"] == B}
            lines.append(f"| {d} | " + " | ".join(f"{vals[x]:.2f}" for x in Ls) + " |")
        lines += ["", f"Which pays off ({key}): the best option per (B, L), with its modeled multiplier "
                      "(AD when no draft beats autoregressive decoding):", "",
                  "| B \\ L | " + " | ".join(str(x) for x in Ls) + " |", "|---|" + "---|" * len(Ls)]
        for b in sorted({r["B"] for r in rows}):
            cells = []
            for x in Ls:
                best = max((r for r in rows if r["B"] == b and r["L"] == x and r["multiplier"] is not None),
                           key=lambda r: r["multiplier"], default=None)
                cells.append("AD" if best is None or best["multiplier"] <= 1 else
                             f"{best['draft']} {best['multiplier']:.2f}")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        g = results["throughput"]["goal"].get(key)
        if g:
            vs_v = f", {g['spire_vs_vanilla']:.2f}× vanilla's" if g["spire_vs_vanilla"] else ""
            need_a = f" (i.i.d. α ≈ {g['alpha_needed']:.3f})" if g["alpha_needed"] else ""
            ci = g.get("spire_vs_magicdec_ci")
            ci_txt = (f" (95 % CI [{ci[0]:.2f}, {ci[1]:.2f}], paired bootstrap over the {cfg.n_contexts} shared "
                      f"contexts: {'above' if ci[0] > 1.35 else 'below' if ci[1] < 1.35 else 'straddling'} the "
                      "1.35 line)") if ci else ""
            lines += ["", f"**Goal check ({key})**: at (B, L) = ({g['B']}, {g['L']}) SPIRe's modeled multiplier is "
                          f"{g['spire_vs_magicdec']:.2f}× MagicDec's{ci_txt}{vs_v} (paper's claim: ≥ 1.35× and ≥ 2×); "
                          f"SPIRe is the best option in {100 * g['spire_best_share']:.0f} % of the grid. "
                          f"1.35× MagicDec would need SPIRe τ ≈ {g['tau_needed']:.2f}{need_a}.", ""]
            if g.get("spire_vs_eagle3"):
                ci = g.get("spire_vs_eagle3_ci")
                lines += [f"SPIRe against EAGLE-3 ({key}) at ({g['B']}, {g['L']}): SPIRe's modeled multiplier is "
                          f"{g['spire_vs_eagle3']:.2f}× EAGLE-3's"
                          + (f" (paired 95 % CI [{ci[0]:.2f}, {ci[1]:.2f}])" if ci else "") + ".", ""]
    return lines


def _tau_vs_k_lines(results: dict, cfg) -> list[str]:
    """REPORT.md's τ-vs-k table and the cost model's best k per (B, L) and draft."""
    sweep = results.get("tau_vs_k") or []
    if not sweep:
        return []
    ks = sorted({r["k"] for r in sweep})
    lines = ["", "## τ against k (greedy)", "",
             f"{cfg.tau_k_contexts} held-out contexts of L = {cfg.L} (the first of the τ table's), G = {cfg.G}.", "",
             "| draft | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for d in MEASURED:
        by_k = {r["k"]: r for r in sweep if r["draft"] == d}
        if by_k:
            lines.append(f"| {d} | " + " | ".join(_fmt_tau(by_k.get(k)) for k in ks) + " |")
    best = results["throughput"].get("best_k") or []
    Bs, Ls = sorted({r["B"] for r in best}), sorted({r["L"] for r in best})
    if best:
        lines += ["", "Which pays off with each draft at its best k (the cost model's k that maximizes τ(k)/Δt(k) with "
                      "the greedy τ above; draft k multiplier):", "",
                  "| B \\ L | " + " | ".join(str(x) for x in Ls) + " |", "|---|" + "---|" * len(Ls)]
        for b in Bs:
            cells = []
            for x in Ls:
                top = max((r for r in best if r["B"] == b and r["L"] == x), key=lambda r: r["multiplier"])
                cells.append("AD" if top["multiplier"] <= 1 else
                             f"{top['draft']} k={top['best_k']} {top['multiplier']:.2f}")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines


def _diagnosis_lines(results: dict) -> list[str]:
    """The T = 1 diagnosis section (:mod:`spire.evaluation.diagnose`), with a one-line reading per draft."""
    rows = results.get("diagnosis") or []
    if not rows:
        return []
    lines = ["", "## Why each draft accepts what it does (T = 1)", "",
             "`spire tau --diagnose` on the first contexts of the τ table (docs/tau.md): per drafted position j, over "
             "the rounds that reached it, the acceptance in real rounds, Σ min(p, q) (its expectation), 1 − TV to the "
             "target with the block's earlier tokens drafted and with every earlier token verified, the target's mass "
             "outside the draft's vocabulary, and the entropies of draft and target (nats, T = 1).", "",
             diagnosis_markdown(rows), ""]
    for r in rows:
        d = r["diagnosis"]
        pos = [p for p in d["positions"] if p["reached"]]
        gap = [p["tv"] - p["tv_verified"] for p in pos[1:] if p["tv_verified"] is not None]
        dt = d.get("draft_temperature") or {}
        known = {c: v for c, v in dt.items() if v["tau_predicted"] is not None}
        best = max(known, key=lambda c: known[c]["tau_predicted"]) if known else None
        predicted = d["tau_from_acceptance"]
        lines.append(
            f"- {r['name']}: τ {d['tau']:.3f}"
            + (f" (independent positions at the measured acceptances: {predicted:.3f})" if predicted is not None else "")
            + f"; mean 1 − TV {1 - sum(p['tv'] for p in pos) / len(pos):.3f}; "
            f"H(q) − H(p) {sum(p['entropy_draft'] - p['entropy_target'] for p in pos) / len(pos):+.2f} nats; "
            f"outside mass {sum(p['outside_mass'] for p in pos) / len(pos):.3f}"
            + (f"; drafting over its own tokens costs {sum(gap) / len(gap):.3f} of 1 − TV at j ≥ 2" if gap else "")
            + (f"; best draft temperature factor {best} (τ predicted {known[best]['tau_predicted']:.3f} against "
               f"{known['1']['tau_predicted']:.3f} at 1)" if best and "1" in known else "")
            + _text_gap(d.get("overlap_by_text")))
    return lines


def _text_gap(o: dict | None) -> str:
    """The overlap on the target's sampled text against natural text, as a clause (empty without both)."""
    if not o or not o.get("generated") or not o.get("natural"):
        return ""
    g, n = o["generated"]["overlap"], o["natural"]["overlap"]
    out = [o[t].get("outside_mass") for t in ("generated", "natural")]
    vocab = (f", the target's mass outside the draft vocabulary {out[0]:.3f} against {out[1]:.3f}"
             if None not in out and max(out) > 0 else "")
    return f"; 1 − TV on the target's sampled text {g:.3f} against {n:.3f} on natural text ({g - n:+.3f}){vocab}"


def _markdown(results: dict, cfg) -> str:
    env, tm = results["environment"], results["timings"]
    measured = [d for d in MEASURED if _tau_of(results, d, cfg.temperatures[0]) is not None]
    lines = [
        f"# spire reproduce: SPIRe beside MagicDec, EAGLE-3, n-gram and vanilla on {results['target']['name']}",
        "",
        f"Target `{results['target']['checkpoint']}`{' (--quick: smoke-test settings, not a measurement)' if cfg.quick else ''}. "
        f"Wall time {tm['total_s'] / 60:.1f} min on {env['processor']} ({env['threads']} "
        f"thread{'s' if env['threads'] != 1 else ''}, torch {env['torch']}, {env['device']})."
        + _reuse_note(results),
        "",
        f"Execution path (`spire --backend`): {backend_line(env.get('backend'))}.",
        "",
        "## τ (average tokens per round, bonus included)",
        "",
        f"{cfg.n_contexts} held-out contexts of L = {cfg.L} tokens (documents never seen in training), "
        f"G = {cfg.G} generated tokens each, k = {cfg.k}; 95 % bootstrap CI over contexts. Float32.",
        "",
        "| draft | " + " | ".join(f"τ at T = {t:g}" for t in cfg.temperatures) + " | paper (67M, L = 512) |",
        "|---|" + "---|" * (len(cfg.temperatures) + 1),
    ]
    for d in measured:
        paper = f"{PAPER_TAU[d]:.3f}" if d in PAPER_TAU else "not measured"
        lines.append(f"| {d} | " + " | ".join(_fmt_tau(_tau_of(results, d, t)) for t in cfg.temperatures)
                     + f" | {paper} |")
    if results.get("tau_vs_L"):
        Ls = sorted({r["L"] for r in results["tau_vs_L"]})
        lines += ["", "## τ against context length (greedy)", "",
                  f"{cfg.tau_L_contexts} held-out contexts per L, cut from documents at least L + G tokens long. The "
                  "paper measured up to L = 960 and assumed τ flat beyond.", "",
                  "| draft | " + " | ".join(f"L = {x}" for x in Ls) + " |", "|---|" + "---|" * len(Ls)]
        for d in MEASURED:
            by_L = {r["L"]: r for r in results["tau_vs_L"] if r["draft"] == d}
            if by_L:
                lines.append(f"| {d} | " + " | ".join(_fmt_tau(by_L.get(x)) for x in Ls) + " |")
        lines += [""] + _flatness_lines(results["tau_vs_L"])
    lines += _tau_vs_k_lines(results, cfg)
    lines += _diagnosis_lines(results)
    lines += ["", "## Draft training", ""] + _training_lines(results, cfg)
    lines += ["## Ablations (paper Figure 5)", ""] + _ablation_lines(results, cfg)
    lines += _throughput_lines(results, cfg, measured)
    headline = {r["draft"]: r["multiplier"] for r in results["throughput"]["paper_67m"]
                if r["L"] == 512 and r["B"] == 64}
    lines += [
        f"Check: the paper's 67M setting at (64, 512) gives SPIRe {headline['spire']:.2f}, vanilla "
        f"{headline['vanilla']:.2f}, MagicDec {headline[registry.BASELINE]:.2f} (paper: 2.78 / 1.36 / 2.05).",
        "",
        "## Figures",
        "",
    ] + [f"![{f}]({f})" for f in results["figures"]] + [
        "",
        "## Data",
        "",
        "Registry texts, split by document (held-out documents are never trained on); tokens include one "
        "separator per document.",
        "",
        "| source | train docs | train tokens | held-out docs | held-out tokens |",
        "|---|---|---|---|---|",
    ] + [f"| {src} | {e['train_documents']} | {e['train_tokens']:,} | {e['heldout_documents']} | "
         f"{e['heldout_tokens']:,} |" for src, e in results["data"]["sources"].items()] + [
        "",
        "## Timings (s)",
        "",
        ", ".join(f"{k}: {v:.0f}" for k, v in tm.items()),
        "",
    ]
    return "\n".join(lines)
