"""On-policy training windows for `benchmarks/t1_recipes.py --variant NAME:onpolicy=FILE` (issue "SPIRe at T = 1").

The first STEPS training batches `spire train` draws (4 x 256 tokens, seed 0: the main job's cached batches), with
the last G tokens of every window replaced by the target's own continuation of its first 256 - G tokens at
temperature T: sampled losslessly with MagicDec speculation (sink 1 + window 64, k = 4, only to go faster), or with
``--ad-bf16`` by plain decoding with the target's weights rounded to bfloat16 (3-4x faster on a CPU with AMX; the
text of a slightly different model than the float32 target, whose distributions the training cache then holds).
``--rows 2,3`` writes tails only in those rows of every batch (the others stay natural). The rows that get a tail are
generated CHUNK at a time, chunk c (from 0) with seed 10,000 + c x CHUNK. Resumable: every chunk is saved to
FILE.part with the settings, and a resume with other settings is refused.

    python benchmarks/onpolicy_tails.py --steps 500 -G 64 --temperature 1 --out onpol_t1_500_64.pt
    python benchmarks/onpolicy_tails.py --steps 500 -G 224 --rows 2,3 --ad-bf16 --chunk 250 --out onpol_t1_half.pt

Writes FILE: {"natural": (4 STEPS, 256), "generated": (4 STEPS, 256) int64 token ids, "steps", "G"}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from spire.data import document_separator_id, prepare_data
from spire.drafts import make_draft
from spire.loading import load_target
from spire.sampling import SamplingParams
from spire.speculative import generate
from spire.training.sources import step_generator

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # benchmarks/_provenance.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500, help="training batches (the main job caches 500)")
    ap.add_argument("-G", type=int, default=64, help="tokens the target writes at the end of each 256-token window")
    ap.add_argument("--temperature", type=float, default=1.0, help="the target's sampling temperature")
    ap.add_argument("--chunk", type=int, default=100, help="rows generated at once (and saved)")
    ap.add_argument("--rows", default="0,1,2,3", help="rows of every 4-row batch that get a tail")
    ap.add_argument("--ad-bf16", action="store_true", help="plain decoding, target weights in bfloat16")
    ap.add_argument("--out", required=True, help="the file to write (FILE.part while it runs)")
    args = ap.parse_args()
    B, T, G = 4, 256, args.G
    try:
        chosen = sorted({int(r) for r in args.rows.split(",")})
    except ValueError:
        raise SystemExit(f"error: --rows takes row numbers in 0..{B - 1} separated by commas, got {args.rows!r}")
    if not chosen or not set(chosen) <= set(range(B)) or args.steps < 1 or not 1 <= G < T:
        raise SystemExit(f"error: --rows must name rows in 0..{B - 1} (got {args.rows!r}), --steps must be >= 1 "
                         f"(got {args.steps}) and -G in 1..{T - 1} (got {G})")
    target, tok, _ = load_target(dtype=torch.bfloat16 if args.ad_bf16 else torch.float32, progress=False)
    data = prepare_data(tok, eos_id=document_separator_id(tok), progress=False)
    natural = torch.cat([data.sample_train_batch(B, T, step_generator(0, s)) for s in range(args.steps)])
    todo = torch.tensor([i for i in range(len(natural)) if i % B in chosen])  # the rows that get a tail
    settings = {"steps": args.steps, "G": G, "temperature": args.temperature, "rows": chosen,
                "ad_bf16": args.ad_bf16, "chunk": args.chunk}
    part = args.out + ".part"
    saved = torch.load(part) if os.path.exists(part) else {"generated": natural.clone(), "done": 0,
                                                            "settings": settings}
    if saved.get("settings") != settings:
        raise SystemExit(f"error: {part} was started with other settings ({saved.get('settings')}); delete it or "
                         "rerun with those")
    generated, t0 = saved["generated"], time.time()
    for i in range(saved["done"], len(todo), args.chunk):
        rows = todo[i: i + args.chunk]
        draft = None if args.ad_bf16 else make_draft("magicdec", target, sink=1, window=64)
        r = generate(target, natural[rows, :T - G], G, draft=draft, k=4,
                     params=SamplingParams(temperature=args.temperature), seed=10_000 + i)
        generated[rows, T - G:] = torch.tensor([x[:G] for x in r.tokens])  # no EOS ids given: G tokens a row
        torch.save({"generated": generated, "done": i + args.chunk, "settings": settings}, part)
        print(f"rows {min(i + args.chunk, len(todo))}/{len(todo)} {time.time() - t0:.0f} s", flush=True)
    torch.save({"natural": natural, "generated": generated, "steps": args.steps, "G": G, "settings": settings},
               args.out)
    if os.path.exists(part):
        os.remove(part)
    write_provenance(args.out)
    print(f"wrote {args.out}: {(generated != natural).float().mean().item():.3f} of the tokens changed")


if __name__ == "__main__":
    main()
