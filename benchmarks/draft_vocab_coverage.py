"""What a draft vocabulary of N tokens costs in acceptance, on held-out text, before any training.

A draft restricted to N tokens has q = 0 elsewhere, so its acceptance alpha = sum_i min(p_i, q_i) is at most
the target's probability mass inside the N tokens, and at T = 0 it can only match the target's argmax when that
argmax is inside. For several N (the N most frequent tokens of the training text) this prints both on held-out
windows, next to the head's share of a draft step (N / V of the unembedding's bytes).

    python benchmarks/draft_vocab_coverage.py                       # N = 4096 ... 49152, 16 windows
    python benchmarks/draft_vocab_coverage.py -N 8192 -N 16384 --windows 32 --out coverage.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spire.data import document_separator_id, prepare_data
from spire.drafts.vocab import frequent_tokens
from spire.loading import load_target

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # benchmarks/_provenance.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-N", type=int, action="append", help="draft vocabulary sizes (repeatable)")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    target, tokenizer, _ = load_target()
    data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer))
    V = target.cfg.vocab_size
    sizes = sorted(set(a.N or [4096, 8192, 16384, 32768, V]))
    windows = data.heldout_contexts(192, 64, a.windows, seed=1)  # the trainer's held-out windows
    mass = {n: 0.0 for n in sizes}
    top1 = {n: 0 for n in sizes}
    inside = {n: torch.zeros(V, dtype=torch.bool) for n in sizes}
    for n in sizes:
        inside[n][frequent_tokens(data.train.tokens, n, V)] = True
    count = 0
    with torch.no_grad():
        for i in range(0, len(windows), 4):
            tokens = windows[i: i + 4]
            pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
            p = target(tokens, pos).logits.softmax(-1).flatten(0, 1)  # (B*T, V)
            arg = p.argmax(-1)
            for n in sizes:
                mass[n] += float(p[:, inside[n]].sum())
                top1[n] += int(inside[n][arg].sum())
            count += p.shape[0]
    rows = [{"N": n, "p_mass_inside": mass[n] / count, "argmax_inside": top1[n] / count, "head_share": n / V}
            for n in sizes]
    print(f"held-out: {len(windows)} windows x {windows.shape[1]} tokens; draft vocabulary = the N most frequent "
          "training tokens")
    print(f"{'N':>7s} {'E[p mass inside]':>17s} {'argmax inside':>14s} {'head bytes vs full':>19s}")
    for r in rows:
        print(f"{r['N']:7d} {r['p_mass_inside']:17.4f} {r['argmax_inside']:14.4f} {r['head_share']:18.3f}x")
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "windows": len(windows)}, indent=1))
        write_provenance(a.out)


if __name__ == "__main__":
    main()
