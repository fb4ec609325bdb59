#!/usr/bin/env bash
# The base recipes: build one mid-trained base per recipe with base/build.py, then score it on held-out tasks and
# on the same number of its own demo tasks (T 0.4). The base goes to runs/base-study/<name>/tiny (not committed);
# its base.json (recipe, SFT loss) and eval.json (success, valid ratio, demo-task success) are copied to
# results/base-study/<name>/. A recipe already there is skipped. `python results/base-study/table.py` prints the table.
# Usage: bash results/base-study/run.sh NAME [base/build.py flags...]
#   e.g. bash results/base-study/run.sh alf-search-1000 --envs alfworld --alfworld_expert search --demo_tasks 1000
set -eu
cd "$(dirname "$0")/../.."
name=$1; shift
[ -f "results/base-study/$name/eval.json" ] && exit 0
mkdir -p "runs/base-study" "results/base-study/$name"
python base/build.py --out_dir "runs/base-study/$name" --eval_tasks "${EVAL_TASKS:-256}" "$@" \
  >"runs/base-study/$name.log" 2>&1
cp "runs/base-study/$name/tiny/"{base.json,eval.json} "results/base-study/$name/"
