"""One GRPO update on a fixed synthetic batch; run with 1 or 2 processes and compare the saved parameters.

    python tests/dp_update.py OUT.pt
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 29511 tests/dp_update.py OUT.pt
    DP_NAN_RANK=1 accelerate launch ... tests/dp_update.py OUT.pt   # a NaN loss on rank 1: OUT.pt.rank0/.rank1
"""
import importlib
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F = importlib.import_module("01_formats")
R = importlib.import_module("02_rollouts")
G = importlib.import_module("03_grpo")


class Tok:  # pack() only needs the pad id
    pad_token_id = 0


def update_args(**kw):
    """03's update() flags at their defaults (dual clip 3, entropy bonus 0.001), overridable."""
    base = dict(minibatches=1, ppo_epochs=1, clip_eps=0.2, clip_ratio_c=3.0, kl_coef=0.01, entropy_coeff=0.001,
                max_grad_norm=1.0, micro_batch=0, share_prefix=False, max_skipped_steps=3)
    return SimpleNamespace(**dict(base, **kw))


def batch(policy, n=8, seed=0, distinct=0):
    """n samples with unequal prompt and response lengths; distinct > 0: their prompts drawn from that many, as the
    G episodes of a task share states."""
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(1, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(distinct)]
    samples = []
    for i in range(n):
        p = torch.randint(1, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        p = pool[i % distinct] if distinct else p
        r = torch.randint(1, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        samples.append({"prompt_ids": p, "response_ids": r, "adv": float(torch.randn(1, generator=g))})
    R.score(policy, Tok, samples)
    G.reference_logps(policy, Tok, samples)
    return samples


def rmsnorm_in_input_dtype(self, x):
    """Qwen2RMSNorm.forward without its cast to float32: transformers normalises in float32 even in a float64 model,
    which leaves ~1e-7 relative rounding wherever two exact paths sum in a different order. For a float32 model
    this computes the same thing."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def move_adapter(model, sd=0.05):
    """Draw every LoRA B matrix from N(0, sd), in place: a fresh adapter (B = 0) computes the base itself, so tests
    that need the adapter to matter move it first. Returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, sd)
    return model


def build():
    from transformers.models.qwen2 import modeling_qwen2
    modeling_qwen2.Qwen2RMSNorm.forward = rmsnorm_in_input_dtype  # float64 end to end, so tests can ask for 1e-8
    torch.manual_seed(0)
    lm = F.add_lora(F.tiny_model(64, seed=0).double(), r=4)  # float64: Adam would amplify roundoff
    return R.Policy(move_adapter(lm))  # away from the reference, so that the KL term is not zero


def main(out):
    from accelerate import Accelerator
    acc = Accelerator(cpu=not torch.cuda.is_available())
    share = os.environ.get("DP_SHARE_PREFIX") == "1"  # helpers/batches.py's pack_shared path
    policy = build()
    samples = batch(policy, distinct=int(os.environ.get("DP_DISTINCT", "0")))  # > 0: prompts repeat
    # plain SGD: unlike Adam it is not scale-invariant, so a wrongly scaled gradient shows
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    policy, opt = acc.prepare(policy, opt)
    # micro_batch 3: one process splits its 8 samples 3+3+2, each of two processes its 4 as 3+1 (no_sync path)
    args = update_args(ppo_epochs=2, micro_batch=3, share_prefix=share)
    nan_rank = int(os.environ.get("DP_NAN_RANK", "-1"))
    aux = None
    if nan_rank >= 0:  # a NaN in that rank's loss value alone (detached: its gradients stay finite) in step 1
        args = update_args(minibatches=2, share_prefix=share)
        calls = []

        def aux(raw, h, b, adv):
            calls.append(1)
            bad = acc.process_index == nan_rank and len(calls) == 1
            return torch.full_like(b["mask"], float("nan") if bad else 0.0), {}
    stats = G.update(policy, opt, acc, Tok, samples[acc.process_index::acc.num_processes], args, aux)
    if nan_rank >= 0:  # every rank writes what it holds: the ranks must agree
        raw = acc.unwrap_model(policy)
        torch.save({"params": {k: v.detach().cpu() for k, v in raw.named_parameters() if v.requires_grad},
                    "stats": stats}, f"{out}.rank{acc.process_index}")
    elif acc.is_main_process:
        raw = acc.unwrap_model(policy)
        torch.save({"params": {k: v.detach().cpu() for k, v in raw.named_parameters() if v.requires_grad},
                    "stats": stats, "world": acc.num_processes}, out)
    acc.wait_for_everyone()
    if torch.distributed.is_initialized():  # a live gloo group at interpreter exit can abort the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
