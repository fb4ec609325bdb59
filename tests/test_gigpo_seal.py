import importlib
import math
import os
import random
import statistics
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


def slow_gigpo(trajs, gamma, omega, mode="mean_norm"):
    """verl-agent's GiGPO as shared/README.md states it, plain loops; returns {(traj, step): advantage}."""
    def norm(x, xs, single_mean):
        if len(xs) == 1:
            mean, std = single_mean(x), 1.0
        else:
            mean, std = statistics.mean(xs), statistics.stdev(xs)
        return x - mean if mode == "mean_norm" else (x - mean) / (std + 1e-6)
    score, ret = {}, {}
    for i, t in enumerate(trajs):
        episode_return = sum(s["reward"] for s in t["steps"])
        for k, s in enumerate(t["steps"]):
            score[i, k] = episode_return - (0 if s["valid"] else 0.1)
            r = sum(gamma ** (j - k) * t["steps"][j]["reward"] for j in range(k, len(t["steps"])))
            ret[i, k] = r - (0 if s["valid"] else 0.1)
    out = {}
    for (i, k), x in score.items():
        g = trajs[i]["group"]
        rows = [score[j, m] for (j, m) in score if trajs[j]["group"] == g]
        a_ep = norm(x, rows, lambda _: 0.0)  # a one-row task group: mean 0, std 1
        obs = trajs[i]["steps"][k]["obs"]
        same = [ret[j, m] for (j, m) in ret if trajs[j]["group"] == g and trajs[j]["steps"][m]["obs"] == obs]
        a_step = norm(ret[i, k], same, lambda y: y)  # a singleton anchor group: its own mean, so 0
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
        {"group": 2, "steps": [step("start", 10.0)]},                                          # one-row group
        {"group": 3, "steps": [step("start"), step("s")]},                                     # all equal
        {"group": 3, "steps": [step("start"), step("s")]},
    ]


def random_cases(seed):
    rng = random.Random(seed)
    out = []
    for g in range(3):
        for _ in range(4):
            n = rng.randint(1, 6)
            out.append({"group": g, "steps": [step(rng.choice("abcd"), 10.0 * (k == n - 1 and rng.random() < 0.4),
                                                   rng.random() > 0.2) for k in range(n)]})
    return out


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("batch", [cases] + [lambda s=s: random_cases(s) for s in range(4)])
@pytest.mark.parametrize("gamma,omega", [(0.95, 1.0), (0.5, 0.3), (1.0, 0.0)])
def test_gigpo_matches_slow_reference(gamma, omega, batch, mode):
    trajs = GG.gigpo_advantages(batch(), SimpleNamespace(gamma=gamma, omega=omega, gigpo_mode=mode))
    want = slow_gigpo(batch(), gamma, omega, mode)
    for i, t in enumerate(trajs):
        for k, s in enumerate(t["steps"]):
            assert s["adv"] == pytest.approx(want[i, k], abs=1e-9), (i, k)


def test_gigpo_singleton_anchor_has_only_episode_advantage():
    trajs = GG.gigpo_advantages(cases(), SimpleNamespace(gamma=0.95, omega=1.0))
    rows = [s for t in cases()[:3] for s in t["steps"]]
    score = lambda i, s: sum(u["reward"] for u in cases()[i]["steps"]) - 0.1 * (not s["valid"])  # noqa: E731
    mean = sum(score(i, s) for i in range(3) for s in cases()[i]["steps"]) / len(rows)
    assert trajs[2]["steps"][1]["adv"] == pytest.approx(score(2, cases()[2]["steps"][1]) - mean)  # "x" occurs once
    assert trajs[6]["steps"][0]["adv"] == pytest.approx(10.0)  # one row in its task group: mean 0
    assert trajs[7]["steps"][0]["adv"] == trajs[8]["steps"][1]["adv"] == 0.0


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


