import os
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import load, ROOT

GG, S, G = load("04_gigpo"), load("05_seal"), load("03_grpo")
sys.path.insert(0, os.path.join(ROOT, "tests"))
import dp_update  # noqa: E402


def step(obs, reward=0.0, valid=True):
    return {"obs": obs, "reward": reward, "valid": valid}


def slow_gigpo(trajs, gamma, omega):
    """Pairwise loops straight from the definitions; returns {(traj, step): advantage}."""
    ep = [sum(s["reward"] - (0 if s["valid"] else 0.1) for s in t["steps"]) for t in trajs]
    ret = {}
    for i, t in enumerate(trajs):
        for k, s in enumerate(t["steps"]):
            r = sum(gamma ** (j - k) * t["steps"][j]["reward"] for j in range(k, len(t["steps"])))
            ret[i, k] = r - (0 if s["valid"] else 0.1)
    out = {}
    for i, t in enumerate(trajs):
        mates = [j for j, u in enumerate(trajs) if u["group"] == t["group"]]
        a_ep = ep[i] - sum(ep[j] for j in mates) / len(mates)
        for k, s in enumerate(t["steps"]):
            same = [ret[j, m] for j in mates for m, u in enumerate(trajs[j]["steps"]) if u["obs"] == s["obs"]]
            a_step = ret[i, k] - sum(same) / len(same) if len(same) > 1 else 0.0
            out[i, k] = a_ep + omega * a_step
    return out


def cases():
    return [  # two tasks; obs "start" appears in both tasks but must not be pooled across them
        {"group": 0, "steps": [step("start"), step("a"), step("b", 10.0)]},
        {"group": 0, "steps": [step("start"), step("a", valid=False), step("a"), step("c")]},  # repeat anchor
        {"group": 0, "steps": [step("start", valid=False), step("x")]},                        # singleton "x"
        {"group": 1, "steps": [step("start"), step("a", 10.0)]},
        {"group": 1, "steps": [step("start"), step("z"), step("z", valid=False), step("a", 10.0)]},
        {"group": 1, "steps": [step("q", valid=False)]},                                       # length 1
    ]


@pytest.mark.parametrize("gamma,omega", [(0.95, 1.0), (0.5, 0.3), (1.0, 0.0)])
def test_gigpo_matches_slow_reference(gamma, omega):
    trajs = GG.gigpo_advantages(cases(), SimpleNamespace(gamma=gamma, omega=omega))
    want = slow_gigpo(cases(), gamma, omega)
    for i, t in enumerate(trajs):
        for k, s in enumerate(t["steps"]):
            assert s["adv"] == pytest.approx(want[i, k], abs=1e-12), (i, k)


def test_gigpo_singleton_anchor_has_only_episode_advantage():
    trajs = GG.gigpo_advantages(cases(), SimpleNamespace(gamma=0.95, omega=1.0))
    ep = G.episode_returns(cases())
    a_ep = ep[2] - sum(ep[:3]) / 3
    assert trajs[2]["steps"][1]["adv"] == pytest.approx(a_ep)          # "x" occurs once
    assert trajs[5]["steps"][0]["adv"] == pytest.approx(ep[5] - sum(ep[3:]) / 3)


def test_gigpo_penalty_after_returns():
    # an invalid step's own return is penalised, but the penalty does not leak into earlier steps' returns
    trajs = GG.gigpo_advantages([{"group": 0, "steps": [step("s"), step("t", 10.0, valid=False)]}],
                                SimpleNamespace(gamma=0.95, omega=1.0))
    assert trajs[0]["steps"][0]["step_return"] == pytest.approx(0.95 * 10.0)
    assert trajs[0]["steps"][1]["step_return"] == pytest.approx(10.0 - 0.1)


def test_seal_head_shape_and_labels():
    head = S.seal_head(16, depth=3)
    assert [type(m).__name__ for m in head] == ["Linear", "GELU", "LayerNorm", "Dropout"] * 2 + ["Linear"]
    assert len(S.seal_head(16, depth=1)) == 1
    adv = torch.tensor([[-0.5, 0.0, 2.0], [1e-9, -1e-9, 0.0]])
    assert S.seal_labels(adv).tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]]


def seal_policy():
    base = dp_update.build()
    policy = S.SealPolicy(base.lm, depth=3, dropout=0.0)
    return policy


def test_seal_loss_masks_padding_and_matches_slow_reference():
    from accelerate import Accelerator
    policy = seal_policy()
    samples = dp_update.batch(policy)
    slow = []
    for s in samples:  # one unpadded sample at a time: padded positions can't leak in
        b = load("01_formats").pack(dp_update.Tok, [s])
        with torch.no_grad():
            _, _, h = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
            z = policy.seal_head(h)[0, :, 0]
        y = 1.0 if s["adv"] >= 0 else 0.0
        slow += [torch.nn.functional.softplus(-x).item() if y else torch.nn.functional.softplus(x).item() for x in z]
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
    args = SimpleNamespace(minibatches=1, ppo_epochs=1, clip_eps=0.2, kl_coef=0.01, max_grad_norm=1.0)
    with_seal = G.update(policy, opt, Accelerator(), dp_update.Tok, samples, args, S.seal_loss(0.02))
    without = G.update(policy, opt, Accelerator(), dp_update.Tok, samples, args)
    assert with_seal["seal_bce"] == pytest.approx(sum(slow) / len(slow), rel=1e-6)
    assert with_seal["loss"] - without["loss"] == pytest.approx(0.02 * sum(slow) / len(slow), rel=1e-5)


def test_seal_gradient_reaches_the_backbone():
    policy = seal_policy()
    samples = dp_update.batch(policy)
    b = load("01_formats").pack(dp_update.Tok, samples)
    adv = torch.tensor([s["adv"] for s in samples], dtype=torch.float64).unsqueeze(1).expand_as(b["mask"])
    _, _, h = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
    loss_tok, _ = S.seal_loss(0.02)(policy, h, b, adv)
    (loss_tok * b["mask"]).sum().backward()
    lora = [p.grad for n, p in policy.named_parameters() if "lora_A" in n]
    assert lora and all(g is not None for g in lora) and sum(g.abs().sum().item() for g in lora) > 0
    assert all(p.grad is not None for p in policy.seal_head.parameters())


def test_head_seconds_times_the_head_and_leaves_no_gradients():
    policy = seal_policy()
    samples = dp_update.batch(policy)
    t = S.head_seconds(policy, dp_update.Tok, samples, SimpleNamespace(alpha=0.02, minibatches=2), repeats=3)
    assert 0 < t < 5
    assert all(p.grad is None or not p.grad.abs().sum() for p in policy.parameters())
