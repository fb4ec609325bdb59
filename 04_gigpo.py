"""04 - GiGPO: group-in-group credit for multi-turn agents (Feng et al. 2025), on top of 03's loop.

Episode level, over all step rows of one task group (verl-agent's episode_norm_reward, mean across steps):
    score_row = sum_t r_t - 0.1 [this step invalid]                       (03's row scores)
    A^E_row = score_row - mean_rows score                                 ("mean_norm", the default)      (1)
    A^E_row = (score_row - mean_rows score) / (std_rows score + 1e-6)     ("mean_std_norm")               (1')
    a task group with a single row: mean 0 (std 1)
Step level: discounted return from the env rewards, then the invalid penalty on the step's own return:
    R_t = sum_{k >= t} gamma^{k-t} r_k  - 0.1 [step t invalid],   gamma = 0.95                               (2)
Anchor-state groups: within a task group, steps whose raw env observation is identical form one step group S:
    A^S_t = R_t - mean_{s in S} R_s        (mean_std_norm: divided by std_S + 1e-6; a singleton group gives 0)  (3)
    A_t = A^E + omega A^S_t,               omega = 1                                                        (4)
The advantage is per step; every response token of the step gets it.

Deviations from the reference: none beyond 03's; exact-match anchors only (verl-agent's optional similarity
grouping, enable_similarity, is not implemented).

    python 04_gigpo.py --env alfworld --updates 200
    python 04_gigpo.py --env webshop --gigpo_mode mean_std_norm
"""
import importlib
from dataclasses import dataclass

G = importlib.import_module("03_grpo")
F = G.F


def discounted_returns(rewards, gamma):
    """The sum of eq. (2): sum_{k >= t} gamma^{k-t} r_k for every t, from the end backwards."""
    out, acc = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def step_returns(trajs, gamma):
    """Eq. (2), R_t on every step (as 'step_return'): discounted env rewards, minus the penalty on the invalid step
    itself."""
    for t in trajs:
        for s, r in zip(t["steps"], discounted_returns([s["reward"] for s in t["steps"]], gamma)):
            s["step_return"] = r - F.INVALID_PENALTY * (not s["valid"])


def gigpo_advantages(trajs, args=None):
    """Eqs. (1)-(4): the episode advantage of the step's row plus omega times its anchor-state step advantage, stored
    on every step as 'adv' (verl-agent's compute_gigpo_outcome_advantage)."""
    gamma = getattr(args, "gamma", 0.95)
    omega = getattr(args, "omega", 1.0)
    mode = getattr(args, "gigpo_mode", "mean_norm")
    use_std = mode == "mean_std_norm"
    step_returns(trajs, gamma)
    for rows in G.row_scores(trajs).values():
        episode = G.group_norm([x for _, x in rows], use_std)
        anchors = {}  # raw observation -> the steps of this task group that acted on it
        for s, _ in rows:
            anchors.setdefault(s["obs"], []).append(s)
        step = {}
        for group in anchors.values():
            if len(group) > 1:  # a singleton anchor group carries no step-level signal
                step.update(zip(map(id, group), G.group_norm([s["step_return"] for s in group], use_std)))
        for (s, _), a_ep in zip(rows, episode):
            s["adv"] = a_ep + omega * step.get(id(s), 0.0)
    return trajs


@dataclass
class Args(G.Args):
    algo: str = "gigpo"
    """advantage estimator: grpo or gigpo"""
    gamma: float = 0.95
    """discount of the step-level returns"""
    omega: float = 1.0
    """weight of the step advantage"""
    gigpo_mode: str = "mean_norm"
    """mean_norm (subtract the group mean) or mean_std_norm (also divide by the group std), both levels"""


ADVANTAGES = dict(G.ADVANTAGES, gigpo=gigpo_advantages)


def check_args(args, advantages=ADVANTAGES, tag=""):
    if getattr(args, "gigpo_mode", "mean_norm") not in ("mean_norm", "mean_std_norm"):
        raise SystemExit(f"error: --gigpo_mode must be mean_norm or mean_std_norm, got {args.gigpo_mode!r}")
    if args.algo == "gigpo" and getattr(args, "adv_level", "row") != "row":
        raise SystemExit("error: --adv_level traj is a GRPO option; GiGPO's episode term is over step rows")
    return G.check_args(args, advantages, tag)


def main(argv=None):
    args = check_args(F.parse_args(Args, argv))
    return G.train(args, ADVANTAGES[args.algo])


if __name__ == "__main__":
    main()
