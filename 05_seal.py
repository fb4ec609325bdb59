"""05 - SEAL: Separation-Enhanced Agent Learning, on top of GRPO or GiGPO.

The paper's diagnosis: entropy erupts when the hidden states of good and bad responses are not separated, so an update
that pushes bad responses down also pulls good ones (gradient interference through <h_i, h_j>, Lemma 3.2). SEAL adds
a head on the last-layer hidden state h_t AT every response token y_t (the last one at the end-of-turn token: one
position after the state whose logits give log pi(y_t), as the released code reads it) that predicts the sign of the
token's advantage:
    head(h) = Linear(d, 1) o [ Dropout(0.1) o LayerNorm o GELU o Linear(d, d) ] ^ (depth - 1)                (1)
    label_t = 1[A_t >= 0]                                                                                    (2)
    L_SEAL = (1/|T|) sum_t BCE( sigmoid(head(h_t)), label_t )                  (token-mean, as L_RL)         (3)
    L = L_RL + alpha L_SEAL,   alpha = 0.02, depth = 6 for ALFWorld and 3 for WebShop (the released defaults)  (4)
The head is trained with the policy and its gradient flows into the backbone (no detach): that is what separates
the representations of positive- and negative-advantage tokens. L_RL is 03's loss with 03's (or 04's) advantages.

EMPG (Wang et al. 2025, arXiv 2509.09265), the entropy-aware estimator this file offers next to SEAL (--algo empg,
on top of --empg_base grpo|gigpo advantages A_t, one per step row). With H_t = the mean token entropy of step t:
    H~_t = (H_t - min_batch H) / (max_batch H - min_batch H + 1e-8)            (min-max over the batch's steps)  (5)
    g_t = exp(-k H~_t) / mean_batch exp(-k H~)                                (self-calibrating gradient scale)  (6)
    f_t = exp(-k' H~_{t+1}),  0 on a trajectory's last step                  (future-clarity bonus)            (7)
    A'_t = g_t A_t + zeta f_t,   A_mod_t = A'_t - mean_batch A'             k = k' = 1, zeta = 0.05           (8)
"The batch" is the global batch: under data parallelism min, max and means are all-reduced over processes.

Deviations from the released code: none beyond 03's; the head is built in the model's dtype.

    python 05_seal.py --env webshop                                  # GRPO + SEAL
    python 05_seal.py --env alfworld --algo gigpo                    # GiGPO + SEAL (head depth 6)
    accelerate launch 05_seal.py --env webshop                       # data parallel on the available devices
    python benchmarks/seal_overhead.py --env webshop                 # time SEAL's share of an update
    python 05_seal.py --env webshop --algo empg --alpha 0            # EMPG on GRPO advantages, without SEAL
"""
import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as Fn

GG = importlib.import_module("04_gigpo")
G, F, R = GG.G, GG.F, GG.G.R


SEAL_DEPTH = {"alfworld": 6, "webshop": 3}


def seal_head(d, depth, dropout=0.1):
    """Eq. (1), the released head."""
    layers = []
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.LayerNorm(d), torch.nn.Dropout(dropout)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(d, 1))


class SealPolicy(R.Policy):
    """The policy of 02 plus the SEAL head, so DDP syncs the head's gradients too."""

    def __init__(self, lm, depth=3, dropout=0.1):
        super().__init__(lm)
        self.seal_head = seal_head(lm.config.hidden_size, depth, dropout).to(next(lm.parameters()).dtype)


def seal_labels(adv):
    """Eq. (2)."""
    return (adv >= 0).to(adv.dtype)


def seal_loss(alpha):
    """Eqs. (3)-(4), as an aux hook for 03's update(): per-token alpha * BCE, masked and token-meaned there together
    with L_RL."""
    def aux(policy, h, batch, adv):
        logits = policy.seal_head(h).squeeze(-1)
        dtype = torch.promote_types(logits.dtype, torch.float32)  # BCE in at least float32, float64 in a float64 model
        logits, labels = logits.to(dtype), seal_labels(adv).to(dtype)
        bce = Fn.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        m = batch["mask"]
        n = m.sum().clamp(min=1)
        with torch.no_grad():
            acc = (((logits >= 0).to(labels.dtype) == labels).to(labels.dtype) * m).sum() / n
        return alpha * bce, {"seal_bce": ((bce * m).sum() / n).item(), "seal_acc": acc.item()}
    return aux


