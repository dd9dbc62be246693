"""τ of the Figure 5 ablations at T = 0 from the main job's τ cache, with paired 95 % CIs against the full method.

The run (`spire reproduce --steps 100 --ablations all --ablation-steps 100 --cache-steps 100 --tau-L 512
--tau-L-contexts 4 --n-contexts 32`; its REPORT.md is beside this file) reports unpaired CIs; this reads the rows
it cached, keyed exactly as the job keys them, and the ablations' training states, and adds the paired ones.

    SPIRE_CACHE=... python measurements/ablations-cpu-100steps/summarize.py > measurements/ablations-cpu-100steps/ABLATIONS_T0.md   # 1: T = 1

A second argument gives the steps of a run made the same way with other step counts (`--steps N --ablation-steps N
--cache-steps N`; vanilla N / 2), e.g. `... summarize.py 0 300` for `measurements/ablations-cpu-300steps/`.
"""

import json
import sys

import numpy as np

from spire.evaluation.tau import bootstrap_ratio_ci, paired_ratio_ci
from spire.loading import load_target
from spire.paths import spire_cache_dir
from spire.pipeline import (ReproduceConfig, _draft_dir, _tau_batch, _tau_cache_get, _tau_key, spire_architecture,
                            training_runs)
from spire.data import document_separator_id, prepare_data
from spire.training.distill import ABLATIONS

T = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 100
cfg = ReproduceConfig(steps=STEPS, ablations=tuple(ABLATIONS), ablation_steps=STEPS, cache_steps=STEPS, tau_Ls=(512,),
                      tau_L_contexts=4, n_contexts=32)
target, tok, folder = load_target(progress=False)
data = prepare_data(tok, eos_id=document_separator_id(tok), progress=False)
ctx = data.heldout_contexts(cfg.L, cfg.G, cfg.n_contexts, seed=cfg.seed)[:, : cfg.L]
runs = training_runs(cfg, spire_architecture(cfg, target.cfg.n_layers, target.cfg.vocab_size))
rows = {}
for label, tc in runs:
    if label == "spire-none":  # the same settings as spire: trained and measured once
        continue
    if label == "vanilla":
        tc.max_steps = STEPS // 2  # as the job set it: half of SPIRe's tokens
    run_dir = _draft_dir(cfg, tc, folder, label)
    state = json.loads((run_dir / "checkpoint" / "train_state.json").read_text())
    key = _tau_key(folder, {"run_dir": str(run_dir), "step": state["step"]}, ctx, cfg, T, _tau_batch(cfg, cfg.L))
    row = _tau_cache_get(key)
    rows[label] = (row, state)
md = _tau_cache_get(_tau_key(folder, {"magicdec": [cfg.sink, cfg.window]}, ctx, cfg, T, _tau_batch(cfg, cfg.L)))
full = rows["spire"][0]
print(f"# Figure 5 ablations on SmolLM2-135M, {STEPS} steps each ({STEPS * 1024 / 1000:.0f} K tokens), τ at T = {T:g}, L = 512, "
      f"{cfg.n_contexts} held-out contexts, G = 64, k = 4\n")
print("| draft | held-out α by drafted position | τ [95 % CI] | τ / full SPIRe, paired 95 % CI | paper τ |")
print("|---|---|---|---|---|")
paper = {"spire": 3.401, "spire-no-feedback": 3.352, "spire-no-feedback-no-target": 2.959, "spire-omega1": 3.375,
         "spire-hard-loss": 3.069, "spire-random-init": 3.105, "magicdec": 3.891, "vanilla": 2.647}
arr = lambda r, k: np.asarray(r[k], dtype=float)
items = [(label, r, s) for label, (r, s) in rows.items() if label != "spire-none"] + [("magicdec", md, None)]
for label, r, s in items:
    if r is None:
        print(f"| {label} | | not measured | | |")
        continue
    tau = arr(r, "emitted").sum() / arr(r, "rounds").sum()
    lo, hi = bootstrap_ratio_ci(arr(r, "emitted"), arr(r, "rounds"))
    plo, phi = paired_ratio_ci(arr(r, "emitted"), arr(r, "rounds"), arr(full, "emitted"), arr(full, "rounds"))
    alpha = " / ".join(f"{a:.3f}" for a in s["heldout"]["alpha_per_position"]) if s else "-"
    ratio = "1" if label == "spire" else f"{tau / (arr(full, 'emitted').sum() / arr(full, 'rounds').sum()):.3f} [{plo:.3f}, {phi:.3f}]"
    print(f"| {label} | {alpha} | {tau:.3f} [{lo:.3f}, {hi:.3f}] | {ratio} | {paper.get(label, '(cost only)')} |")
