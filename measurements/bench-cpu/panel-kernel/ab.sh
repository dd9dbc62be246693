#!/bin/bash
# Interleaved A/B of `spire bench` at (B, L) = (1, 512): the code before the panel matmul (a worktree of
# commit 7445c6a at $OLD) against this checkout, float32 and weight-only bf16, k = 1, 2, 4, three rounds,
# one thread, CPU-time clock. Usage: OLD=/path/to/worktree/src DRAFT=/path/to/draft.safetensors ./ab.sh OUTDIR
set -eu
OUT=${1:?output folder}
NEW=$(cd "$(dirname "$0")/../../.." && pwd)
export OMP_NUM_THREADS=1
for rep in 1 2 3; do
 for w in fp32 bf16; do
  for k in 1 2 4; do
   for code in old new; do
    if [ $code = old ]; then PP=$OLD; else PP=$NEW/src; fi
    PYTHONPATH=$PP "$NEW/.venv/bin/python" -m spire.cli bench -B 1 -L 512 -G 64 -k $k --threads 1 --clock cpu \
      --weights $w --spire-draft "$DRAFT" --out "$OUT/$code-$w-k$k-r$rep" --format json > /dev/null
   done
  done
 done
done
