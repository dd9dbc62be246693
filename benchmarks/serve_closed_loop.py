"""`spire serve`'s engine without the HTTP layer, several draft sets side by side: each built as `spire serve` builds
it (spire.commands.serve.load_drafts: served drafts in int8 where that is the default; the measured round policy on
this machine's cached round-cost profile; 32 slots of 2,048 positions, prefill in chunks of 512 tokens), each run
as a closed loop at concurrency c (a finished request is replaced at once) over n held-out prompts of 128-1,687
tokens (benchmarks/serve_load.heldout_prompts, never trained on), 64 greedy tokens each; the engines in turn, the
order reversed every repetition.

    python benchmarks/serve_closed_loop.py -c 32 -n 64 --reps 3 none ngram spire ngram,spire \\
        [--draft-path RUN] [--out FILE] [--profile DIR] [--trace]

Prints, per draft set, each run's wall seconds, the seconds spent in steps that prefilled and in steps that only
decoded, the mean time to first token, the median wall time, output tokens/s and its ratio to the first set's
median (give `none` first), and the engine's rounds by k. --trace: per set and k, the policy's rounds (whether each
is priced and credited right). --profile DIR: the last repetition of each set under cProfile (DIR/<set>.prof), to
see where a draft set's extra time goes. The tests do not run this script.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import time
from pathlib import Path

from spire.commands.serve import load_drafts, measured_policy, parse_drafts
from spire.engine.engine import Engine
from spire.loading import load_target
from spire.params import RequestParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import write_results  # noqa: E402
from serve_load import heldout_prompts  # noqa: E402


def build(model, tok, drafts: str, path: str | None) -> Engine:
    """An engine serving ``drafts`` ("none" or kinds joined by commas) as `spire serve` does."""
    served, formats = [], []
    if drafts != "none":
        served, _, _, formats = load_drafts(model, tok, parse_drafts(drafts, path if "spire" in drafts else None),
                                            None, {}, "fp32", None)
    eng = Engine(model, served or None, k=4, max_running=32, max_len=2048, eos_ids=[], prefill_chunk=512)
    if served:
        eng.scheduler.k_policy = measured_policy(eng, "smollm2-135m", "fp32", formats)
    return eng


def closed_loop(eng: Engine, prompts: list[list[int]], c: int, n: int) -> tuple[float, float, float, float]:
    """(wall, prefilling-step, decode-only-step, mean time-to-first-token) seconds to finish n requests at
    concurrency c (a request's first token: the end of the first step that gave it one)."""
    sent, pre, dec = 0, 0.0, 0.0
    added: dict[int, float] = {}
    ttft: list[float] = []

    def add() -> None:
        nonlocal sent
        added[eng.add_request(prompts[sent % len(prompts)], RequestParams(64, ignore_eos=True))] = time.perf_counter()
        sent += 1

    t = time.perf_counter()
    for _ in range(min(c, n)):
        add()
    while eng.has_work():
        prefilling = eng.status().prefilling
        t0 = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        dt = now - t0
        pre, dec = (pre + dt, dec) if prefilling else (pre, dec + dt)
        for o in outs:
            if o.new_tokens and o.request_id in added:
                ttft.append(now - added.pop(o.request_id))
            if o.finished and sent < n:
                add()
    return time.perf_counter() - t, pre, dec, statistics.fmean(ttft) if ttft else 0.0


def trace(eng: Engine) -> list[dict] | None:
    """Record each round the engine's measured policy prices (None without one): k, requests, tokens committed,
    measured and predicted seconds. The list is emptied by :func:`print_trace`."""
    policy = eng.scheduler.k_policy
    if policy is None:
        return None
    rows: list[dict] = []
    update = policy.update

    def recorded(plan, accepted, seconds):
        choice, last = plan.choice, policy.last or {}
        rows.append({"k": choice.k, "n": len(plan.running), "tokens": len(plan.running) + sum(accepted),
                     "seconds": seconds,
                     "predicted": policy.costs.predict(plan.width, last.get("context", 1), choice.k, choice.used)})
        return update(plan, accepted, seconds)

    policy.update = recorded
    return rows


def print_trace(rows: list[dict] | None) -> None:
    for k in sorted({r["k"] for r in rows or []}):
        rk = [r for r in rows if r["k"] == k]
        print(f"  k={k}: {len(rk)} rounds, median {statistics.median(r['seconds'] for r in rk) * 1e3:.1f} ms, "
              f"measured / predicted {statistics.median(r['seconds'] / r['predicted'] for r in rk):.2f}, "
              f"tokens per request-round {sum(r['tokens'] for r in rk) / sum(r['n'] for r in rk):.2f}", flush=True)
    if rows:
        rows.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sets", nargs="+", help="draft sets: none, a kind, or kinds joined by commas")
    ap.add_argument("-c", type=int, default=32)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--draft-path", help="the SPIRe run (default: the newest trained one in the cache)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--trace", action="store_true",
                    help="print, per draft set and k, the policy's rounds: their count, median seconds, median "
                         "ratio of measured to predicted seconds, and tokens committed per request per round")
    a = ap.parse_args()
    model, tok, _ = load_target(progress=False)
    prompts = heldout_prompts(64, 128, 1687, 0)
    engines = {s: build(model, tok, s, a.draft_path) for s in a.sets}
    traces = {s: trace(engines[s]) for s in a.sets} if a.trace else {}
    for eng in engines.values():
        closed_loop(eng, prompts, 2, 2)  # warm-up
    for rows in traces.values():
        if rows:
            rows.clear()  # the warm-up's rounds are not traced
    runs: dict[str, list] = {s: [] for s in a.sets}
    for r in range(a.reps):
        for s in (a.sets if r % 2 == 0 else a.sets[::-1]):
            prof = cProfile.Profile() if a.profile and r == a.reps - 1 else None
            if prof:
                prof.enable()
            runs[s].append([round(x, 2) for x in closed_loop(engines[s], prompts, a.c, a.n)])
            if prof:
                prof.disable()
                a.profile.mkdir(parents=True, exist_ok=True)
                prof.dump_stats(a.profile / f"{s}.prof")
            print(f"{s} rep {r}: wall, prefilling steps, decode steps, mean TTFT (s) {runs[s][-1]}", flush=True)
            if s in traces:
                print_trace(traces[s])
    base = statistics.median(x[0] for x in runs[a.sets[0]])
    rows = []
    for s in a.sets:
        wall = statistics.median(x[0] for x in runs[s])
        rows.append({"set": s, "c": a.c, "n": a.n, "runs": runs[s], "wall_median_s": wall,
                     "ttft_median_s": statistics.median(x[3] for x in runs[s]),
                     "tokens_per_s": round(64 * a.n / wall, 2), f"vs_{a.sets[0]}": round(base / wall, 3),
                     "rounds_by_k": engines[s].stats.rounds_by_k})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        write_results(a.out, {"rows": rows})


if __name__ == "__main__":
    main()
