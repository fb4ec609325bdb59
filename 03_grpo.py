"""03 - GRPO for multi-turn agents, with Accelerate, as verl-agent computes it.

Every env step is one training row (prompt = the step's observation prompt, response = the step's output).
Row score: the trajectory's episode return (env rewards only) minus the invalid-format penalty of that step alone,
    score_row = sum_t r_t  -  0.1 [this step invalid]                                              (1)
Group-relative advantage over all rows of the task's G trajectories (a trajectory weighs by its number of steps),
broadcast to every response token of the row:
    A_row = (score_row - mean_rows score) / (std_rows score + 1e-6)   (2)  (unbiased std; one row: mean 0, std 1)
PPO-clip with dual clip per token, ratio rho = exp(log pi - log pi_old):
    l_pg = max( -rho A, -clip(rho, 1 - eps, 1 + eps) A ),  eps = 0.2;   if A < 0: l_pg = min(l_pg, -c A), c = 3  (3)
Low-variance KL (k3) to the reference policy pi_ref = the base model with the LoRA adapter disabled:
    l_kl = clamp( exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1, -10, 10 )                        (4)
Entropy bonus and token-mean aggregation over all response tokens T of the mini-batch (across processes):
    L = (1/|T|) sum_{tokens} ( l_pg + beta l_kl - c_H H_t ),  beta = 0.01, c_H = 0.001                   (5)
The clip fraction counts the tokens where the clipped term is the one taken. One optimizer step per mini-batch:
--minibatches contiguous chunks of the task-major batch, no shuffle (verl: data.split).

Deviations from the reference (verl-agent), each a flag:
    --adv_level traj       one return per trajectory, R_i = sum_t (r_t - 0.1 [t invalid]), normalised over the G
                           trajectories: the form the paper's lemmas are written in (default row = the reference)
    --lr 2e-4, LoRA r 16   the paper trains full 1.5B-7B models at lr 2e-6; here a LoRA on a 1M-parameter model
    --tasks 4, --minibatches 2, --history_length 2   CPU-sized batches and prompts (verl-agent: 16 x 8, 5 steps)
    token-mean             over all response tokens of the mini-batch, exactly, whatever the micro-batching (verl
                           takes the mean of each micro-batch and averages those: the same when micro-batches hold
                           equal token counts); this is what makes the 2-process update equal the 1-process one
    --share_prefix true    the old log-prob, reference and update passes run each distinct prompt once
                           (helpers/batches.py's pack_shared) in length-sorted micro-batches of --micro_batch samples
                           that keep a prompt's samples together: the same numbers up to summation order (false = every
                           sample its own prompt, as verl does); it changes speed only, so it is not a deviation of the
                           math
    --merge_lora true      the rollout and the old log-prob pass run on the merged weights W + s B A
                           (helpers/batches.py's merged_lora), the same function without the LoRA matmuls; speed only,
                           like the above
    --lean_sampling true   the lean decoding loop (helpers/batches.py's sample) instead of transformers' generate (the
                           same tokens for the same seed), which also reads the old log-probs, entropies and hidden
                           means off its forwards, so 02's scoring pass does not run (the same numbers up to summation
                           order); speed only
A mini-batch whose loss or gradient norm is not finite skips its optimizer step on every process (as verl skips a
step with a non-finite gradient norm), counted as skipped_steps; --max_skipped_steps in a row stop the run.

Logs: metrics.jsonl (one row an update), trackers through Accelerate (--report_to tensorboard|wandb|none) under the
names TRL and verl-agent users know, ckpt/state.pt every update (LoRA, SEAL head, optimizer: the resume point) and
ckpt/adapter/ beside it, the adapter as PEFT's save_pretrained writes it (all in helpers/runs.py).

    python 03_grpo.py --env webshop --updates 200                # single process; ends with runs/.../analysis/
    accelerate launch --multi_gpu --num_processes 2 03_grpo.py   # 2-process data parallel (gloo on CPU)
    python benchmarks/speed.py --env webshop                     # time one update, plain vs fast path
    python 03_grpo.py --env webshop --eval_ckpt runs/grpo-webshop-s0/ckpt/state.pt --val_tasks 256  # evaluate
"""
import contextlib
import importlib
import importlib.util
import json
import math
import os
import random
import time
from dataclasses import dataclass, asdict

import torch

