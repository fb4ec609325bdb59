"""SEAL's cost: one rollout batch, 03's update with and without the SEAL head (same tokens), and the head's own
forward + backward timed alone. Takes 05_seal.py's flags.

    python benchmarks/seal_overhead.py --env webshop
    python benchmarks/seal_overhead.py --env alfworld      # head depth 6
"""
import importlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
S = importlib.import_module("05_seal")
F, G, R = S.F, S.G, S.R


def head_seconds(policy, tok, samples, args, repeats=20):
    """What SEAL adds to an update: the head's forward + backward on the hidden states of every chunk. The backbone's
    backward runs once for L_RL + alpha L_SEAL either way (the head only adds to dL/dh), so this is the increment,
    and it is small enough to time in a loop, free of the run-to-run noise of a whole update."""
    aux = S.seal_loss(args.alpha)
    chunks = G.minibatch_chunks(len(samples), args.minibatches)  # as update() splits the batch
    total = 0.0
    for idx in chunks:
        b = F.pack(tok, [samples[i] for i in idx], next(policy.parameters()).device)
        with torch.no_grad():
            _, _, h = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
        adv = torch.tensor([samples[i]["adv"] for i in idx], dtype=h.dtype, device=h.device)
        adv = adv.unsqueeze(1).expand_as(b["mask"])
        runs = []
        for _ in range(repeats + 1):
            leaf = h.detach().requires_grad_()
            t0 = time.perf_counter()
            loss_tok, _ = aux(policy, leaf, b, adv)
            ((loss_tok * b["mask"]).sum() / b["mask"].sum()).backward()
            runs.append(time.perf_counter() - t0)
        total += sorted(runs[1:])[repeats // 2]
    policy.zero_grad()
    return total


def bench_overhead(args, repeats=5):
    """Same rollout batch, same number of tokens: the update with the SEAL head vs without it."""
    torch.manual_seed(args.seed)
    lm, tok = F.load_base(args.model)
    from accelerate import Accelerator
    acc = Accelerator(cpu=not torch.cuda.is_available())
    policy = S.SealPolicy(F.add_lora(lm, r=args.lora_r), args.seal_depth, args.seal_dropout)
    trajs, samples = R.collect(policy, tok, args.env, list(range(args.tasks)), args.group_size, args.temperature,
                               args.max_steps or None, args.history_length, args.max_new_tokens)
    G.prepare_batch(policy, tok, trajs, samples, S.ADVANTAGES[args.algo], args)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.0)  # lr 0: same work, no drift
    times = {"rl": [], "rl+seal": []}
    for r in range(repeats + 1):
        for name, aux in (("rl", None), ("rl+seal", S.seal_loss(args.alpha))):
            t0 = time.perf_counter()
            G.update(policy, opt, acc, tok, samples, args, aux)
            if r:  # the first round warms up allocators and kernels
                times[name].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    head = head_seconds(policy, tok, samples, args)
    out = {"env": args.env, "samples": len(samples), "tokens": sum(len(s["response_ids"]) for s in samples),
           "update_seconds_rl": med["rl"], "update_seconds_rl_seal": med["rl+seal"],
           "overhead_end_to_end": med["rl+seal"] / med["rl"] - 1, "head_seconds": head,
           "overhead_head": head / med["rl"], "repeats": repeats}
    print(json.dumps(out))
    return out


def main(argv=None):
    args = S.check_args(F.parse_args(S.Args, argv))
    return bench_overhead(args)


if __name__ == "__main__":
    main()
