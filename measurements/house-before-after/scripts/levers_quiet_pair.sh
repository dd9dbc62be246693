#!/bin/bash
export OMP_NUM_THREADS=1
cd "$(dirname "$0")/../../.."  # the checkout
PY=$PWD/.venv/bin/python
W=${W:-$PWD/w}  # the folder holding the before/ and after/ worktrees (this run: <tmp>/w)
OUT=$W/goal3
for side in after before; do
  dir=$W/$side
  (cd $dir && PYTHONPATH=$dir/src $PY benchmarks/train_throughput.py --levers --steps 5 --out $OUT/levers-$side-3.json > $OUT/levers-$side-3.txt 2>&1; echo "$(date +%T) levers $side 3 rc $?" >> $OUT/progress3.txt)
done
echo done >> $OUT/progress3.txt
