#!/usr/bin/env bash
# The matrix, in the setting sweep step 2 chose (ALFWorld, the 4 fixed train tasks 0-3 x 4 episodes,
# lr 2e-3, 40 updates; see results/README.md for why): a no-learning control, GRPO, GRPO + SEAL, GiGPO, GiGPO + SEAL.
# Every run plays the same four tasks; the seed sets the sampling and the LoRA init. Each run
# checkpoints every update, so rerunning this script resumes; a finished run's small logs (args.json, metrics.jsonl)
# are copied to results/matrix/<run>/ and that run is skipped from then on. Rollouts and checkpoints stay in runs/.
# Usage: bash results/matrix/run.sh [seed ...]   (default: 0)
#   ALPHAS="0.1 0.005" bash results/matrix/run.sh 0   SEAL's alpha sweep instead (GRPO + SEAL, runs named -a<alpha>)
#   CONTROL=0 bash results/matrix/run.sh 2            the matrix without the seed's lr-0 control
set -u
cd "$(dirname "$0")/../.."
mkdir -p runs/matrix
run() {  # name script [flags...]
  local name=$1 script=$2; shift 2
  [ -f "results/matrix/$name/metrics.jsonl" ] && return 0
  python "$script" --env alfworld --train_seeds 0,1,2,3 --group_size 4 --updates "${UPDATES:-40}" --val_every 0 \
    --rollouts_every 10 --snapshot_every 10 --lr 2e-3 "$@" --out_dir "runs/matrix/$name" \
    >/dev/null 2>"runs/matrix/$name.log" || exit 1
  mkdir -p "results/matrix/$name" && cp "runs/matrix/$name/"{args.json,metrics.jsonl} "results/matrix/$name/"
}
for s in "${@:-0}"; do  # the control last: seed 0's control already fixed the eruption threshold
  if [ -n "${ALPHAS:-}" ]; then
    for a in $ALPHAS; do
      case $a in 0|0.0|0.02) echo "alpha $a: the matrix's own GRPO / GRPO + SEAL run, skipped" >&2; continue;; esac
      run "alfworld-grpo+seal-a$a-s$s" 05_seal.py --seed "$s" --alpha "$a"
    done
    continue
  fi
  run "alfworld-grpo-s$s" 03_grpo.py --seed "$s"
  run "alfworld-grpo+seal-s$s" 05_seal.py --seed "$s"
  run "alfworld-gigpo-s$s" 04_gigpo.py --seed "$s"
  run "alfworld-gigpo+seal-s$s" 05_seal.py --seed "$s" --algo gigpo
  [ "${CONTROL:-1}" = 0 ] || run "alfworld-lr0-s$s" 03_grpo.py --seed "$s" --lr 0
done
