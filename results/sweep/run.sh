#!/usr/bin/env bash
# Sweep steps 1-2 on ALFWorld: a no-learning control, GRPO and GRPO + SEAL, one seed (same task draws).
# Each run checkpoints every update: rerunning this script resumes where it stopped.
set -u
cd "$(dirname "$0")/../.."
common="--env alfworld --tasks 2 --group_size 8 --updates ${UPDATES:-40} --val_every 0 --rollouts_every 10 --snapshot_every 10 --seed 0"
python 03_grpo.py $common --lr 0 --out_dir runs/sweep/alfworld-lr0-s0 || exit 1
python 03_grpo.py $common --lr 3e-3 --out_dir runs/sweep/alfworld-grpo-lr3e-3-s0 || exit 1
python 05_seal.py $common --lr 3e-3 --out_dir runs/sweep/alfworld-grpo+seal-lr3e-3-s0 || exit 1
# Step 2, lower lr: does GRPO learn before it erupts at lr 1e-3?
python 03_grpo.py $common --lr 1e-3 --out_dir runs/sweep/alfworld-grpo-lr1e-3-s0 || exit 1
