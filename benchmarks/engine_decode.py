"""Usage: PYTHONPATH=CHECKOUT/src OMP_NUM_THREADS=1 python benchmarks/engine_decode.py LABEL (alternate old and new checkouts).

Engine decode speed, old vs new: generate_batch (the engine) at B = 1 and 8, AD and MagicDec k = 4, 128-token
prompts, 24 new tokens, 1 torch thread, median of 3 timed runs after a warm-up. argv[1]: label."""
import json, statistics, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
try:
    from spire.engine.engine import generate_batch
except ImportError:
    from spire.serving.engine import generate_batch
from spire.drafts.magicdec import MagicDecDraft
from spire.loading import load_target

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import provenance  # benchmarks/_provenance.py
target, tok, _ = load_target(progress=False)
out = {}
for B in (1, 8):
    ids = [[(i * 37 + j) % 5000 + 100 for j in range(128)] for i in range(B)]
    for name in ("AD", "MagicDec"):
        run = lambda: generate_batch(target, ids, 24, draft=None if name == "AD" else MagicDecDraft(1, 64), k=4)
        run()
        ts = []
        for _ in range(3):
            t = time.perf_counter(); r = run(); ts.append(time.perf_counter() - t)
        out[f"B={B} {name}"] = round(B * 24 / statistics.median(ts), 2)
print(sys.argv[1], json.dumps({**out, "provenance": provenance()}), flush=True)
