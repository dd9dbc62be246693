#!/bin/bash
# Long SPIRe run for issue 40's headline curve: the main job's recipe (8 pruned layers, but spire train's default
# ones, the target's last 8, where the main job takes its first 2 and last 6; sink 1 + window 64,
# MixedLoss 0.5, 16,384-token head, 4 x 256 tokens a step, 2 processes) with the target live on a fresh batch
# every step (no cache: 4.3 M training tokens in the registry text), cosine over 5,000 steps. Resumable.
cd "$(dirname "$0")/../../.."  # the checkout
OUT=~/spire-long/spire-5000
R=""; [ -f $OUT/checkpoint/train_state.json ] && R="--resume"
OMP_NUM_THREADS=1 exec nice -n 10 .venv/bin/torchrun --standalone --nproc_per_node 2 $(pwd)/.venv/bin/spire train \
  --draft spire --out $OUT $R --max-steps 5000 --budget 1000000 --draft-vocab 16384 --compile --eval-every 500 \
  --checkpoint-every 120