def test_seal_loss_reads_the_states_at_the_response_tokens():
    """The released SEAL feeds the head h at y_1..y_R (the last at the end-of-turn token): positions p .. p+R-1 of
    a plain unpadded forward, one later than the states whose logits give log pi(y_k)."""
    from accelerate import Accelerator
    F = load("01_formats")
    policy = seal_policy()
    samples = dp_update.batch(policy)
    slow = []
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        p, n = len(s["prompt_ids"]), len(s["response_ids"])
        with torch.no_grad():
            h = F.body_and_head(policy.lm)[0](input_ids=ids).last_hidden_state[0, p:p + n]
            z = policy.seal_head(h)[:, 0]
        y = 1.0 if s["adv"] >= 0 else 0.0
        slow += [torch.nn.functional.softplus(-x).item() if y else torch.nn.functional.softplus(x).item() for x in z]
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
    args = dp_update.update_args()
    with_seal = G.update(policy, opt, Accelerator(), dp_update.Tok, samples, args, S.seal_loss(0.02))
    without = G.update(policy, opt, Accelerator(), dp_update.Tok, samples, args)
    assert with_seal["seal_bce"] == pytest.approx(sum(slow) / len(slow), rel=1e-6)
    assert with_seal["loss"] - without["loss"] == pytest.approx(0.02 * sum(slow) / len(slow), rel=1e-5)
    b = F.pack(dp_update.Tok, samples)
    with torch.no_grad():
        h_tok = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])[2]
        h_logit = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"], logit_states=True)[2]
    n = len(samples[0]["response_ids"])
    assert n > 1 and torch.equal(h_tok[0, :n - 1], h_logit[0, 1:n]) and not torch.allclose(h_tok, h_logit)


def test_seal_depth_defaults_per_env(monkeypatch):
    seen = []
    monkeypatch.setattr(G, "train", lambda args, *a, **k: seen.append(args.seal_depth))
    for env, depth in (("alfworld", 6), ("webshop", 3)):
        S.main(["--env", env, "--out_dir", "/tmp/unused"])
        S.main(["--env", env, "--seal_depth", "2", "--out_dir", "/tmp/unused"])
    assert seen == [6, 2, 3, 2]


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
    bench = importlib.import_module("benchmarks.seal_overhead")
    t = bench.head_seconds(policy, dp_update.Tok, samples, SimpleNamespace(alpha=0.02, minibatches=2), repeats=3)
    assert 0 < t < 5
    assert all(p.grad is None or not p.grad.abs().sum() for p in policy.parameters())


# --------------------------------------------------------------------------------------------- EMPG
def slow_empg(trajs, k=1.0, k_next=1.0, zeta=0.05):
    """EMPG as shared/README.md states it, over a flat list of step rows with plain loops.
    trajs carry 'adv' and token entropies on each step; returns {(traj, step): modulated advantage}."""
    rows = []  # (traj, step, H_t, A_t)
    for i, t in enumerate(trajs):
        for j, s in enumerate(t["steps"]):
            rows.append((i, j, sum(s["entropy"]) / len(s["entropy"]), s["adv"]))
    lo = min(r[2] for r in rows)
    hi = max(r[2] for r in rows)
    h_norm = {(i, j): (h - lo) / (hi - lo + 1e-8) for i, j, h, _ in rows}
    scale = {key: math.exp(-k * h) for key, h in h_norm.items()}
    scale_mean = sum(scale.values()) / len(scale)
    out = {}
    for i, j, _, a in rows:
        last = j == len(trajs[i]["steps"]) - 1
        f = 0.0 if last else math.exp(-k_next * h_norm[i, j + 1])
        out[i, j] = scale[i, j] / scale_mean * a + zeta * f
    mean = sum(out.values()) / len(out)
    return {key: v - mean for key, v in out.items()}


