#!/bin/bash
# usage: run_all.sh SEED0 SEED1 SUFFIX  -- the 8 configurations, sequentially
cd "$(dirname "$0")/../.." && mkdir -p benchmarks/coverage_study/out
for c in cnn bag_mean bag_sum cnn_init; do
  for mx in 16 None; do
    python benchmarks/coverage_study/run_meter.py $c 32 $mx 300 $1 $2 ${c}_${mx}_$3
  done
done
