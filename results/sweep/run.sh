#!/usr/bin/env bash
# Issue 25, step 1-2: a no-learning control and GRPO at two learning rates on WebShop, same seed (same task draws).
# Each run checkpoints every update: rerunning this script resumes where it stopped.
set -u
cd "$(dirname "$0")/../.."
common="--env webshop --tasks 4 --group_size 8 --updates ${UPDATES:-60} --val_every 0 --rollouts_every 10 --snapshot_every 10 --seed 0"
for lr in 0 3e-3 1e-2; do
  python 03_grpo.py $common --lr $lr --out_dir runs/sweep/grpo-lr$lr-s0 || exit 1
done
