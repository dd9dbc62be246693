#!/bin/bash
# spire bench at (B, L) = (1, 512) with the main job's SPIRe draft (trained by `spire reproduce` with its
# defaults on this machine), float32 and weight-only bf16, k = 1, 2, 4, τ and tokens/s over 8 held-out
# contexts, one thread, CPU-time clock. Usage: DRAFT=/path/to/draft.safetensors ./run.sh OUTDIR
set -eu
OUT=${1:?output folder}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
export OMP_NUM_THREADS=1
for w in fp32 bf16; do
 for k in 1 2 4; do
  "$ROOT/.venv/bin/spire" bench -B 1 -L 512 -G 64 -k $k --contexts 8 --threads 1 --clock cpu --weights $w \
    --spire-draft "$DRAFT" --out "$OUT/$w-k$k"
 done
done
