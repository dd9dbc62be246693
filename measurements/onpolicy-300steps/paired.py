"""Paired ratio of two drafts' τ in tau.json (same contexts): emitted/rounds of B over A, 95 % bootstrap CI."""
import json
import sys

import numpy as np

d = json.load(open(sys.argv[1] if len(sys.argv) > 1 else "tau.json"))
rows = {(r["name"], r["temperature"]): r for r in d["rows"]}
rng = np.random.default_rng(0)
for T in sorted({t for _, t in rows}):
    a, b = rows[("base", T)], rows[("onpol", T)]
    ea, ra, eb, rb = (np.array(x, float) for x in (a["emitted"], a["rounds"], b["emitted"], b["rounds"]))
    boot = []
    for _ in range(5000):
        i = rng.integers(0, len(ea), len(ea))
        boot.append((eb[i].sum() / rb[i].sum()) / (ea[i].sum() / ra[i].sum()))
    lo, hi = np.percentile(boot, [2.5, 97.5])
    print(f"T={T}: on-policy / natural tau {eb.sum() / rb.sum() / (ea.sum() / ra.sum()):.3f} [{lo:.3f}, {hi:.3f}]")
