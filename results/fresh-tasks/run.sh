#!/usr/bin/env bash
# One run of the fresh-task experiment (PLAN.md) and its held-out pass. Runs checkpoint every update, so rerunning
# resumes; a finished run's args.json, metrics.jsonl and eval.jsonl (with the base's pass on the same 512 tasks, to
# pair with) go to results/fresh-tasks/<env>-<name>-s<seed>/ (the single-turn runs to results/fresh-single-turn/).
# Usage: bash results/fresh-tasks/run.sh NAME SEED     NAME: grpo, grpo+seal, gigpo, gigpo+seal, lr0,
#          grpo+seal-a<alpha> (the sweep), single-grpo, single-lr0 (the single-turn contrast)
#   ENV (alfworld), MODEL (base/tiny-alfworld), UPDATES (120), TASKS (512) override the plan's values for a trial;
#   VAL_SEED (100000) moves the held-out tasks.
set -eu
cd "$(dirname "$0")/../.."
name=$1 seed=$2 env=${ENV:-alfworld} model=${MODEL:-base/tiny-alfworld}
common="--env $env --model $model --seed $seed --tasks 4 --group_size 8 --updates ${UPDATES:-120} --lr 1e-3
        --val_every 0 --rollouts_every 10 --snapshot_every 20 --analyse false"
experiment=fresh-tasks
case $name in
  grpo) cmd="03_grpo.py $common";;
  grpo+seal) cmd="05_seal.py $common";;
  gigpo) cmd="04_gigpo.py $common";;
  gigpo+seal) cmd="05_seal.py $common --algo gigpo";;
  lr0) cmd="03_grpo.py $common --lr 0 --rollout_only true";;
  grpo+seal-a*) cmd="05_seal.py $common --alpha ${name#grpo+seal-a}";;
  single-grpo) cmd="03_grpo.py $common --single_turn true"; experiment=fresh-single-turn;;
  single-lr0) cmd="03_grpo.py $common --single_turn true --lr 0 --rollout_only true"; experiment=fresh-single-turn;;
  *) echo "error: unknown run name $name" >&2; exit 1;;
esac
out="runs/$experiment/$env-$name-s$seed"
mkdir -p "runs/$experiment" "$out"
python $cmd --out_dir "$out" >/dev/null 2>"$out.log"
if [ "$experiment" = fresh-tasks ]; then
  eval_flags="--env $env --model $model --val_tasks ${TASKS:-512} --val_seed ${VAL_SEED:-100000} --seed 0"
  base="runs/fresh-tasks/$env-base-pass-${VAL_SEED:-100000}"  # the base's pass, once for the experiment
  if [ ! -s "$base/eval.jsonl" ]; then
    rm -rf "$base.tmp"
    python 03_grpo.py $eval_flags --eval_ckpt base --out_dir "$base.tmp" >/dev/null 2>"$base.log"
    rm -rf "$base" && mv "$base.tmp" "$base"
  fi
  grep -q '"ckpt": "base"' "$out/eval.jsonl" 2>/dev/null || cat "$base/eval.jsonl" >>"$out/eval.jsonl"
  # a rollout-only control's adapter is the base's: its pass is the base's
  [ "$name" = lr0 ] || grep -q '"ckpt": "'"$out"'/ckpt/adapter"' "$out/eval.jsonl" ||
    python 03_grpo.py $eval_flags --eval_ckpt "$out/ckpt" --out_dir "$out" 2>>"$out.log" | tail -1
fi
mkdir -p "results/$experiment/$env-$name-s$seed"
cp "$out/"{args.json,metrics.jsonl} "results/$experiment/$env-$name-s$seed/"
[ -f "$out/eval.jsonl" ] && cp "$out/eval.jsonl" "results/$experiment/$env-$name-s$seed/"
exit 0
