"""The floor of issue 51: an AD step of an engine that serves drafts (the round policy drafting nothing) against
an AD step of one without a draft, in one process, steps alternated, medians.

    python benchmarks/serve_floor.py --out measurements/serve-policy-cpu/floor.json [--drafts spire] \\
        [--draft-path RUN] [-B 1,8] [--steps 40]

Each engine holds B requests of 300 + 40 i prompt tokens (seeded random ids) decoding 1,000 tokens; after their
prefill, the two engines step in turn (the order swapped every step) and each step is timed. Prints per B the
median seconds of both and their ratio (the floor: within 3 % of 1.0 is the issue's bar). The drafts observe every
AD round (SPIRe: in batches, Draft.defer_observe). --draft-path: a trained SPIRe run (default: an untrained pruned
draft, which costs the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from spire.drafts import make_draft
from spire.drafts.spire import SpireDraft, SpireDraftModel
from spire.engine.engine import Engine
from spire.engine.scheduler import RoundChoice
from spire.loading import load_target
from spire.params import RequestParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import write_provenance  # noqa: E402


class DraftNothing:
    """A round policy that always chooses AD."""

    def choose(self, plan, width, proposes):
        return RoundChoice.uniform(len(plan.running), 0)

    def update(self, plan, accepted, seconds):
        pass


def engine(target, tok, kinds: list[str], path: str | None, B: int) -> Engine:
    drafts = []
    for kind in kinds:
        if kind == "spire" and path is None:
            drafts.append(SpireDraft(SpireDraftModel(target).requires_grad_(False)))
        else:
            drafts.append(make_draft(kind, target, tok, path if kind == "spire" else None))
    eng = Engine(target, drafts or None, k=4, max_running=B, max_len=2048, k_policy=DraftNothing() if drafts else None)
    g = torch.Generator().manual_seed(0)
    for i in range(B):
        eng.add_request(torch.randint(100, 20000, (300 + 40 * i,), generator=g).tolist(),
                        RequestParams(1000, ignore_eos=True))
    while eng.status().prefilling or eng.status().waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--drafts", default="spire", help="comma-separated kinds served (a portfolio: ngram,spire)")
    ap.add_argument("--draft-path")
    ap.add_argument("-B", default="1,8")
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    target, tok, _ = load_target(progress=False)
    rows = []
    for B in (int(x) for x in a.B.split(",")):
        none, served = engine(target, tok, [], None, B), engine(target, tok, a.drafts.split(","), a.draft_path, B)
        times: dict[str, list[float]] = {"none": [], "served": []}
        for i in range(a.steps):
            for name, eng in ((("none", none), ("served", served)) if i % 2 else (("served", served), ("none", none))):
                t = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t)
        m = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"B": B, "drafts": a.drafts, "none_s": m["none"], "served_s": m["served"],
                     "ratio": m["served"] / m["none"], "steps": a.steps})
        print(f"B={B}: AD step without a draft {m['none'] * 1e3:.1f} ms, serving {a.drafts} at k = 0 "
              f"{m['served'] * 1e3:.1f} ms, ratio {m['served'] / m['none']:.3f}", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"rows": rows}, indent=1))
        write_provenance(a.out.parent)


if __name__ == "__main__":
    main()