from helpers.runs import (EVAL_KEY, json_line, load_adapter, load_ckpt, load_params, read_jsonl, save_adapter,  # noqa: F401
                          save_ckpt, sign_test, tracker_names, trim_logs)

F = importlib.import_module("01_formats")
R = importlib.import_module("02_rollouts")


# --------------------------------------------------------------------------------------------- advantages
def episode_returns(trajs, penalty=F.INVALID_PENALTY):
    """R_i = sum_t (r_it - 0.1 [step t invalid]): eq. (1) summed over the trajectory's steps, its score under
    --adv_level traj (the lemmas' form)."""
    return [sum(s["reward"] - penalty * (not s["valid"]) for s in t["steps"]) for t in trajs]


def row_scores(trajs, penalty=F.INVALID_PENALTY):
    """Eq. (1), verl-agent's step rows: score_row = the sum of its trajectory's env rewards - 0.1 [this step
    invalid]. Returns {task group: [(step dict, score), ...]} over all steps of all trajectories of the group."""
    groups = {}
    for t in trajs:
        ret = sum(s["reward"] for s in t["steps"])
        for s in t["steps"]:
            groups.setdefault(t["group"], []).append((s, ret - penalty * (not s["valid"])))
    return groups


def group_norm(scores, use_std=True, eps=1e-6):
    """The normalisation of eq. (2): (x - mean) / (std + eps) over one group, unbiased std; a one-element group
    has mean 0 and std 1, as in verl's compute_grpo_outcome_advantage and verl-agent's episode_norm_reward."""
    x = torch.tensor(scores, dtype=torch.float64)
    one = len(x) == 1
    mean, std = (x.new_tensor(0.0), x.new_tensor(1.0)) if one else (x.mean(), x.std())
    return ((x - mean) / (std + eps) if use_std else x - mean).tolist()


def grpo_advantages(trajs, args=None, level=None):
    """Eq. (2): one scalar per step, stored on the step as 'adv' (every response token of the step gets it).

    row (the reference): A_row = (score_row - mean_rows) / (std_rows + 1e-6) over all step rows of a task group,
    so a trajectory weighs by its number of steps. traj: A_i = (R_i - mean_i R) / (std_i R + 1e-6) over the G
    trajectories, R_i = episode_returns(), the same value on every step of trajectory i (the paper's lemmas)."""
    level = level or getattr(args, "adv_level", "row")
    if level == "row":
        for rows in row_scores(trajs).values():
            for (s, _), a in zip(rows, group_norm([x for _, x in rows])):
                s["adv"] = a
        return trajs
    returns = episode_returns(trajs)
    groups = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t["group"], []).append(i)
    for members in groups.values():
        for i, a in zip(members, group_norm([returns[i] for i in members])):
            for s in trajs[i]["steps"]:
                s["adv"] = a
    return trajs


