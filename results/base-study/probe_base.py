"""Score a base on 256 held-out tasks (T 0.4 and 1.0) and on 256 of its own demo tasks (seeds 0-255, T 0.4), with
the share of steps that repeat an earlier (observation, action) of their episode (loops). One thread.

    python results/base-study/probe_base.py tiny alfworld,webshop      # the shipped base/tiny
    python results/base-study/probe_base.py runs/base-study/NAME/tiny alfworld
"""
import importlib
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
torch.set_num_threads(1)
F = importlib.import_module("01_formats")


def main(base, envs):
    lm, tok = F.load_base(base) if base == "tiny" else F.load_pretrained(base)
    lm.eval()
    for env in envs.split(","):
        for name, seeds, temperature in (("heldout_T0.4", range(100000, 100256), 0.4), ("demo_T0.4", range(256), 0.4),
                                         ("heldout_T1.0", range(100000, 100256), 1.0)):
            t0 = time.time()
            torch.manual_seed(0)
            trajs = F.play(lm, tok, env, list(seeds), temperature=temperature)
            m = F.summarize(trajs)
            repeats = total = 0
            for t in trajs:
                seen = set()
                for s in t["steps"]:
                    repeats += (s["obs"], s["action"]) in seen
                    seen.add((s["obs"], s["action"]))
                    total += 1
            m.update(repeat_frac=repeats / max(total, 1), secs=round(time.time() - t0))
            print(env, name, json.dumps(m), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
