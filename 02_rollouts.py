"""02 - Rollouts: N tasks x G episodes in lock step, scored token by token.

For every env step of every episode we keep what the RL losses and the paper's analyses need:
    prompt, response tokens y_1..y_L, validity, env reward, the raw observation (GiGPO's anchor state),
    old log-probs   log pi_old(y_t | prompt, y_<t)                          (t = 1..L)
    token entropy   H_t = -sum_v pi(v | .) log pi(v | .) = logsumexp(z) - sum_v softmax(z)_v z_v
    mean hidden     h_bar = (1/L) sum_t h_t, h_t the last-layer hidden state (after the final norm) at token y_t
and per batch the degenerate-pattern rates of the paper:
    duplication   = share of think sentences (>= 20 chars, case/space-normalised) that occur >= 2 times in the same
                    response, pooled over the batch
    hallucination = share of WebShop option clicks that name something not on the current page
    frac_reward_zero_std = share of task groups whose G episode returns are all equal (no episode advantage)
    clip_ratio_response  = share of responses that hit --max_new_tokens without an end-of-turn token

By default (--lean_sampling in 03) these scores are read off the sampling forwards themselves (helpers/batches.py's
sample()); otherwise score() runs length-sorted micro-batches of 16 over the finished batch, each distinct prompt once
(helpers/batches.py's pack_shared, exact).

Deviations from the reference (verl-agent): responses are capped at --max_new_tokens 64 (verl-agent: 512), enough
for the embedded default's one-sentence thoughts; nothing else (the prompts and the projection are 01's copies).

    python 02_rollouts.py --env webshop --tasks 4 --group_size 8      # writes runs/rollouts/webshop.jsonl
"""
import importlib
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as Fn

F = importlib.import_module("01_formats")


# --------------------------------------------------------------------------------------------- scoring
class Policy(torch.nn.Module):
    """Runs the backbone once and applies the unembedding only at response positions.

    One module so that `accelerator.prepare` (DDP) sees every trainable parameter in one forward; 05_seal.py adds
    its head here. Returns per response token y_k: log pi(y_k | .), the entropy of that distribution, and the
    last-layer hidden state at y_k (one position after the state whose logits give log pi(y_k); see
    helpers/batches.py's response_hidden); with logit_states=True that earlier state instead (06's lemma checks
    need it).
    """

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, gather_index, targets, logit_states=False, prefix=None):
        h, h_tok = F.response_hidden(self.lm, input_ids, attention_mask, gather_index, prefix)
        logits = F.body_and_head(self.lm)[1](h)
        if logits.dtype in (torch.float16, torch.bfloat16):  # softmax in full precision
            logits = logits.float()
        logp_all = Fn.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy, (h if logit_states else h_tok)


def pack_values(rows, mask):
    """Per-token lists (e.g. old log-probs) -> a [B, L] tensor shaped like `mask`."""
    out = torch.zeros_like(mask)
    for b, row in enumerate(rows):
        out[b, :len(row)] = torch.tensor(row, dtype=out.dtype)
    return out


def flatten(trajs, tok):
    """One sample per env step; the tokenised prompt is cached on the step."""
    samples = []
    for ti, t in enumerate(trajs):
        for si, s in enumerate(t["steps"]):
            if "prompt_ids" not in s:
                s["prompt_ids"] = tok(s["prompt"], add_special_tokens=False)["input_ids"]
            samples.append(dict(s, traj=ti, step=si, group=t["group"]))
    return samples