# --------------------------------------------------------------------------------------------- EMPG
def batch_reduce(values, op):
    """op ('min', 'max', 'sum') of a local list of floats over the global batch (all processes when distributed)."""
    local = {"min": min, "max": max, "sum": sum}[op](values) if values else {"min": math.inf, "max": -math.inf,
                                                                              "sum": 0.0}[op]
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    t = torch.tensor([local], dtype=torch.float64)
    ops = {"min": torch.distributed.ReduceOp.MIN, "max": torch.distributed.ReduceOp.MAX,
           "sum": torch.distributed.ReduceOp.SUM}
    torch.distributed.all_reduce(t, op=ops[op])
    return t.item()


def empg_modulate(trajs, k=1.0, k_next=1.0, zeta=0.05, eps=1e-8):
    """Eqs. (5)-(8), EMPG on the advantages already on the steps ('adv'), in place."""
    steps = [s for t in trajs for s in t["steps"]]
    ent = {id(s): sum(s["entropy"]) / max(len(s["entropy"]), 1) for s in steps}
    lo, hi = batch_reduce(list(ent.values()), "min"), batch_reduce(list(ent.values()), "max")
    norm = {i: (h - lo) / (hi - lo + eps) for i, h in ent.items()}
    n = batch_reduce([1.0] * len(steps), "sum")
    scale_mean = batch_reduce([math.exp(-k * norm[id(s)]) for s in steps], "sum") / n
    for t in trajs:
        for j, s in enumerate(t["steps"]):
            g = math.exp(-k * norm[id(s)]) / scale_mean
            f = math.exp(-k_next * norm[id(t["steps"][j + 1])]) if j + 1 < len(t["steps"]) else 0.0
            s["adv"] = g * s["adv"] + zeta * f
    mean = batch_reduce([s["adv"] for s in steps], "sum") / n
    for s in steps:
        s["adv"] -= mean
    return trajs


def empg_advantages(trajs, args=None):
    GG.ADVANTAGES[getattr(args, "empg_base", "grpo")](trajs, args)
    return empg_modulate(trajs, getattr(args, "empg_k", 1.0), getattr(args, "empg_k_next", 1.0),
                         getattr(args, "empg_zeta", 0.05))


ADVANTAGES = dict(GG.ADVANTAGES, empg=empg_advantages)


@dataclass
class Args(GG.Args):
    algo: str = "grpo"
    """advantage estimator: grpo, gigpo or empg (EMPG on top of --empg_base)"""
    empg_base: str = "grpo"
    """the advantages EMPG modulates: grpo or gigpo"""
    empg_k: float = 1.0
    """EMPG's k: gradient scale g = exp(-k H~) / batch mean"""
    empg_k_next: float = 1.0
    """EMPG's k': future-clarity bonus f = exp(-k' H~ of the next step)"""
    empg_zeta: float = 0.05
    """EMPG's zeta: weight of the future-clarity bonus"""
    alpha: float = 0.02
    """SEAL loss coefficient (0 turns SEAL off and gives the plain algorithm)"""
    seal_depth: int = 0
    """head depth; 0 = the released default for the env: 6 (ALFWorld), 3 (WebShop)"""
    seal_dropout: float = 0.1


def check_args(args):
    if args.empg_base not in GG.ADVANTAGES:
        raise SystemExit(f"error: --empg_base must be one of {', '.join(sorted(GG.ADVANTAGES))}, "
                         f"got {args.empg_base!r}")
    args = GG.check_args(args, ADVANTAGES, tag="+seal" if args.alpha > 0 else "")
    if args.seal_depth < 0:
        raise SystemExit("error: --seal_depth must be >= 1 (or 0 for the env's default)")
    args.seal_depth = args.seal_depth or SEAL_DEPTH[args.env]
    return args


def main(argv=None):
    args = check_args(F.parse_args(Args, argv))
    make = lambda lm: SealPolicy(lm, args.seal_depth, args.seal_dropout)  # noqa: E731
    return G.train(args, ADVANTAGES[args.algo], make_policy=make if args.alpha > 0 else R.Policy,
                   aux=seal_loss(args.alpha) if args.alpha > 0 else None)


if __name__ == "__main__":
    main()
