"""A draft's decode matmuls with float32, bf16 and int8 weights, side by side in one process, passes interleaved,
medians: what ``--draft-weights`` buys in a draft step.

    .venv/bin/python benchmarks/draft_weights.py                     # SmolLM2's 8-layer draft + 16 K head, M = 1
    .venv/bin/python benchmarks/draft_weights.py --rows 1,2,3 --repeats 41 --json out.json

One pass = every matmul of a draft step (q/k/v fused, o, gate/up fused, down per layer, then the head) for M
activation rows through spire.kernels.panel_linear: float32 and bf16 over spire.kernels.pack_panels copies,
int8 over spire.kernels.pack_panels_int8 (group-wise weights, int16 activations). Random weights with the
draft's shapes stream the same bytes as the real draft, more than the last-level cache. Each repeat runs one
pass of every format in a rotating order, so slow stretches of a shared machine hit all formats alike. GB/s =
packed bytes of a pass / time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # benchmarks/_provenance.py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1", help="activation rows M, comma-separated (1..64)")
    ap.add_argument("--repeats", type=int, default=31, help="timed passes per format and M (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=576)
    ap.add_argument("--d-ff", type=int, default=1536)
    ap.add_argument("--heads", default="9,3,64", help="query heads, key/value heads, head size")
    ap.add_argument("--vocab", type=int, default=16384, help="head rows (the draft vocabulary; 0: no head)")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)

    import torch

    from spire import kernels

    try:
        rows = [int(r) for r in args.rows.split(",")]
        H, KV, D = (int(v) for v in args.heads.split(","))
    except ValueError:
        print("error: --rows takes comma-separated integers, --heads three of them", file=sys.stderr)
        return 2
    if not rows or any(not 1 <= m <= kernels.MAX_ROWS for m in rows):
        print(f"error: --rows must lie in 1..{kernels.MAX_ROWS}", file=sys.stderr)
        return 2
    if min(args.repeats, args.threads, args.layers, args.d_model, args.d_ff, H, KV, D) < 1 or args.vocab < 0:
        print("error: --repeats, --threads, --layers, --d-model, --d-ff and --heads must be >= 1, --vocab >= 0",
              file=sys.stderr)
        return 2
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        print(f"error: --json: no folder {os.path.dirname(os.path.abspath(args.json))}", file=sys.stderr)
        return 2
    if args.d_model % 2 or args.d_ff % 2 or (H * D) % 2:
        print("error: int8 weights need even input sizes (--d-model, --d-ff, heads x head size)", file=sys.stderr)
        return 2
    if not kernels.available():
        print(f"error: spire kernels unavailable: {kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    d, f = args.d_model, args.d_ff
    shapes = [((H + 2 * KV) * D, d), (d, H * D), (2 * f, d), (d, f)] * args.layers
    if args.vocab:
        shapes.append((args.vocab, d))
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * k ** -0.5 for n, k in shapes]
    packed = {"fp32": [kernels.pack_panels(w) for w in ws],
              "bf16": [kernels.pack_panels(w.bfloat16()) for w in ws],
              "int8": [kernels.pack_panels_int8(w) for w in ws]}
    nbytes = {name: sum(p.numel() * p.element_size() for p in ps) for name, ps in packed.items()}
    out = []
    for M in rows:
        xs = {k: torch.randn(M, k, generator=g) for k in {k for _, k in shapes}}

        def run(name: str) -> float:
            t = time.perf_counter()
            for w, p in zip(ws, packed[name]):
                kernels.panel_linear(xs[w.shape[1]], p, w.shape[0])
            return time.perf_counter() - t

        names = list(packed)
        for name in names:
            run(name)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names[r % 3:] + names[:r % 3]:
                times[name].append(run(name))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        out.append({"M": M, **{f"{n}_ms": v * 1e3 for n, v in med.items()},
                    **{f"{n}_GBps": nbytes[n] / med[n] / 1e9 for n in names},
                    "bf16_over_int8": med["bf16"] / med["int8"], "fp32_over_int8": med["fp32"] / med["int8"]})
    print(f"draft matmuls: {args.layers} layers" + (f" + {args.vocab}-row head" if args.vocab else "")
          + f", {args.threads} thread(s), median of {args.repeats}; MB per pass: "
          + ", ".join(f"{n} {b / 1e6:.1f}" for n, b in nbytes.items()))
    print("| M | fp32 ms | bf16 ms | int8 ms | fp32 GB/s | bf16 GB/s | int8 GB/s | bf16 / int8 | fp32 / int8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['M']} | {r['fp32_ms']:.2f} | {r['bf16_ms']:.2f} | {r['int8_ms']:.2f} | {r['fp32_GBps']:.1f} | "
              f"{r['bf16_GBps']:.1f} | {r['int8_GBps']:.1f} | {r['bf16_over_int8']:.2f} | {r['fp32_over_int8']:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": vars(args), "bytes": nbytes, "rows": out}, fh, indent=1)
        write_provenance(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
