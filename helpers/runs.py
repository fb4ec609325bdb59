"""Run management, which a first reading skips: checkpoints that resume, the PEFT adapter export, metrics.jsonl
and the trackers' names, and the paired sign test of held-out passes. Used by 03_grpo.py's loop and 06's report.
"""
import json
import math
import os
import re

import torch


TRACKER_NAMES = {  # metrics.jsonl key -> the name TRL / verl-agent users look for in TensorBoard or W&B
    "entropy": "entropy", "kl": "kl", "pg_clipfrac": "clip_ratio", "grad_norm": "grad_norm", "loss": "loss",
    "response_tokens": "completions/mean_length", "clip_ratio_response": "completions/clipped_ratio",
    "frac_reward_zero_std": "frac_reward_zero_std", "reward": "reward", "success": "episode/success_rate",
    "valid_ratio": "episode/valid_action_ratio", "mean_steps": "episode/length", "val_success": "val/success_rate",
    "val_valid_ratio": "val/valid_action_ratio", "duplication": "degenerate/duplication",
    "hallucination": "degenerate/hallucination", "logp_correct": "logp/correct", "logp_wrong": "logp/wrong",
    "logp_valid": "logp/valid", "seal_bce": "seal/bce", "seal_acc": "seal/head_accuracy",
}


def tracker_names(m):
    """The numbers of one metrics.jsonl row under the trackers' names (unlisted keys go to timing/ as they are)."""
    return {TRACKER_NAMES.get(k, f"timing/{k}" if "seconds" in k else k): v for k, v in m.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def sign_test(won_a, won_b):
    """Paired comparison of two policies on the same tasks (McNemar's exact test): only the tasks where they
    disagree count. gained = lost by a, won by b; p = two-sided binomial P(split at least this uneven | p=1/2)."""
    gained = sum(b > a for a, b in zip(won_a, won_b))
    lost = sum(a > b for a, b in zip(won_a, won_b))
    n, k = gained + lost, min(gained, lost)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"gained": gained, "lost": lost, "p": p}


def save_ckpt(accelerator, policy, opt, update, path, snapshot=False):
    if not accelerator.is_main_process:
        return
    os.makedirs(path, exist_ok=True)
    raw = accelerator.unwrap_model(policy)
    trainable = {k: v.detach().cpu() for k, v in raw.named_parameters() if v.requires_grad}
    tmp = os.path.join(path, "state.pt.tmp")
    torch.save({"update": update, "params": trainable, "opt": opt.state_dict()}, tmp)
    os.replace(tmp, os.path.join(path, "state.pt"))  # atomic: a crash mid-save never corrupts the checkpoint
    if snapshot:  # parameters only: enough to reload the policy for analysis
        torch.save({"update": update, "params": trainable}, os.path.join(path, f"state-u{update:05d}.pt"))
    save_adapter(raw.lm, update, os.path.join(path, "adapter"))


def save_adapter(lm, update, folder):
    """The LoRA adapter as PEFT saves it (adapter_config.json + adapter_model.safetensors), so that plain
    `PeftModel.from_pretrained(base, folder)` loads it and `merge_and_unload()` works; update.json says which update.
    state.pt stays the resume point (it also holds the optimizer and SEAL's head); this folder is its export,
    written beside it and swapped in whole, so a kill mid-write leaves the previous export or none, never half."""
    if not hasattr(lm, "save_pretrained") or not hasattr(lm, "peft_config"):
        return None
    import shutil
    tmp, old = folder + ".tmp", folder + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    lm.save_pretrained(tmp)
    with open(os.path.join(tmp, "update.json"), "w") as f:
        json.dump({"update": update}, f)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(folder):
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def load_adapter(policy, folder):
    """--eval_ckpt on a PEFT adapter folder (ckpt/adapter, or any LoRA saved by PEFT for this base)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    file = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise SystemExit(f"error: {folder} holds no adapter_model.safetensors (save it with PEFT's save_pretrained)")
    result = set_peft_model_state_dict(policy.lm, load_file(file))
    if getattr(result, "unexpected_keys", None):
        raise SystemExit(f"error: adapter {folder} does not match this model ({len(result.unexpected_keys)} unknown "
                         "tensors)")
    meta = os.path.join(folder, "update.json")
    return json.load(open(meta))["update"] if os.path.exists(meta) else -1


def load_params(policy, file):
    state = torch.load(file, map_location="cpu", weights_only=False)
    named = dict(policy.named_parameters())
    missing = [k for k in state["params"] if k not in named]
    if missing:
        raise SystemExit(f"error: checkpoint {file} does not match this model ({len(missing)} unknown tensors)")
    with torch.no_grad():
        for k, v in state["params"].items():
            named[k].copy_(v)
    return state


def load_ckpt(policy, opt, path):
    state = load_params(policy, os.path.join(path, "state.pt"))
    opt.load_state_dict(state["opt"])
    return state["update"]


EVAL_KEY = ("env", "val_seed", "val_tasks", "val_temperature", "data", "split", "goals")  # passes on the same tasks


def json_line(row):
    """One JSONL line that any JSON reader takes: NaN and inf (e.g. the log-prob of correct steps when no episode
    was won, or the loss of an update whose steps were all skipped) are written as null."""
    clean = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v  # noqa: E731
    return json.dumps({k: clean(v) for k, v in row.items()}, allow_nan=False) + "\n"


def read_jsonl(file):
    if not os.path.exists(file):
        return []
    with open(file) as f:
        return [json.loads(line) for line in f if line.strip()]


def trim_logs(out_dir, update):
    """Resume (or a fresh start over an old folder): keep only what was logged up to the checkpoint's update, so
    every update appears once in metrics.jsonl, rollouts/ and the ckpt/ snapshots even when a kill came between
    logging and saving."""
    path = os.path.join(out_dir, "metrics.jsonl")
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the line a kill cut in half
            continue
        if row.get("update", 0) <= update:
            keep.append(row)
    if len(keep) < len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
        os.replace(path + ".tmp", path)
    for sub, pattern in (("rollouts", r"update(\d+)-rank\d+\.jsonl$"), ("ckpt", r"state-u(\d+)\.pt$")):
        folder = os.path.join(out_dir, sub)
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            hit = re.match(pattern, name)
            if hit and int(hit.group(1)) > update:
                os.remove(os.path.join(folder, name))


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def series(rows, key):
    """(updates, values) of the rows where key holds a finite number."""
    pts = [(r["update"], r[key]) for r in rows if finite(r.get(key))]
    return [u for u, _ in pts], [v for _, v in pts]
