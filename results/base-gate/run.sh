#!/usr/bin/env bash
# The base gate (PLAN.md): the base's held-out pass, then GRPO and its no-learning control on fresh tasks from that
# base, then the GRPO adapter's held-out pass on the same 512 tasks. Runs checkpoint every update, so rerunning
# resumes; a finished run's args.json, metrics.jsonl and eval.jsonl go to results/base-gate/<env>-<name>-<run>/.
# Usage: bash results/base-gate/run.sh ENV MODEL [NAME]     (MODEL: tiny = the shipped base, or a base folder)
#   RUNS="grpo lr0" (default; RUNS=grpo and RUNS=lr0 in two shells run them side by side; RUNS="" the base's
#   pass alone; BASE_PASS=0 leaves the base's pass to another shell and waits for it before the adapter's pass);
#   UPDATES (120), LR (1e-3), SEED (0), TASKS (512 held-out) override the plan's values for a trial; VAL_SEED
#   (100000) moves the held-out tasks (PLAN.md's third candidate).
set -eu
cd "$(dirname "$0")/../.."
env=$1 model=$2 name=${3:-base}
flags="--env $env --model $model --seed ${SEED:-0} --tasks 4 --group_size 8 --updates ${UPDATES:-120} --val_every 0
       --rollouts_every 10 --snapshot_every 20"
eval_flags="--env $env --model $model --val_tasks ${TASKS:-512} --val_seed ${VAL_SEED:-100000} --seed ${SEED:-0}"
mkdir -p runs/base-gate
base="runs/base-gate/$env-$name-base-pass"  # the base's pass, once; each run's eval.jsonl gets a copy to pair with
if [ "${BASE_PASS:-1}" = 1 ] && [ ! -s "$base/eval.jsonl" ]; then
  rm -rf "$base.tmp"
  python 03_grpo.py $eval_flags --eval_ckpt base --out_dir "$base.tmp" >/dev/null 2>"$base.log"
  rm -rf "$base" && mv "$base.tmp" "$base"
fi
for run in ${RUNS-grpo lr0}; do
  out="runs/base-gate/$env-$name-$run"
  mkdir -p "$out"
  lr="${LR:-1e-3}"; [ "$run" = lr0 ] && lr="0 --rollout_only true"  # the same rollouts as lr 0, no update
  python 03_grpo.py $flags --lr $lr --out_dir "$out" >/dev/null 2>"$out.log"
  while [ ! -s "$base/eval.jsonl" ]; do sleep 30; done  # the adapter's pass is paired with the base's
  grep -q '"ckpt": "base"' "$out/eval.jsonl" 2>/dev/null || cat "$base/eval.jsonl" >>"$out/eval.jsonl"
  # the control's adapter never moves (--rollout_only): its held-out pass would be the base's
  [ "$run" = lr0 ] || python 03_grpo.py $eval_flags --eval_ckpt "$out/ckpt" --out_dir "$out" 2>>"$out.log" | tail -1
  mkdir -p "results/base-gate/$env-$name-$run"
  cp "$out/"{args.json,metrics.jsonl,eval.jsonl} "results/base-gate/$env-$name-$run/"
done