# --------------------------------------------------------------------------------------------- the update
def token_losses(logp, old_logp, ref_logp, adv, clip_eps, kl_coef, entropy=None, entropy_coeff=0.0, clip_c=3.0):
    """Eqs. (3)-(4) and the summand of (5), per token: dual-clip PPO + beta * k3 KL - entropy_coeff * H.

    Returns (loss [B, L], clipped indicator, kl [B, L]); clipped marks the tokens where the clipped term is taken."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    pg = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * clip_c), pg)  # dual clip: at most c |A| for A < 0
    d = torch.clamp(ref_logp - logp, -20.0, 20.0)
    kl = torch.clamp(torch.exp(d) - d - 1, -10.0, 10.0)
    loss = pg + kl_coef * kl
    if entropy is not None and entropy_coeff:
        loss = loss - entropy_coeff * entropy
    return loss, (pg2 > pg1).float(), kl


def all_sum(accelerator, x):
    t = torch.tensor(float(x), dtype=torch.float64, device=accelerator.device)  # a float32 tensor would round x
    return accelerator.reduce(t, reduction="sum").item() if accelerator.num_processes > 1 else t.item()


def mean_over_processes(accelerator, m):
    """Average each metric over processes, skipping NaN (e.g. no correct trajectory on one process)."""
    if accelerator.num_processes == 1:
        return m
    keys = sorted(k for k, v in m.items() if isinstance(v, (int, float)))
    vals = torch.tensor([[0.0 if math.isnan(m[k]) else float(m[k]), 0.0 if math.isnan(m[k]) else 1.0] for k in keys],
                        device=accelerator.device)
    vals = accelerator.reduce(vals, reduction="sum")
    return dict(m, **{k: (v / c if c else float("nan")) for k, (v, c) in zip(keys, vals.tolist())})


@torch.no_grad()
def reference_logps(policy, tok, samples, batch_size=16, share=True):
    """log pi_ref per response token: the same network with the LoRA adapter switched off."""
    lm = policy.lm
    ctx = lm.disable_adapter() if hasattr(lm, "disable_adapter") else torch.no_grad()
    with ctx:
        for chunk, b in F.batches(tok, samples, batch_size, next(policy.parameters()).device, share):  # as score()
            logp, _, _ = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"],
                                prefix=b.get("prefix"))
            for j, s in enumerate(chunk):
                s["ref_logp"] = logp[j, :len(s["response_ids"])].tolist()


def prepare_batch(policy, tok, trajs, samples, advantage_fn, args):
    """Advantages on the trajectories, copied onto the flat step samples, plus the reference log-probs."""
    advantage_fn(trajs, args)
    for s in samples:
        s["adv"] = trajs[s["traj"]]["steps"][s["step"]]["adv"]
    reference_logps(policy, tok, samples, share=args.share_prefix)


def minibatch_chunks(n, k):
    """k contiguous index ranges over the task-major batch, sizes differing by <= 1, as verl splits it (data.split /
    chunk, no shuffle). A chunk holds whole tasks, so the G episodes' repeated prompts stay together for pack_shared."""
    return [list(range(n * i // k, n * (i + 1) // k)) for i in range(k)]


class NonFiniteStop(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm (see update())."""


def update(policy, opt, accelerator, tok, samples, args, aux=None, guard=None):
    """Eq. (5), minimised: one PPO pass over this process's samples in `args.minibatches` contiguous chunks (sizes
    differ by <= 1).

    Every process must hold the same number of chunks. Loss = sum over local tokens / global token count * world
    size, because DDP averages gradients over processes: the result is the exact token-mean of the global batch.
    aux(policy, h, batch) may return (per-token loss [B, L], metrics) to add (05_seal.py uses it).

    Non-finite guard (verl's skip of a step whose gradient norm is not finite): when a mini-batch's loss or gradient
    norm is NaN or inf on any process, no process steps the optimizer, so the parameters and the optimizer state stay
    as they were; the step is counted in stats["skipped_steps"] and left out of the loss, KL and clip statistics.
    guard: {"streak": optimizer steps skipped in a row so far} carried across updates by the caller; when the streak
    reaches args.max_skipped_steps, NonFiniteStop is raised (every process at the same step).
    """
    device = accelerator.device
    raw = accelerator.unwrap_model(policy)
    raw.train()
    stats = {"loss": 0.0, "pg_clipfrac": 0.0, "kl": 0.0, "grad_norm": 0.0, "skipped_steps": 0}
    guard = {"streak": 0} if guard is None else guard
    sums = []  # per optimizer step that was taken: (loss, clipped tokens, kl, grad norm, aux metrics)
    chunks = minibatch_chunks(len(samples), args.minibatches)
    micro = getattr(args, "micro_batch", 0)  # 0 = the whole minibatch at once
    # gradient checkpointing turns the key/value cache off in training mode, and the shared path needs it
    share = getattr(args, "share_prefix", False) and not getattr(args, "gradient_checkpointing", False)
    for _ in range(args.ppo_epochs):
        for idx in chunks:
            # Micro-batches of similar length: padding a 55 x 700-token batch to its longest row cost 2.5x the time
            # of the same tokens in sorted chunks of 16. Gradients add up, so the step is the same as one big batch.
            parts = list(F.batches(tok, [samples[i] for i in idx], micro, device, share))
            n_local = sum(len(samples[i]["response_ids"]) for i in idx)
            n_global = all_sum(accelerator, n_local)
            opt.zero_grad()
            loss_sum = clip_sum = kl_sum = 0.0
            extra = {}
            for j, (part, b) in enumerate(parts):
                old = R.pack_values([s["old_logp"] for s in part], b["mask"])
                ref = R.pack_values([s["ref_logp"] for s in part], b["mask"])
                adv = torch.tensor([s["adv"] for s in part], device=device).unsqueeze(1).expand_as(b["mask"])
                # only the last micro-batch syncs gradients across processes (DDP sums what was accumulated)
                sync = contextlib.nullcontext() if j == len(parts) - 1 else accelerator.no_sync(policy)
                with sync:
                    logp, ent, h = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"],
                                          prefix=b.get("prefix"))
                    loss_tok, clipped, kl = token_losses(logp, old, ref, adv, args.clip_eps, args.kl_coef, ent,
                                                         args.entropy_coeff, args.clip_ratio_c)
                    if aux is not None:
                        aux_tok, aux_m = aux(raw, h, b, adv)
                        loss_tok = loss_tok + aux_tok
                        weight = b["mask"].sum().item() / max(n_local, 1)  # token-weighted mean over micro-batches
                        for k, v in aux_m.items():
                            extra[k] = extra.get(k, 0.0) + weight * v
                    m = b["mask"]
                    loss = (loss_tok * m).sum() / max(n_global, 1) * accelerator.num_processes
                    accelerator.backward(loss)
                loss_sum += loss.item()
                clip_sum += (clipped * m).sum().item()
                kl_sum += (kl * m).sum().item()
            gn = accelerator.clip_grad_norm_(raw.parameters(), args.max_grad_norm)
            # One decision for all processes: a NaN on any of them skips the step everywhere.
            bad = not (math.isfinite(loss_sum) and math.isfinite(float(gn)))
            if all_sum(accelerator, bad):
                opt.zero_grad()
                stats["skipped_steps"] += 1
                guard["streak"] += 1
                if guard["streak"] >= args.max_skipped_steps:
                    raw.eval()
                    raise NonFiniteStop(f"{guard['streak']} optimizer steps in a row had a non-finite loss or "
                                        "gradient norm")
                continue
            opt.step()
            guard["streak"] = 0
            sums.append((all_sum(accelerator, loss_sum) / accelerator.num_processes,
                         all_sum(accelerator, clip_sum) / max(n_global, 1), all_sum(accelerator, kl_sum) / max(n_global, 1),
                         float(gn), {k: all_sum(accelerator, v) / accelerator.num_processes for k, v in extra.items()}))
    for loss, clip, kl, gn, extra in sums:  # means over the steps taken (all of them unless some were skipped)
        w = 1.0 / len(sums)
        stats["loss"] += w * loss
        stats["pg_clipfrac"] += w * clip
        stats["kl"] += w * kl
        stats["grad_norm"] += w * gn
        for k, v in extra.items():
            stats[k] = stats.get(k, 0.0) + w * v
    if not sums:  # every step skipped: nothing was measured
        stats.update(loss=float("nan"), pg_clipfrac=float("nan"), kl=float("nan"), grad_norm=float("nan"))
    raw.eval()
    return stats


# --------------------------------------------------------------------------------------------- metrics
def logp_by_outcome(trajs):
    """Mean token log-prob (old policy) of steps in correct / wrong trajectories and of valid steps."""
    def mean(xs):
        xs = [x for s in xs for x in s["old_logp"]]
        return sum(xs) / len(xs) if xs else float("nan")
    steps = [(t["won"], s) for t in trajs for s in t["steps"]]
    return {"logp_correct": mean([s for w, s in steps if w]), "logp_wrong": mean([s for w, s in steps if not w]),
            "logp_valid": mean([s for _, s in steps if s["valid"]])}


@dataclass
class Args:
    env: str = "webshop"
    """alfworld or webshop"""
    model: str = "tiny"
    """a base shipped in base/ by name ('tiny', the embedded default; 'tiny-alfworld'), or a Hugging Face id / folder"""
    algo: str = "grpo"
    """advantage estimator: grpo (04_gigpo.py adds gigpo)"""
    seed: int = 0
    updates: int = 200
    """number of rollout + update iterations"""
    tasks: int = 4
    """distinct tasks per update (split across processes)"""
    group_size: int = 8
    lr: float = 2e-4
    """LoRA learning rate (the paper's 2e-6 is for full 1.5B-7B models)"""
    lora_r: int = 16
    adv_level: str = "row"
    """GRPO statistics over step rows (verl-agent) or 'traj' (one return per trajectory, the paper's lemmas)"""
    clip_eps: float = 0.2
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages: the loss of a token is at most c |A|"""
    kl_coef: float = 0.01
    entropy_coeff: float = 0.001
    """entropy bonus, loss -= coeff * token entropy (verl's default)"""
    ppo_epochs: int = 1
    minibatches: int = 2
    micro_batch: int = 16
    """samples per forward/backward inside a minibatch (gradients accumulate; the step does not change)"""
    share_prefix: bool = True
    """run each distinct prompt of a micro-batch once and its responses on its cached keys/values, in every pass
    (scoring, reference, update): the same numbers, fewer tokens (helpers/batches.py's pack_shared)"""
    lean_sampling: bool = True
    """sample with the lean decoding loop (helpers/batches.py's sample) instead of transformers' generate (the same
    tokens for the same seed) and read old log-probs, entropies and hidden means off its forwards, so 02's scoring pass
    does not run"""
    merge_lora: bool = True
    """sample and score old log-probs on the merged weights W + s B A (helpers/batches.py's merged_lora; float32/64
    models only): the same function without the LoRA matmuls; the reference pass and the update keep the adapter
    separate"""
    max_grad_norm: float = 1.0
    rollout_only: bool = False
    """a no-learning control in under half the time: roll out and log each update, but skip the reference pass and
    the update. The rollouts are those of --lr 0 (each update's tasks and sampling seed depend only on --seed and
    the update's index, and at lr 0 the adapter never moves); the loss, KL and gradient metrics are not logged"""
    max_skipped_steps: int = 3
    """a mini-batch whose loss or gradient norm is NaN/inf skips its optimizer step (counted as skipped_steps);
    this many skipped in a row stop the run, keeping the last good checkpoint"""
    dtype: str = "auto"
    """model weights: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float32 or float64; log-softmax, losses and
    the LoRA weights stay in float32"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (memory for time; the update then runs prompts unshared)"""
    attn_implementation: str = ""
    """transformers' attention kernel: '' = its default (sdpa), eager, flash_attention_2 (GPU), ..."""
    temperature: float = 1.0
    max_steps: int = 0
    """episode cap; 0 = the env's own (ALFWorld 25, WebShop 10; real WebShop 15)"""
    history_length: int = 2
    max_new_tokens: int = 64
    data: str = ""
    """real benchmark data folder ('' = the synthetic env): ALFWorld's (holding json_2.1.1; '$ALFWORLD_DATA' works)
    or WebShop's data/ (items_shuffle_1000.json, items_ins_v2_1000.json, items_human_ins.json)"""
    split: str = "train"
    """with --data, what training plays: alfworld train / valid_seen / valid_unseen; webshop train / test"""
    eval_split: str = ""
    """with --data, what validation and --eval_ckpt play; '' = alfworld valid_seen, webshop test (the first 500)"""
    goals: str = "synthetic"
    """with --data on webshop: synthetic (items_ins_v2, verl-agent's default) or human (items_human_ins) goals"""
    single_turn: bool = False
    """play the env's one-decision task instead (the contrast with single-turn RL; synthetic envs only): ALFWorld's
    first action, rewarded 10 when it is the all-knowing expert's first step; WebShop's product choice on the
    results page of the instruction's search, rewarded 10 when the product fits"""
    train_pool: int = 5000
    """train task seeds are drawn from 0..train_pool-1 (validation seeds start at --val_seed)"""
    train_seeds: str = ""
    """comma list: train on exactly these tasks every update instead (a sanity check that the loop can fit a few
    tasks; --tasks is then their number)"""
    val_every: int = 20
    val_tasks: int = 32
    val_seed: int = 100_000
    """first held-out seed (validation plays val_seed .. val_seed + val_tasks - 1)"""
    val_temperature: float = 0.4
    save_every: int = 1
    """checkpoint every k updates (the LoRA state is small: a kill then loses at most the update in flight)"""
    snapshot_every: int = 50
    """also keep a copy of the adapter every k updates (ckpt/state-uNNNNN.pt), for 06's before/after-eruption plots"""
    rollouts_every: int = 10
    """save the batch's trajectory records (with mean hidden states) to out_dir/rollouts every k updates; 0 = never"""
    out_dir: str = ""
    """default <project>/runs/{algo}-{env}-s{seed}, wherever the command is run from"""
    analyse: bool = True
    """when the run ends, write 06's plots and summary.md to out_dir/analysis and print their paths"""
    resume: bool = True
    """continue from out_dir/ckpt when it exists"""
    report_to: str = "tensorboard"
    """trackers, through Accelerate: tensorboard (out_dir/tb), wandb or none; metrics.jsonl is written either way"""
    eval_ckpt: str = ""
    """instead of training, play the validation seeds once with this checkpoint: ckpt/state.pt, a state-uNNNNN.pt
    snapshot, a PEFT adapter folder (ckpt/ or ckpt/adapter, as save_pretrained writes it), or 'base' (the zero
    adapter, i.e. the mid-trained base); append the result to
    out_dir/eval.jsonl (with per-seed wins, and a paired sign test against an earlier 'base' pass there)"""


ADVANTAGES = {"grpo": grpo_advantages}


def fixed_seeds(args):
    return [int(x) for x in args.train_seeds.split(",") if x.strip()]


def check_args(args, advantages=ADVANTAGES, tag=""):
    """Bad flags end in one line, before any work starts."""
    if args.env not in F.ENVS:
        raise SystemExit(f"error: unknown env {args.env!r}; choose from {', '.join(sorted(F.ENVS))}")
    if args.algo not in advantages:
        raise SystemExit(f"error: unknown algo {args.algo!r}; choose from {', '.join(sorted(advantages))}")
    F.resolve_dtype(args.dtype)  # one-line error on a bad name
    args.eval_split = args.eval_split or (F.EVAL_SPLIT[args.env] if args.data else "")
    F.use_data(args.env, args.data, args.split, args.goals, args.eval_split, args.single_turn)
    if args.report_to not in ("tensorboard", "wandb", "none"):
        raise SystemExit(f"error: --report_to must be tensorboard, wandb or none, got {args.report_to!r}")
    if args.report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        raise SystemExit("error: --report_to wandb needs the wandb package (pip install wandb), or use tensorboard")
    if args.adv_level not in ("row", "traj"):
        raise SystemExit(f"error: --adv_level must be row or traj, got {args.adv_level!r}")
    if args.group_size < 2:
        raise SystemExit("error: --group_size must be >= 2 for group-relative advantages")
    if args.updates < 1 or args.tasks < 1 or args.minibatches < 1:
        raise SystemExit("error: --updates, --tasks and --minibatches must be >= 1")
    try:
        fixed = fixed_seeds(args)
    except ValueError:
        raise SystemExit(f"error: --train_seeds must be comma-separated integers, got {args.train_seeds!r}")
    if fixed:
        args.tasks = len(fixed)
    if args.val_seed < args.train_pool:
        raise SystemExit(f"error: --val_seed {args.val_seed} lies in the train pool 0..{args.train_pool - 1}")
    if args.eval_ckpt not in ("", "base") and not os.path.exists(args.eval_ckpt):
        raise SystemExit(f"error: no checkpoint file {args.eval_ckpt!r}")
    if os.path.isdir(args.eval_ckpt) and os.path.isdir(os.path.join(args.eval_ckpt, "adapter")):
        args.eval_ckpt = os.path.join(args.eval_ckpt, "adapter")  # a run's ckpt/ folder: its PEFT export
    args.out_dir = args.out_dir or os.path.join(F.ROOT, "runs", f"{args.algo}{tag}-{args.env}-s{args.seed}")
    return args


# --------------------------------------------------------------------------------------------- held-out evaluation
def validate(policy, tok, args, progress=False, per_seed=False):
    seeds = list(range(args.val_seed, args.val_seed + args.val_tasks))
    trajs = F.play(policy.lm, tok, args.env, seeds, 1, args.val_temperature, args.max_steps or None,
                   args.history_length, args.max_new_tokens, progress=progress,
                   env_kw={"split": args.eval_split} if args.data else None, merge=args.merge_lora,
                   lean=args.lean_sampling)
    m = F.summarize(trajs)
    out = {"val_success": m["success"], "val_valid_ratio": m["valid_ratio"], "val_mean_steps": m["mean_steps"]}
    if per_seed:  # one 0/1 per seed, in seed order, so that two policies can be compared task by task
        out["val_won"] = [int(t["won"]) for t in trajs]
        if "success_by_type" in m:  # [won, played] per ALFWorld task type
            out["val_by_type"] = m["success_by_type"]
        out["val_verbs"] = m["verbs"]
    return out


def evaluate(policy, tok, args):
    """--eval_ckpt: one validation pass with a saved adapter, so that runs and the base meet on the same seeds."""
    if args.eval_ckpt == "base":
        update = 0
    elif os.path.isdir(args.eval_ckpt):
        update = load_adapter(policy, args.eval_ckpt)
    else:
        update = load_params(policy, args.eval_ckpt)["update"]
    torch.manual_seed(args.seed)
    m = {"ckpt": args.eval_ckpt, "update": update, "env": args.env, "val_seed": args.val_seed,
         "val_tasks": args.val_tasks, "val_temperature": args.val_temperature,
         **({"data": args.data, "split": args.eval_split, "goals": args.goals} if args.data else {}),
         **validate(policy, tok, args, progress=True, per_seed=True)}
    file = os.path.join(args.out_dir, "eval.jsonl")
    base = [r for r in read_jsonl(file) if r["ckpt"] == "base" and "val_won" in r
            and all(r.get(k) == m.get(k) for k in EVAL_KEY)]
    if base and args.eval_ckpt != "base":  # the latest base pass on the same seeds: a paired test is far tighter
        m["vs_base"] = sign_test(base[-1]["val_won"], m["val_won"])
    print(json.dumps({k: v for k, v in m.items() if k != "val_won"}))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(file, "a") as f:
        f.write(json.dumps(m) + "\n")
    return m


# --------------------------------------------------------------------------------------------- the loop
def train(args, advantage_fn, make_policy=R.Policy, aux=None):
    """The whole loop: rollout -> score -> advantages -> reference -> update -> log / validate / checkpoint."""
    from accelerate import Accelerator
    from tqdm import tqdm
    # cpu=True is what lets accelerate form a gloo process group when there is no GPU
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), project_dir=args.out_dir,
                              log_with=None if args.report_to == "none" else args.report_to)
    rank, world = accelerator.process_index, accelerator.num_processes
    if args.tasks % world:
        raise SystemExit(f"error: --tasks {args.tasks} must be divisible by the number of processes ({world})")
    torch.manual_seed(args.seed)
    load = dict(dtype=F.resolve_dtype(args.dtype), attn_implementation=args.attn_implementation or None)
    lm, tok = F.load_base(args.model, **load)
    if args.gradient_checkpointing:  # recompute each block's activations in the backward pass: memory for time
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(args.seed)  # identical LoRA init on every process
    policy = make_policy(F.add_lora(lm, r=args.lora_r))
    if args.eval_ckpt:  # one pass on one process: run it with plain `python`
        return evaluate(policy, tok, args) if accelerator.is_main_process else None
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    start = 0
    ckpt = os.path.join(args.out_dir, "ckpt")
    if args.resume and os.path.exists(os.path.join(ckpt, "state.pt")):
        start = load_ckpt(policy, opt, ckpt)
    policy, opt = accelerator.prepare(policy, opt)
    raw = accelerator.unwrap_model(policy)
    if accelerator.is_main_process:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(asdict(args), f, indent=1)
        trim_logs(args.out_dir, start)
    if args.report_to != "none":  # TensorBoard writes to out_dir/tb; purge_step hides what a killed run logged late
        accelerator.init_trackers("tb", config={k: v for k, v in asdict(args).items() if isinstance(v, (int, float,
                                                                                                      str, bool))},
                                  init_kwargs={"tensorboard": {"purge_step": start + 1}})
    if accelerator.is_main_process:
        if start:
            print(f"resuming {args.out_dir} from update {start}")
    log = open(os.path.join(args.out_dir, "metrics.jsonl"), "a") if accelerator.is_main_process else None
    label = f"{args.algo}{'+seal' if aux else ''} {args.env}"
    bar = tqdm(range(start, args.updates), desc=label, disable=not accelerator.is_main_process,
               initial=start, total=args.updates)
    saved = start
    guard = {"streak": 0}  # optimizer steps skipped in a row (update()'s non-finite guard), across updates
    try:
        for update_i in bar:
            t0 = time.time()
            rng = random.Random(args.seed * 100_003 + update_i)
            seeds = fixed_seeds(args) or rng.sample(range(args.train_pool), args.tasks)
            torch.manual_seed(args.seed * 1_000_003 + update_i * world + rank)
            trajs, samples = R.collect(raw, tok, args.env, seeds[rank::world], args.group_size, args.temperature,
                                       args.max_steps or None, args.history_length, args.max_new_tokens,
                                       share=args.share_prefix, merge=args.merge_lora, lean=args.lean_sampling)
            t_roll = time.time() - t0
            try:
                stats = {}
                if args.rollout_only:
                    advantage_fn(trajs, args)  # for the saved rollouts; nothing is learned from them
                else:
                    prepare_batch(raw, tok, trajs, samples, advantage_fn, args)
                    stats = update(policy, opt, accelerator, tok, samples, args, aux, guard)
            except NonFiniteStop as e:  # the update in flight is not saved: ckpt/ keeps the last good one
                raise SystemExit(f"error: update {update_i + 1}: {e}; stopped, {ckpt} holds update {saved}")
            m = R.batch_metrics(trajs)
            m.update(logp_by_outcome(trajs))
            m["reward"] = sum(episode_returns(trajs)) / len(trajs)
            m = mean_over_processes(accelerator, m)
            m.update(stats, update=update_i + 1, seconds=round(time.time() - t0, 2), rollout_seconds=round(t_roll, 2))
            if args.val_every and ((update_i + 1) % args.val_every == 0 or update_i == 0):
                if accelerator.is_main_process:
                    m.update(validate(raw, tok, args))
                accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                log.write(json_line(m))
                log.flush()
                accelerator.log(tracker_names(m), step=update_i + 1)
                bar.set_postfix(succ=f"{m['success']:.2f}", ent=f"{m.get('entropy', 0):.2f}",
                                val=f"{m.get('val_success', float('nan')):.2f}")
            if args.rollouts_every and (update_i + 1) % args.rollouts_every == 0:  # for 06's hidden-state plots
                name = f"update{update_i + 1:05d}-rank{rank}.jsonl"
                R.save_jsonl(trajs, os.path.join(args.out_dir, "rollouts", name))
            snap = bool(args.snapshot_every) and (update_i + 1) % args.snapshot_every == 0
            if (update_i + 1) % args.save_every == 0 or snap:
                save_ckpt(accelerator, policy, opt, update_i + 1, ckpt, snap)
                saved = update_i + 1
        if saved < args.updates:
            save_ckpt(accelerator, policy, opt, args.updates, ckpt)
    except KeyboardInterrupt:  # the update in flight may have stepped part of its mini-batches: never save it
        if accelerator.is_main_process:
            print(f"\ninterrupted: {ckpt} holds update {saved}; rerun the same command to resume")
    if log:
        log.close()
    accelerator.end_training()
    accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():  # a live gloo group at interpreter exit can abort the process
        torch.distributed.destroy_process_group()
    if args.analyse and accelerator.is_main_process:
        report(args.out_dir)
    return os.path.join(args.out_dir, "metrics.jsonl")


def report(out_dir):
    """The end of a run: 06's plots and summary.md of this run's logs, and a few lines of what happened. 06 runs as
    its own program, as a user would run it, so no script imports a later one."""
    import subprocess
    import sys
    rows = read_jsonl(os.path.join(out_dir, "metrics.jsonl"))
    if not rows:
        return None
    folder = os.path.join(out_dir, "analysis")
    cmd = [sys.executable, os.path.join(F.ROOT, "06_analysis.py"), "--runs", out_dir, "--out_dir", folder,
           "--lemmas", "false"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        print(f"\nthe analysis failed ({' '.join(cmd)}): {last}")
        return None
    with open(os.path.join(folder, "analysis.json")) as f:
        res = json.load(f)

    w = min(5, max(len(rows) // 2, 1))

    def span(key):
        v = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        k = 1 if key == "val_success" else w
        return f"{sum(v[:k]) / k:.3f} -> {sum(v[-k:]) / k:.3f}" if v else "n/a"

    print(f"\n{out_dir}: {len(rows)} updates, {sum(r.get('seconds', 0) for r in rows) / 60:.1f} min of updates")
    print(f"  train success (mean of the first / last {w} updates): {span('success')}")
    print(f"  token entropy (first / last {w}): {span('entropy')};  valid-action ratio: {span('valid_ratio')}")
    print(f"  held-out val success (first / last pass): {span('val_success')}")
    print(f"  summary: {res['summary']}")
    print("  plots:   " + "\n           ".join(p for ps in res["pngs"].values() for p in ps))
    return res


def main(argv=None, extra=None):
    args = check_args(F.parse_args(Args, argv))
    return train(args, ADVANTAGES[args.algo])


if __name__ == "__main__":
    main()