def empg_batch(seed):
    rng = random.Random(seed)
    trajs = []
    for g in range(3):
        for _ in range(3):
            n = rng.randint(1, 5)  # unequal lengths, one-step trajectories included
            trajs.append({"group": g, "steps": [
                dict(step(rng.choice("abc"), 10.0 * (m == n - 1 and rng.random() < 0.4), rng.random() > 0.2),
                     entropy=[rng.random() for _ in range(rng.randint(1, 6))]) for m in range(n)]})
    return trajs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("base", ["grpo", "gigpo"])
@pytest.mark.parametrize("k,k_next,zeta", [(1.0, 1.0, 0.05), (2.0, 0.5, 0.3)])
def test_empg_matches_slow_reference(seed, base, k, k_next, zeta):
    args = SimpleNamespace(empg_base=base, empg_k=k, empg_k_next=k_next, empg_zeta=zeta, gamma=0.95, omega=1.0)
    got = S.empg_advantages(empg_batch(seed), args)
    before = S.ADVANTAGES[base](empg_batch(seed), args)
    want = slow_empg(before, k, k_next, zeta)
    assert any(abs(want[i, j] - s["adv"]) > 1e-3  # EMPG changes the advantages
               for i, t in enumerate(before) for j, s in enumerate(t["steps"]))
    for i, t in enumerate(got):
        for j, s in enumerate(t["steps"]):
            assert s["adv"] == pytest.approx(want[i, j], abs=1e-9), (i, j)
    assert sum(s["adv"] for t in got for s in t["steps"]) == pytest.approx(0.0, abs=1e-9)


def test_empg_equal_entropies_only_shift_by_the_bonus():
    # every H_t equal: H~ = 0, g = 1, f = 1 except on last steps; so A_mod = A + zeta f - mean
    trajs = empg_batch(0)
    for t in trajs:
        for s in t["steps"]:
            s["entropy"] = [0.3, 0.3]
    before = [s["adv"] for t in S.ADVANTAGES["grpo"](empg_batch(0), None) for s in t["steps"]]
    after = S.empg_advantages(trajs, SimpleNamespace(empg_base="grpo"))
    bonus = [0.05 * (j < len(t["steps"]) - 1) for t in after for j in range(len(t["steps"]))]
    shift = sum(b + a for b, a in zip(bonus, before)) / len(before)
    assert [s["adv"] for t in after for s in t["steps"]] == pytest.approx([a + b - shift for a, b in
                                                                          zip(before, bonus)], abs=1e-12)


def _empg_rank(rank, trajs, port, out):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mine = [t for i, t in enumerate(trajs) if t["group"] % 2 == rank]  # whole task groups per process, as 03 splits
    S.empg_advantages(mine, SimpleNamespace(empg_base="gigpo", gamma=0.95, omega=1.0))
    out.put([(t["key"], [s["adv"] for s in t["steps"]]) for t in mine])
    dist.destroy_process_group()


def test_empg_under_two_processes_equals_one_process():
    import torch.multiprocessing as mp
    trajs = empg_batch(7)
    for i, t in enumerate(trajs):
        t["key"] = i
    want = S.empg_advantages(empg_batch(7), SimpleNamespace(empg_base="gigpo", gamma=0.95, omega=1.0))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29600 + os.getpid() % 300
    procs = [ctx.Process(target=_empg_rank, args=(r, trajs, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) + out.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
    assert sorted(got) == list(range(len(trajs)))
    for i, t in enumerate(want):
        assert got[i] == pytest.approx([s["adv"] for s in t["steps"]], abs=1e-9)


def test_seal_overhead_benchmark_times_both_updates():
    """benchmarks/seal_overhead.py: the same batch updated with and without the head; the head's own time is part of
    the update's."""
    bench = importlib.import_module("benchmarks.seal_overhead")
    out = bench.main(["--env", "webshop", "--tasks", "1", "--group_size", "2", "--max_steps", "2",
                      "--max_new_tokens", "16"])
    assert out["samples"] > 0 and out["update_seconds_rl"] > 0 and out["update_seconds_rl_seal"] > 0
    assert 0 < out["head_seconds"] < out["update_seconds_rl_seal"]
