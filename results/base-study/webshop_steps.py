"""Where a WebShop base fails: play held-out tasks at T 0.4 and, at every step, compare the base's action with its
expert's from the same state (the expert it imitated: visible, or oracle for the shipped base/tiny).
search (copy the instruction), open (click the first product on the results page whose title names the asked type
within budget), page (next > or back to search), option (click an asked option on the item page), back (< prev from
an item that lacks an asked option), buy. Prints the agreement per kind and how the episodes ended. One thread.

    python results/base-study/webshop_steps.py runs/base-study/ws-visible-1000-fmt0.3/tiny [tasks] [expert]
    python results/base-study/webshop_steps.py tiny 48 oracle
"""
import collections
import importlib
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
torch.set_num_threads(1)
F = importlib.import_module("01_formats")
from envs.webshop import WebShopEnv  # noqa: E402


def kind(page, expert):
    if page == "search":
        return "search"
    if page == "results":
        return "open" if expert.startswith("click[b0") else "page"
    if page == "item":
        return {"click[buy now]": "buy", "click[< prev]": "back"}.get(expert, "option")
    return "other"


def main(base, tasks=64, expert="visible"):
    lm, tok = F.load_base(base) if base == "tiny" else F.load_pretrained(base)
    lm.eval()
    torch.manual_seed(0)
    seeds = list(range(100000, 100000 + tasks))
    trajs = F.play(lm, tok, "webshop", seeds, temperature=0.4, env_kw={"expert": expert})
    agree, total, ends = collections.Counter(), collections.Counter(), collections.Counter()
    for t in trajs:  # replay the episode in a fresh env to read the expert's action in each state the base reached
        env = WebShopEnv(expert=expert)
        _, info = env.reset(t["seed"])
        for s in t["steps"]:
            k = kind(info["page"], info["expert_action"] or "")
            total[k] += 1
            agree[k] += s["action"] == info["expert_action"]
            _, _, _, info = env.step(s["action"])
        ends[env.outcome()] += 1
    out = {"base": base, "tasks": tasks, "expert": expert, "success": F.summarize(trajs)["success"],
           "agreement": {k: [agree[k], total[k]] for k in ("search", "open", "page", "option", "back", "buy", "other")
                         if total[k]},
           "outcomes": dict(ends)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64, sys.argv[3] if len(sys.argv) > 3 else "visible")
