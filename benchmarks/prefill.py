"""Prefill speed: spire's target forward over a prompt, the old path against the new, side by side in one run.

    .venv/bin/python benchmarks/prefill.py                         # L = 128, 512, 1024, 2048; B = 1; 1 thread
    .venv/bin/python benchmarks/prefill.py -L 2048 -B 4 --threads 2 --repeats 5 --json out.json
    .venv/bin/python benchmarks/prefill.py --old no-onednn-linear --new ""     # one lever alone

"old" and "new" are two :class:`spire.backend.Backend` specs (``spire --backend`` syntax). By default old is
the path before the prefill levers (torch's BLAS for the float32 matmuls, an explicit (T, T) causal mask) and new
is every fast path (oneDNN matmuls, SDPA's ``is_causal``). Each repeat runs old then new on the same random tokens
(a prefill's cost does not depend on them), a fresh cache each time, so the pair shares the machine's state; the
clock is this process's CPU time (``--clock wall`` for wall time), which a busy machine disturbs less. Prints
tokens per second of each, the ratio new / old (median over the repeats) and the largest difference of the prompt's last-position logits between the two (float32 rounding:
the two paths sum in different orders).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # benchmarks/_provenance.py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-L", type=int, action="append", help="prompt length(s) in tokens [128, 512, 1024, 2048]")
    ap.add_argument("-B", type=int, default=1, help="prompts per forward [1]")
    ap.add_argument("--threads", type=int, default=1, help="torch threads [1]")
    ap.add_argument("--repeats", type=int, default=5, help="old/new pairs per length [5]")
    ap.add_argument("--old", default="no-onednn-linear,no-causal-attention", help="the old path's backend spec")
    ap.add_argument("--new", default="", help="the new path's backend spec [every fast path]")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    lengths = args.L or [128, 512, 1024, 2048]
    if args.B < 1 or args.repeats < 1 or args.threads < 1 or min(lengths) < 2:
        ap.error("-B, --repeats and --threads must be >= 1 and -L >= 2")

    import torch

    from spire import backend
    from spire.loading import load_target

    from spire.errors import ConfigError

    try:
        old, new = backend.Backend.parse(args.old), backend.Backend.parse(args.new)
    except ConfigError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    target = load_target(progress=False)[0]
    if max(lengths) > target.cfg.max_positions:
        ap.error(f"-L above the target's {target.cfg.max_positions} positions")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    g = torch.Generator().manual_seed(0)
    rows = []
    for L in lengths:
        tokens = torch.randint(0, target.cfg.vocab_size, (args.B, L), generator=g)
        pos = torch.arange(L)[None].expand(args.B, L)
        rates: dict[str, list[float]] = {"old": [], "new": []}
        last: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for rep in range(args.repeats + 1):  # the first pair warms up (weight copies, oneDNN's first call)
                for name, bk in (("old", old), ("new", new)):
                    backend.use(target, bk)
                    cache = target.new_cache(args.B, L)
                    t0 = clock()
                    out = target(tokens, pos, cache)
                    dt = clock() - t0
                    last[name] = out.logits[:, -1]
                    if rep:
                        rates[name].append(args.B * L / dt)
        backend.use(target, backend.Backend.from_env())
        ratios = [n / o for o, n in zip(rates["old"], rates["new"])]
        row = {"L": L, "B": args.B, "threads": args.threads, "clock": args.clock,
               "old": args.old, "new": args.new or "(every fast path)",
               "old_tokens_per_s": statistics.median(rates["old"]), "new_tokens_per_s": statistics.median(rates["new"]),
               "ratio_median": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios],
               "max_logit_diff": float((last["new"] - last["old"]).abs().max())}
        rows.append(row)
        print(f"L={L:5d} B={args.B}: old {row['old_tokens_per_s']:8.1f} tok/{args.clock}-s, new "
              f"{row['new_tokens_per_s']:8.1f}; new/old {row['ratio_median']:.2f}x (pairs: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}); last logits differ by {row['max_logit_diff']:.1e}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__, "old": old.describe(), "new": new.describe()}, f,
                      indent=1)
        write_provenance(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
