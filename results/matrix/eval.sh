#!/usr/bin/env bash
# Held-out scores of the matrix: the base once, then each finished run's final adapter, on the same
# held-out seeds (val_seed 100000 ..., T 0.4, the same sampling seed), so 03's --eval_ckpt pairs each run with the
# base task by task (eval.jsonl's vs_base). The eval.jsonl of each run is copied to results/matrix/<run>/.
# Usage: bash results/matrix/eval.sh N run...   (N held-out tasks; the reported numbers use 512)
set -eu
cd "$(dirname "$0")/../.."
n=$1; shift
flags="--env alfworld --val_tasks $n"
[ -f "runs/matrix/base-eval-$n/eval.jsonl" ] || python 03_grpo.py $flags --eval_ckpt base --out_dir "runs/matrix/base-eval-$n"
for run in "$@"; do
  # the base pass of this size next to the run's own, so that 03 pairs them (vs_base) and 06 finds it
  grep '"ckpt": "base"' "runs/matrix/$run/eval.jsonl" 2>/dev/null | grep -q "\"val_tasks\": $n," ||
    cat "runs/matrix/base-eval-$n/eval.jsonl" >> "runs/matrix/$run/eval.jsonl"
  python 03_grpo.py $flags --eval_ckpt "runs/matrix/$run/ckpt" --out_dir "runs/matrix/$run"
  cp "runs/matrix/$run/eval.jsonl" "results/matrix/$run/"
done