@torch.no_grad()
def score(policy, tok, samples, batch_size=16, share=True, merge=True):
    """Adds old_logp, entropy (lists per token) and hidden_mean (vector) to each sample, in place.
    Length-sorted micro-batches (far less padding than arrival order); share: each distinct prompt runs once;
    merge: on the merged LoRA weights (helpers/batches.py's merged_lora)."""
    policy.eval()
    device = next(policy.parameters()).device
    with F.merged_lora(policy.lm, merge):
        for chunk, b in F.batches(tok, samples, batch_size, device, share):
            logp, ent, h = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"],
                                  prefix=b.get("prefix"))
            m = b["mask"]
            hbar = (h * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp(min=1)
            for j, s in enumerate(chunk):
                n = len(s["response_ids"])
                s["old_logp"] = logp[j, :n].tolist()
                s["entropy"] = ent[j, :n].tolist()
                s["hidden_mean"] = hbar[j].tolist()
    return samples


# --------------------------------------------------------------------------------------------- degenerate patterns
SENT_END = re.compile(r"(?<=[.!?])\s+|\n+")


def think_text(response):
    low = response.lower()
    a, b = low.find("<think>"), low.find("</think>")
    return response[a + 7:b] if a != -1 and b > a else response


def duplication(response):
    """(duplicated, kept) sentence counts of one response's think text."""
    sents = [" ".join(s.lower().split()) for s in SENT_END.split(think_text(response))]
    kept = [s for s in sents if len(s) >= 20]
    counts = Counter(kept)
    return sum(1 for s in kept if counts[s] >= 2), len(kept)


def flat_groups(trajs):
    """Share of task groups whose G episodes all got the same env return (TRL's frac_reward_zero_std): their
    episode advantages are 0, so only the -0.1 invalid penalty (and GiGPO's step term) moves them."""
    groups = {}
    for t in trajs:
        groups.setdefault(t["group"], set()).add(round(sum(s["reward"] for s in t["steps"]), 6))
    return sum(len(v) == 1 for v in groups.values()) / max(len(groups), 1)


def batch_metrics(trajs):
    steps = [s for t in trajs for s in t["steps"]]
    dup = [duplication(s["response"]) for s in steps]
    clicks = [s["extras"].get("hallucinated", False) for s in steps if s["extras"].get("option_click")]
    out = F.summarize(trajs)
    out.update(duplication=sum(d for d, _ in dup) / max(sum(k for _, k in dup), 1),
               hallucination=sum(clicks) / len(clicks) if clicks else 0.0,
               response_tokens=sum(len(s["response_ids"]) for s in steps) / max(len(steps), 1),
               frac_reward_zero_std=flat_groups(trajs),
               clip_ratio_response=sum(s.get("truncated", False) for s in steps) / max(len(steps), 1))
    if steps and "entropy" in steps[0]:
        toks = [e for s in steps for e in s["entropy"]]
        out["entropy"] = sum(toks) / max(len(toks), 1)
    return out


# --------------------------------------------------------------------------------------------- collection
def collect(policy, tok, env_name, seeds, group_size, temperature, max_steps, history_length, max_new_tokens,
            progress=False, share=True, merge=True, lean=True):
    """play() from 01 + scoring. Returns (trajectories, flat step samples).
    lean: helpers/batches.py's sample() reads the scores off the sampling forwards, so the scoring pass is not run (the
    same numbers up to summation order); otherwise score() runs over the finished batch."""
    trajs = F.play(policy.lm, tok, env_name, seeds, group_size, temperature, max_steps, history_length,
                   max_new_tokens, progress, share, merge=merge, lean=lean, scores=lean)
    samples = flatten(trajs, tok)
    if not lean:
        score(policy, tok, samples, share=share, merge=merge)
    for s in samples:  # scores go back onto the trajectories so saved records carry them
        trajs[s["traj"]]["steps"][s["step"]].update(
            {k: s[k] for k in ("prompt_ids", "old_logp", "entropy", "hidden_mean")})
    return trajs, samples


def save_jsonl(trajs, path):
    """Trajectory records as a datasets.Dataset written to JSONL (one episode per line)."""
    from datasets import Dataset
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    rows = [{"seed": t["seed"], "group": t["group"], "won": t["won"],
             **({"task_type": t["task_type"]} if "task_type" in t else {}),
             "steps": json.dumps([{k: v for k, v in s.items() if k != "prompt_ids"} for s in t["steps"]])}
            for t in trajs]
    Dataset.from_list(rows).to_json(path, lines=True)
    return path


@dataclass
class Args:
    env: str = "webshop"
    """alfworld or webshop"""
    model: str = "tiny"
    """a base shipped in base/ by name ('tiny', the embedded default; 'tiny-alfworld'), or a Hugging Face id / folder"""
    tasks: int = 4
    """N distinct tasks per batch"""
    group_size: int = 8
    """G episodes per task (the GRPO group)"""
    temperature: float = 1.0
    max_steps: int = 0
    """episode cap; 0 = the env's own (ALFWorld 25, WebShop 10)"""
    history_length: int = 2
    max_new_tokens: int = 64
    seed: int = 0
    out: str = os.path.join(F.ROOT, "runs", "rollouts")
    data: str = ""
    """real benchmark data folder ('' = the synthetic env): ALFWorld's (holding json_2.1.1; '$ALFWORLD_DATA' works)
    or WebShop's data/ (items_shuffle_1000.json, items_ins_v2_1000.json, items_human_ins.json)"""
    split: str = "train"
    """with --data: alfworld train / valid_seen / valid_unseen; webshop train / test (the first 500 goals)"""
    goals: str = "synthetic"
    """with --data on webshop: synthetic (items_ins_v2, verl-agent's default) or human (items_human_ins) goals"""


def main(argv=None):
    args = F.parse_args(Args, argv)
    if args.env not in F.ENVS:
        raise SystemExit(f"error: unknown env {args.env!r}; choose from {', '.join(sorted(F.ENVS))}")
    F.use_data(args.env, args.data, args.split, args.goals)
    torch.manual_seed(args.seed)
    lm, tok = F.load_base(args.model)
    policy = Policy(lm)
    t0 = time.time()
    trajs, samples = collect(policy, tok, args.env, list(range(args.seed, args.seed + args.tasks)), args.group_size,
                             args.temperature, args.max_steps or None, args.history_length, args.max_new_tokens,
                             progress=True)
    m = batch_metrics(trajs)
    m["seconds"] = round(time.time() - t0, 2)
    path = save_jsonl(trajs, os.path.join(args.out, f"{args.env}.jsonl"))
    print(json.dumps(m))
    print(f"wrote {len(trajs)} episodes / {len(samples)} steps to {path}")
    return m


if __name__ == "__main__":
    main()
