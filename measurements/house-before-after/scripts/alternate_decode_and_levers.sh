#!/bin/bash
# Goal 3 of issue 32: the same benchmark ratios before (49b105d) and after (HEAD), runs alternated.
cd "$(dirname "$0")/../../.."  # the checkout
export OMP_NUM_THREADS=1
PY=$PWD/.venv/bin/python
W=${W:-$PWD/w}  # the folder holding the before/ and after/ worktrees (this run: <tmp>/w)
OUT=$W/goal3
mkdir -p $OUT
for rep in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then dir=$W/before; else dir=$W/after; fi
    (cd $dir && PYTHONPATH=$dir/src $PY benchmarks/decode_vs_hf.py -B 1 -B 8 -L 128 -G 64 --repeats 3 --threads 1 --clock cpu --json $OUT/decode-$side-$rep.json > $OUT/decode-$side-$rep.txt 2>&1)
    echo "$(date +%T) decode $side $rep rc $?" >> $OUT/progress.txt
  done
done
for rep in 1 2; do
  for side in before after; do
    if [ $side = before ]; then dir=$W/before; else dir=$W/after; fi
    (cd $dir && PYTHONPATH=$dir/src $PY benchmarks/train_throughput.py --levers --steps 5 --out $OUT/levers-$side-$rep.json > $OUT/levers-$side-$rep.txt 2>&1)
    echo "$(date +%T) levers $side $rep rc $?" >> $OUT/progress.txt
  done
done
echo done >> $OUT/progress.txt
