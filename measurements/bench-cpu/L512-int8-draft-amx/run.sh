#!/bin/bash
# spire bench at (B, L) = (1, 512), the main job's SPIRe draft with its own weights in bf16 and in int8
# (--draft-weights), τ and tokens/s over 8 held-out contexts, one thread, CPU-time clock; rounds interleave the
# two draft settings; a finished run is skipped (rerun to resume). WEIGHTS=bf16: the target's weights rounded to
# bf16 too (--weights bf16; runs named rR-kK-wbf16-DW), else a float32 target (rR-kK-DW).
# Usage: DRAFT=/path/to/draft.safetensors [WEIGHTS=bf16] ./run.sh OUTDIR [ROUNDS] ["KS"]
set -eu
OUT=${1:?output folder}
ROUNDS=${2:-2}
KS=${3:-1 2 3}
W=${WEIGHTS:-fp32}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
export OMP_NUM_THREADS=1
tag=$([ "$W" = fp32 ] && echo "" || echo "w$W-")
for r in $(seq 1 "$ROUNDS"); do
 for k in $KS; do
  for dw in bf16 int8; do
   run="$OUT/r$r-k$k-$tag$dw"
   [ -f "$run/bench.json" ] && continue
   "$ROOT/.venv/bin/spire" bench -B 1 -L 512 -G 64 -k $k --contexts 8 --threads 1 --clock cpu \
     --weights "$W" --draft-weights $dw --spire-draft "$DRAFT" --out "$run"
  done
 done
done
