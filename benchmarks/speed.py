"""Speed benchmark: one rollout batch, every phase of a GRPO update timed on the plain path and on the fast one.

plain = every sample its own prompt, the LoRA matmuls in every pass, transformers' generate; fast = the defaults
(prompt sharing, merged LoRA, the lean decoding loop; helpers/batches.py). Both paths must agree (scores, loss,
parameters after the step): the benchmark prints the largest differences next to the times, and the tokens per
second of one plain forward pass over the same batch as the yardstick. Takes 03_grpo.py's flags.

    python benchmarks/speed.py --env alfworld               # results/bench/speed-alfworld*.txt, docs/speed.md
    OMP_NUM_THREADS=1 python benchmarks/speed.py --env webshop
"""
import copy
import importlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
G = importlib.import_module("03_grpo")
F, R = G.F, G.R


def bench_speed(args, advantage_fn=None, make_policy=None, aux=None, rounds=2):
    """One rollout batch, every phase of a GRPO update timed on the plain path and the fast one.

    plain: every sample runs its own prompt, the LoRA matmuls run in every pass (--share_prefix false --merge_lora
    false). fast: each distinct prompt once (helpers/batches.py's pack_shared, shared_prefill) and the no-grad policy
    passes on the merged weights (helpers/batches.py's merged_lora). Both paths score, reference and update the same
    samples (the plain rollout's), so their numbers must agree; the rollout itself is timed on each path from the same
    seed. Phases after the rollout run `rounds` times after a warm-up and keep the fastest. Prints one JSON line and
    returns it as a dict.
    """
    from accelerate import Accelerator
    advantage_fn, make_policy = advantage_fn or G.grpo_advantages, make_policy or R.Policy
    torch.manual_seed(args.seed)
    lm, tok = F.load_base(args.model)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    policy = make_policy(F.add_lora(lm, r=args.lora_r))
    seeds = list(range(args.tasks))
    clock = time.perf_counter
    out, trajs = {"env": args.env, "tasks": args.tasks, "group_size": args.group_size,
                  "threads": torch.get_num_threads()}, {}
    for share in (False, True):  # fast: also lean sampling, which scores the steps as it samples them
        torch.manual_seed(args.seed)
        t0 = clock()
        trajs[share] = F.play(policy.lm, tok, args.env, seeds, args.group_size, args.temperature,
                              args.max_steps or None, args.history_length, args.max_new_tokens, share=share,
                              merge=share, lean=share and args.lean_sampling, scores=share and args.lean_sampling)
        out[f"rollout_s_{'fast' if share else 'plain'}"] = clock() - t0
    out["rollout_steps_plain"] = sum(len(t["steps"]) for t in trajs[False])
    out["rollout_steps_fast"] = sum(len(t["steps"]) for t in trajs[True])
    lean_steps = [s for t in trajs[True] for s in t["steps"]]
    out["same_rollout"] = [s["response_ids"] for s in lean_steps] == [s["response_ids"] for t in trajs[False]
                                                                       for s in t["steps"]]
    trajs = trajs[False]
    samples = R.flatten(trajs, tok)
    prompt = sum(len(s["prompt_ids"]) for s in samples)
    distinct = {tuple(s["prompt_ids"]) for s in samples}
    response = sum(len(s["response_ids"]) for s in samples)
    out.update(steps=len(samples), distinct_prompts=len(distinct), prompt_tokens=prompt,
               distinct_prompt_tokens=sum(map(len, distinct)), response_tokens=response,
               tokens_saved=(prompt - sum(map(len, distinct))) / (prompt + response))

    def best(fn):
        times = []
        for _ in range(rounds):
            t0 = clock()
            fn()
            times.append(clock() - t0)
        return min(times)

    in_update = sum(len(p) for c in G.minibatch_chunks(len(samples), args.minibatches)
                    for p in {tuple(samples[i]["prompt_ids"]) for i in c})
    out["tokens_saved_in_update"] = (prompt - in_update) / (prompt + response)  # a prompt split by chunks runs twice
    policy.eval()  # as score() runs it (LoRA dropout off)
    body = F.body_and_head(policy.lm)[0]
    with torch.no_grad():
        packed = [F.pack(tok, c, "cpu") for c in F.micro_batches(samples, 16)]
        body(input_ids=packed[0]["input_ids"], attention_mask=packed[0]["attention_mask"])  # warm-up
        out["plain_forward_s"] = best(lambda: [body(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                                               for b in packed])
    scored = {}
    for share in (False, True):
        name = "fast" if share else "plain"
        R.score(policy, tok, copy.deepcopy(samples[:16]), share=share, merge=share)  # warm-up
        scored[share] = copy.deepcopy(samples)
        out[f"score_s_{name}"] = best(lambda: R.score(policy, tok, scored[share], share=share, merge=share))
        out[f"reference_s_{name}"] = best(lambda: G.reference_logps(policy, tok, scored[share], share=share))
    diff = lambda k: max(abs(a - b) for x, y in zip(scored[False], scored[True])  # noqa: E731
                         for a, b in zip(torch.tensor(x[k]).flatten().tolist(), torch.tensor(y[k]).flatten().tolist()))
    out["max_abs_diff_scores"] = {k: diff(k) for k in ("old_logp", "entropy", "hidden_mean", "ref_logp")}
    if args.lean_sampling:  # the fast path's scores come from its rollout; the scoring pass above is not run there
        out["score_s_fast"] = 0.0
        if out["same_rollout"]:
            out["max_abs_diff_rollout_scores"] = {k: max(abs(a - b) for x, y in zip(scored[False], lean_steps)
                                                         for a, b in zip(x[k], y[k]))
                                                  for k in ("old_logp", "entropy", "hidden_mean")}
    for s in scored[False]:  # the scores land on the trajectories, as collect() puts them, for GiGPO and SEAL
        trajs[s["traj"]]["steps"][s["step"]].update({k: s[k] for k in ("old_logp", "entropy", "hidden_mean")})
    advantage_fn(trajs, args)
    for s in scored[False]:
        s["adv"] = trajs[s["traj"]]["steps"][s["step"]]["adv"]
    start = copy.deepcopy(policy.state_dict())
    trainable = [p for p in policy.parameters() if p.requires_grad]
    stats, after = {}, {}
    for share in (False, True):
        name = "fast" if share else "plain"
        run_args = copy.copy(args)
        run_args.share_prefix = share
        times = []
        for _ in range(rounds + 1):  # the first round warms up allocators and kernels
            policy.load_state_dict(start)
            opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
            t0 = clock()
            stats[share] = G.update(policy, opt, accelerator, tok, copy.deepcopy(scored[False]), run_args, aux)
            times.append(clock() - t0)
        out[f"update_s_{name}"] = min(times[1:])
        after[share] = {k: v.detach().clone() for k, v in policy.named_parameters() if v.requires_grad}
    policy.load_state_dict(start)
    out["max_abs_diff_update"] = {k: abs(stats[False][k] - stats[True][k]) for k in stats[False]}
    out["max_abs_diff_params"] = max((after[False][k] - after[True][k]).abs().max().item() for k in after[False])
    tokens = prompt + response
    for name in ("plain", "fast"):
        out[f"total_s_{name}"] = sum(out[f"{p}_s_{name}"] for p in ("rollout", "score", "reference", "update"))
        for p in ("score", "reference", "update"):
            out[f"{p}_tokens_per_s_{name}"] = tokens / out[f"{p}_s_{name}"] if out[f"{p}_s_{name}"] else None
        out[f"total_over_plain_forward_{name}"] = out[f"total_s_{name}"] / out["plain_forward_s"]
    out["plain_forward_tokens_per_s"] = tokens / out["plain_forward_s"]
    for p in ("rollout", "score", "reference", "update", "total"):
        out[f"speedup_{p}"] = out[f"{p}_s_plain"] / out[f"{p}_s_fast"] if out[f"{p}_s_fast"] else None
    out["hours_150_updates_plain"] = 150 * out["total_s_plain"] / 3600
    out["hours_150_updates_fast"] = 150 * out["total_s_fast"] / 3600
    print(f"{args.env}: {len(samples)} steps, {len(distinct)} distinct prompts, {prompt} prompt tokens "
          f"({out['distinct_prompt_tokens']} distinct), {response} response tokens: {out['tokens_saved']:.0%} of "
          f"the tokens saved; plain forward {out['plain_forward_s']:.2f} s ({out['plain_forward_tokens_per_s']:.0f} "
          f"tokens/s)")
    print(f"{'phase':10} {'plain s':>8} {'fast s':>7} {'speed-up':>8} {'fast tokens/s':>13}")
    for p in ("rollout", "score", "reference", "update", "total"):
        tps = f"{out[p + '_tokens_per_s_fast']:13.0f}" if out.get(p + "_tokens_per_s_fast") else ""
        up = f"{out['speedup_' + p]:7.2f}x" if out["speedup_" + p] else "   (in rollout)"
        print(f"{p:10} {out[p + '_s_plain']:8.2f} {out[p + '_s_fast']:7.2f} {up} {tps}")
    print(f"total over the plain forward: plain {out['total_over_plain_forward_plain']:.2f}x, fast "
          f"{out['total_over_plain_forward_fast']:.2f}x")
    print(json.dumps(out))
    return out


def main(argv=None):
    args = G.check_args(F.parse_args(G.Args, argv))
    return bench_speed(args)


if __name__ == "__main__":
    main()
