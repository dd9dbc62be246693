#!/bin/bash
export OMP_NUM_THREADS=1
PY=/work/main/.venv/bin/python
OUT=/tmp/w/goal3
for side in after before; do
  dir=/tmp/w/$side
  (cd $dir && PYTHONPATH=$dir/src $PY benchmarks/train_throughput.py --levers --steps 5 --out $OUT/levers-$side-3.json > $OUT/levers-$side-3.txt 2>&1; echo "$(date +%T) levers $side 3 rc $?" >> $OUT/progress3.txt)
done
echo done >> $OUT/progress3.txt
