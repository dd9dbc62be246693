"""The floor of issue 51: an AD step of an engine that serves drafts (the round policy drafting nothing) against
an AD step of one without a draft, in one process, steps alternated, medians.

    python benchmarks/serve_floor.py --out measurements/serve-policy-cpu/floor.json [--drafts spire] \\
        [--draft-path RUN] [-B 1,8] [--steps 40]

    python benchmarks/serve_floor.py --prompts PROMPTS.json -c 16 -n 16 --reps 3 [--drafts spire] [--draft-path RUN]

Each engine holds B requests of 300 + 40 i prompt tokens (seeded random ids) decoding 1,000 tokens; after their
prefill, the two engines step in turn (the order swapped every step) and each step is timed. Prints per B the
median seconds of both and their ratio (the floor: within 3 % of 1.0 is the issue's bar). The drafts observe every
AD round (SPIRe: in batches, Draft.defer_observe). --draft-path: a trained SPIRe run (default: an untrained pruned
draft, which costs the same).

With --prompts (a JSON list of token-id lists, e.g. the serve-policy-floor check's): the whole workload instead, as a
server runs it without the HTTP layer: closed loop at concurrency c (a finished request is replaced at once; 8 slots,
the rest waiting), prefill in chunks of 512 tokens, 64 greedy tokens each, until n requests finished; both engines
in turn (the order swapped every repetition), and the ratio of their median wall times. This prices what a served
draft costs outside the AD step too: its prefill observes and its catch-up.
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
from spire.engine.profile import profile_rounds
from spire.engine.scheduler import RoundChoice
from spire.loading import load_target
from spire.params import RequestParams
from spire.serving.policy import Acceptance, MeasuredPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import write_results  # noqa: E402


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


def workload(eng: Engine, prompts: list[list[int]], c: int, n: int) -> float:
    """Seconds for ``eng`` to finish n requests of ``prompts`` (in turn) at concurrency c, 64 greedy tokens each."""
    t, sent = time.perf_counter(), 0
    for _ in range(min(c, n)):
        eng.add_request(prompts[sent % len(prompts)], RequestParams(64, ignore_eos=True))
        sent += 1
    while eng.has_work():
        for out in eng.step():
            if out.finished and sent < n:
                eng.add_request(prompts[sent % len(prompts)], RequestParams(64, ignore_eos=True))
                sent += 1
    return time.perf_counter() - t


def main_workload(a, target, tok) -> None:
    """--prompts: the closed-loop workload with and without the drafts, alternated (see the module docstring)."""
    prompts = json.loads(Path(a.prompts).read_text())
    engines = {}
    for name, kinds in (("none", []), ("served", a.drafts.split(","))):
        drafts = [make_draft(k, target, tok, a.draft_path if k == "spire" else None) for k in kinds]
        engines[name] = Engine(target, drafts or None, k=4, max_running=8, max_len=2048, prefill_chunk=512,
                               k_policy=DraftNothing() if drafts else None)
        if drafts and a.policy == "measured":  # spire serve's default policy, on a profile timed here
            engines[name].scheduler.k_policy = MeasuredPolicy(kinds, profile_rounds(engines[name]),
                                                              Acceptance(len(kinds), 4, [0.6] * len(kinds)))
    workload(engines["none"], prompts, 2, 2), workload(engines["served"], prompts, 2, 2)  # warm-up
    times: dict[str, list[float]] = {"none": [], "served": []}
    for r in range(a.reps):
        for name in (("none", "served") if r % 2 else ("served", "none")):
            times[name].append(workload(engines[name], prompts, a.c, a.n))
    m = {k: statistics.median(v) for k, v in times.items()}
    st = engines["served"].stats
    chose = {"rounds_by_k": st.rounds_by_k, "draft_tau": {d: st.draft_tau(d) for d in st.accepted_by_draft}}
    print(f"the served engine's rounds by k {st.rounds_by_k}, tau of the rounds that drafted {chose['draft_tau']}")
    print(f"c={a.c}, {a.n} requests: without a draft {times['none']} s, serving {a.drafts} ({a.policy}) "
          f"{times['served']} s, ratio of medians {m['served'] / m['none']:.3f}", flush=True)
    if a.out:
        write_results(a.out, {"c": a.c, "n": a.n, "drafts": a.drafts, "policy": a.policy, "times": times,
                              "chose": chose, "ratio": m["served"] / m["none"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--drafts", default="spire", help="comma-separated kinds served (a portfolio: ngram,spire)")
    ap.add_argument("--draft-path")
    ap.add_argument("-B", default="1,8")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", help="a JSON list of token-id lists: time the whole workload (module docstring)")
    ap.add_argument("-c", type=int, default=16, help="--prompts: concurrency")
    ap.add_argument("-n", type=int, default=16, help="--prompts: requests per run")
    ap.add_argument("--reps", type=int, default=3, help="--prompts: runs of each engine")
    ap.add_argument("--policy", choices=("nothing", "measured"), default="nothing",
                    help="--prompts: the served engine drafts nothing, or follows spire serve's measured policy")
    a = ap.parse_args()
    target, tok, _ = load_target(progress=False)
    if a.prompts:
        main_workload(a, target, tok)
        return
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
        write_results(a.out, {"rows": rows})


if __name__ == "__main__":
    main()
