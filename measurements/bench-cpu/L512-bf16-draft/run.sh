#!/bin/bash
# spire bench at (B, L) = (1, 512), float32 target, the main job's SPIRe draft with its own weights in float32
# and in bf16 (--draft-weights), k = 1, 2, 3, τ and tokens/s over 8 held-out contexts, one thread, CPU-time
# clock; rounds interleave the two draft settings. Usage: DRAFT=/path/to/draft.safetensors ./run.sh OUTDIR [ROUNDS]
set -eu
OUT=${1:?output folder}
ROUNDS=${2:-2}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
export OMP_NUM_THREADS=1
for r in $(seq 1 "$ROUNDS"); do
 for k in 1 2 3; do
  for dw in fp32 bf16; do
   "$ROOT/.venv/bin/spire" bench -B 1 -L 512 -G 64 -k $k --contexts 8 --threads 1 --clock cpu \
     --draft-weights $dw --spire-draft "$DRAFT" --out "$OUT/r$r-k$k-$dw"
  done
 done
done
