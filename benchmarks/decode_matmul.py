"""Decode matmuls at a target's real shapes: the panel kernel (packed weights) against the row-major kernel and
torch (MKL), side by side in one process, interleaved, medians.

    .venv/bin/python benchmarks/decode_matmul.py                       # float32, M = 1, 2, 3, 5, 8, 16, 40
    .venv/bin/python benchmarks/decode_matmul.py --weights both --rows 1,3,5 --repeats 9 --json out.json

One pass = every decoder matmul of the target (q/k/v fused, o, gate/up fused, down; all layers) and, with
``--head``, the unembedding, for M activation rows (a decode step M = B, a verify pass M = B (k + 1)). Weights
are random with the target's shapes (SmolLM2-135M by default: 30 layers, d 576, d_ff 1536; 9 query heads and
3 key/value heads of 64), so the pass streams the same bytes as the real model, far more than the last-level
cache. Paths: ``panel`` = spire.kernels.panel_linear over spire.kernels.pack_panels copies (what the decode
path runs), ``row-major`` = spire.kernels.skinny_linear (the kernel before it), ``torch`` = F.linear (float32
only). Time is wall clock per pass on the chosen thread count; GB/s = weight bytes of a pass / time.
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,5,8,16,40", help="activation rows M, comma-separated (1..64)")
    ap.add_argument("--weights", choices=["fp32", "bf16", "both"], default="fp32")
    ap.add_argument("--repeats", type=int, default=7, help="timed passes per path and M (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--d-model", type=int, default=576)
    ap.add_argument("--d-ff", type=int, default=1536)
    ap.add_argument("--heads", default="9,3,64", help="query heads, key/value heads, head size")
    ap.add_argument("--head", action="store_true", help="also the unembedding (--vocab rows)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from spire import kernels

    try:
        rows = [int(r) for r in args.rows.split(",")]
        H, KV, D = (int(v) for v in (args.heads.split(",") + ["0", "0"])[:3])
    except ValueError:
        print("error: --rows and --heads take comma-separated integers", file=sys.stderr)
        return 2
    if len(args.heads.split(",")) != 3:
        print("error: --heads takes three integers: query heads, key/value heads, head size", file=sys.stderr)
        return 2
    if not rows or any(not 1 <= m <= kernels.MAX_ROWS for m in rows):
        print(f"error: --rows must lie in 1..{kernels.MAX_ROWS}", file=sys.stderr)
        return 2
    small = [name for name in ("repeats", "threads", "layers", "d_model", "d_ff", "vocab")
             if getattr(args, name) < 1] + (["heads"] if min(H, KV, D) < 1 else [])
    if small:
        print(f"error: {', '.join('--' + n.replace('_', '-') for n in small)} must be >= 1", file=sys.stderr)
        return 2
    if not kernels.available():
        print(f"error: spire kernels unavailable: {kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    d, f = args.d_model, args.d_ff
    shapes = [((H + 2 * KV) * D, d), (d, H * D), (2 * f, d), (d, f)] * args.layers
    if args.head:
        shapes.append((args.vocab, d))
    g = torch.Generator().manual_seed(0)
    out = []
    for wname in (["fp32", "bf16"] if args.weights == "both" else [args.weights]):
        dtype = torch.float32 if wname == "fp32" else torch.bfloat16
        ws = [(torch.randn(n, k, generator=g) * k ** -0.5).to(dtype) for n, k in shapes]
        packed = [kernels.pack_panels(w) for w in ws]
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for M in rows:
            xs = {k: torch.randn(M, k, generator=g) for k in {k for _, k in shapes}}
            paths = {
                "panel": lambda: [kernels.panel_linear(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(ws, packed)],
                "row-major": lambda: [kernels.skinny_linear(xs[w.shape[1]], [w]) for w in ws],
            }
            if dtype == torch.float32:
                paths["torch"] = lambda: [F.linear(xs[w.shape[1]], w) for w in ws]
            for fn in paths.values():
                fn()  # warm-up
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name, fn in paths.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            row = {"weights": wname, "M": M, "bytes": nbytes, **{f"{n}_ms": v * 1e3 for n, v in med.items()},
                   "panel_GBps": nbytes / med["panel"] / 1e9,
                   "speedup_vs_row_major": med["row-major"] / med["panel"]}
            if "torch" in med:
                row["speedup_vs_torch"] = med["torch"] / med["panel"]
            out.append(row)
    base = {r["weights"]: r["panel_ms"] for r in out if r["M"] == 1}
    print(f"decode matmuls: {args.layers} layers{' + head' if args.head else ''}, {args.threads} thread(s), "
          f"median of {args.repeats}")
    print("| weights | M | panel ms | GB/s | row-major ms | torch ms | row-major / panel | torch / panel | "
          "panel M / panel 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out:
        t = f"{r['torch_ms']:.1f}" if "torch_ms" in r else "–"
        s = f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "–"
        rel = f"{r['panel_ms'] / base[r['weights']]:.2f}" if r["weights"] in base else "–"
        print(f"| {r['weights']} | {r['M']} | {r['panel_ms']:.1f} | {r['panel_GBps']:.1f} | {r['row-major_ms']:.1f} "
              f"| {t} | {r['speedup_vs_row_major']:.2f} | {s} | {rel} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": vars(args), "rows": out}, fh, indent=1)
        write_provenance(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
