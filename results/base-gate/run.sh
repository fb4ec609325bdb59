#!/usr/bin/env bash
# The base gate (PLAN.md): GRPO and its lr-0 control on fresh tasks from one base, then the base and both final
# adapters on the same 512 held-out tasks. Runs checkpoint every update, so rerunning resumes; a finished run's
# args.json, metrics.jsonl and eval.jsonl go to results/base-gate/<env>-<name>/.
# Usage: bash results/base-gate/run.sh ENV MODEL [NAME]     (MODEL: tiny = the shipped base, or a base folder)
#   UPDATES (120), LR (1e-3), SEED (0), TASKS (512 held-out) override the plan's values for a trial run.
set -eu
cd "$(dirname "$0")/../.."
env=$1 model=$2 name=${3:-base}
flags="--env $env --model $model --seed ${SEED:-0} --tasks 4 --group_size 8 --updates ${UPDATES:-120} --val_every 0
       --rollouts_every 10 --snapshot_every 20"
eval_flags="--env $env --model $model --val_tasks ${TASKS:-512} --seed ${SEED:-0}"
mkdir -p runs/base-gate
for run in ${RUNS:-grpo lr0}; do  # RUNS=grpo and RUNS=lr0 in two shells run them side by side
  out="runs/base-gate/$env-$name-$run"
  lr="${LR:-1e-3}"; [ "$run" = lr0 ] && lr="0 --rollout_only true"  # the same rollouts as lr 0, no update
  python 03_grpo.py $flags --lr $lr --out_dir "$out" >/dev/null 2>"$out.log"
  # the base's pass on the same held-out seeds sits in the run's eval.jsonl, so 03 pairs them (vs_base)
  grep -q '"ckpt": "base"' "$out/eval.jsonl" 2>/dev/null ||
    python 03_grpo.py $eval_flags --eval_ckpt base --out_dir "$out" >/dev/null 2>>"$out.log"
  python 03_grpo.py $eval_flags --eval_ckpt "$out/ckpt" --out_dir "$out" 2>>"$out.log" | tail -1
  mkdir -p "results/base-gate/$env-$name-$run"
  cp "$out/"{args.json,metrics.jsonl,eval.jsonl} "results/base-gate/$env-$name-$run/"
done
