import math
import os
import random
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import load, ROOT

F, R, G = load("01_formats"), load("02_rollouts"), load("03_grpo")
sys.path.insert(0, os.path.join(ROOT, "tests"))
import dp_update  # noqa: E402


def fake_trajs(seed=0, groups=3, size=4):
    """Random batch: unequal lengths, invalid steps, rewards at the end (as the envs give them)."""
    rng = random.Random(seed)
    trajs = []
    for g in range(groups):
        for _ in range(size):
            n = rng.randint(1, 5)
            steps = [{"reward": rng.choice([0.0, 0.0, 10.0]) if k == n - 1 else 0.0, "valid": rng.random() > 0.3}
                     for k in range(n)]
            trajs.append({"group": g, "steps": steps, "won": steps[-1]["reward"] > 0})
    return trajs


def slow_row_grpo(trajs):
    """verl-agent's GRPO as shared/README.md states it, one row per env step, plain loops: {(traj, step): A}."""
    rows = []  # (group, traj, step, score)
    for i, t in enumerate(trajs):
        episode_return = 0.0
        for s in t["steps"]:
            episode_return += s["reward"]
        for k, s in enumerate(t["steps"]):
            rows.append((t["group"], i, k, episode_return - (0.1 if not s["valid"] else 0.0)))
    out = {}
    for g, i, k, score in rows:
        mine = [x for h, _, _, x in rows if h == g]
        if len(mine) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.mean(mine), statistics.stdev(mine)
        out[i, k] = (score - mean) / (std + 1e-6)
    return out


def slow_traj_grpo(trajs):
    """--adv_level traj: one return per trajectory (penalties included), normalised over the group's trajectories."""
    ret = [sum(s["reward"] - (0.1 if not s["valid"] else 0.0) for s in t["steps"]) for t in trajs]
    out = {}
    for i, t in enumerate(trajs):
        mates = [ret[j] for j, u in enumerate(trajs) if u["group"] == t["group"]]
        for k in range(len(t["steps"])):
            out[i, k] = (ret[i] - statistics.mean(mates)) / (statistics.stdev(mates) + 1e-6)
    return out


def hand_batch():
    """Unequal lengths, invalid steps, an all-equal group (2), a single-row group (3)."""
    st = lambda r=0.0, v=True: {"reward": r, "valid": v}  # noqa: E731
    return [{"group": 0, "steps": [st(), st(v=False), st(10.0)]},
            {"group": 0, "steps": [st(v=False), st()]},
            {"group": 0, "steps": [st(), st(), st(), st(10.0, v=False)]},
            {"group": 1, "steps": [st(10.0)]},
            {"group": 1, "steps": [st(v=False), st(), st(10.0)]},
            {"group": 2, "steps": [st(), st()]},
            {"group": 2, "steps": [st()]},
            {"group": 3, "steps": [st(10.0, v=False)]}]


@pytest.mark.parametrize("trajs", [hand_batch()] + [fake_trajs(seed) for seed in range(5)])
def test_row_grpo_matches_slow_reference(trajs):
    want = slow_row_grpo(trajs)
    got = G.grpo_advantages(trajs, SimpleNamespace(adv_level="row"))
    for i, t in enumerate(got):
        for k, s in enumerate(t["steps"]):
            assert s["adv"] == pytest.approx(want[i, k], abs=1e-9), (i, k)


def test_row_grpo_edge_cases():
    trajs = G.grpo_advantages(hand_batch())  # row is the default
    assert all(s["adv"] == 0 for t in trajs if t["group"] == 2 for s in t["steps"])  # all-equal: no signal
    assert trajs[-1]["steps"][0]["adv"] == pytest.approx((10.0 - 0.1) / (1 + 1e-6))  # one row: mean 0, std 1
    first = trajs[0]["steps"]
    assert first[1]["adv"] < first[0]["adv"] == first[2]["adv"]  # the penalty hits the invalid step alone


def test_row_advantages_sum_to_zero_where_trajectory_ones_push_down():
    """2 wins of 10 steps and 6 failures of 25: rows weigh by length, so only the row form is balanced."""
    trajs = [{"group": 0, "steps": [{"reward": 10.0 * (k == 9), "valid": True} for k in range(10)]} for _ in range(2)]
    trajs += [{"group": 0, "steps": [{"reward": 0.0, "valid": True} for _ in range(25)]} for _ in range(6)]
    row = sum(s["adv"] for t in G.grpo_advantages(trajs, level="row") for s in t["steps"])
    traj = sum(s["adv"] for t in G.grpo_advantages(trajs, level="traj") for s in t["steps"])
    assert abs(row) < 1e-9 and -50 < traj < -48


@pytest.mark.parametrize("seed", range(4))
def test_traj_grpo_matches_slow_reference(seed):
    trajs = fake_trajs(seed)
    want = slow_traj_grpo(trajs)
    for i, t in enumerate(G.grpo_advantages(trajs, level="traj")):
        for k, s in enumerate(t["steps"]):
            assert s["adv"] == pytest.approx(want[i, k], abs=1e-9)


def test_identical_returns_give_zero_advantage():
    trajs = [{"group": 0, "steps": [{"reward": 10.0, "valid": True}]} for _ in range(4)]
    for level in ("row", "traj"):
        assert all(t["steps"][0]["adv"] == 0 for t in G.grpo_advantages(trajs, level=level))


def slow_token_loss(lp, old, ref, a, ent, clip_eps=0.2, c=3.0, kl_coef=0.01, ent_coef=0.001):
    """verl's actor loss for one token (dual-clip PPO, clamped k3 KL, entropy bonus), as shared/README.md states."""
    ratio = math.exp(max(-20.0, min(20.0, lp - old)))
    unclipped = -a * ratio
    clipped = -a * max(1 - clip_eps, min(1 + clip_eps, ratio))
    pg = max(unclipped, clipped)
    if a < 0:
        pg = min(pg, -c * a)
    d = max(-20.0, min(20.0, ref - lp))
    kl = max(-10.0, min(10.0, math.exp(d) - d - 1))
    return pg + kl_coef * kl - ent_coef * ent, clipped > unclipped


def test_token_losses_match_slow_reference_elementwise():
    g = torch.Generator().manual_seed(0)
    n = 4000  # wide ranges, so that the clip, the dual clip and the KL clamp all occur
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 6
    old = lp + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 4
    ref = lp + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 8
    adv = torch.randn(n, generator=g, dtype=torch.float64) * 2
    ent = torch.rand(n, generator=g, dtype=torch.float64)
    loss, clipped, _ = G.token_losses(lp, old, ref, adv, 0.2, 0.01, ent, 0.001, 3.0)
    hits = {"dual": 0, "kl_clamp": 0, "clip": 0}
    for i in range(n):
        want, was_clipped = slow_token_loss(lp[i].item(), old[i].item(), ref[i].item(), adv[i].item(), ent[i].item())
        assert loss[i].item() == pytest.approx(want, abs=1e-12) and bool(clipped[i]) == was_clipped, i
        ratio = math.exp(lp[i].item() - old[i].item())
        hits["dual"] += adv[i].item() < 0 and ratio > 3
        hits["kl_clamp"] += math.exp(ref[i].item() - lp[i].item()) - (ref[i].item() - lp[i].item()) - 1 > 10
        hits["clip"] += was_clipped
    assert min(hits.values()) > 20, hits


def slow_loss(policy, samples, clip_eps, kl_coef, ent_coef=0.001, c=3.0):
    """Token by token with a plain full-sequence forward, no packing: the reference for pack/gather/loss."""
    terms = []
    lm = policy.lm
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        with torch.no_grad():
            logits = lm(input_ids=ids).logits[0].float()
            with lm.disable_adapter():
                ref_logits = lm(input_ids=ids).logits[0].float()
        p = len(s["prompt_ids"])
        for t, y in enumerate(s["response_ids"]):
            logq = torch.log_softmax(logits[p + t - 1], -1)
            ent = -(logq.exp() * logq).sum().item()
            ref = torch.log_softmax(ref_logits[p + t - 1], -1)[y].item()
            terms.append(slow_token_loss(logq[y].item(), s["old_logp"][t], ref, s["adv"], ent, clip_eps, c,
                                         kl_coef, ent_coef)[0])
    return sum(terms) / len(terms)


def test_update_loss_matches_slow_reference():
    from accelerate import Accelerator
    policy = dp_update.build()
    samples = dp_update.batch(policy)
    for j, s in enumerate(samples):  # pretend the rollout policy differed, so ratios, clip and dual clip occur
        rng = random.Random(j)
        s["old_logp"] = [x + rng.uniform(-0.4, 0.4) - 1.5 * (j % 3 == 0) for x in s["old_logp"]]
        s["adv"] = -abs(s["adv"]) if j % 3 == 0 else s["adv"]
    want = slow_loss(policy, samples, 0.2, 0.01)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
    args = dp_update.update_args()
    stats = G.update(policy, opt, Accelerator(), dp_update.Tok, samples, args)
    assert stats["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert 0 < stats["pg_clipfrac"] < 1 and stats["kl"] > 0


def test_micro_batches_give_the_same_step_as_one_batch():
    from accelerate import Accelerator
    after = []
    for micro in (0, 3):  # 0 = the whole minibatch in one forward
        policy = dp_update.build()
        samples = dp_update.batch(policy)
        opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
        args = dp_update.update_args(minibatches=2, micro_batch=micro)
        stats = G.update(policy, opt, Accelerator(), dp_update.Tok, samples, args)
        after.append(({k: v.detach().clone() for k, v in policy.named_parameters() if v.requires_grad}, stats))
    (a, sa), (b, sb) = after
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-12), k
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-9) and sa["kl"] == pytest.approx(sb["kl"], rel=1e-9)


@pytest.mark.parametrize("distinct,share", [(0, "0"), (3, "1")])
def test_two_process_update_equals_one_process(tmp_path, distinct, share):
    """(3, "1"): 8 samples on 3 distinct prompts; 1 process without prompt sharing vs 2 processes with it."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, DP_DISTINCT=str(distinct), DP_SHARE_PREFIX="0")
    script = os.path.join(ROOT, "tests", "dp_update.py")
    subprocess.run([sys.executable, script, str(one)], check=True, env=env, cwd=ROOT)
    env["DP_SHARE_PREFIX"] = share
    p = launch_two(script, two, env)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = torch.load(one), torch.load(two)
    assert (a["world"], b["world"]) == (1, 2)
    start = {k: v for k, v in dp_update.build().named_parameters() if v.requires_grad}
    for k, v in a["params"].items():
        assert torch.allclose(v, b["params"][k], rtol=0, atol=1e-10), k
    assert sum(not torch.allclose(v, start[k]) for k, v in a["params"].items()) > len(start) // 2  # it did move
    assert a["stats"]["loss"] == pytest.approx(b["stats"]["loss"], rel=1e-5)


def launch_two(script, out, env):
    """accelerate launch of a test script on 2 CPU processes (gloo); returns the finished process."""
    for attempt in range(2):  # the gloo launcher on CPU fails to start now and then (~1 in 7 here); one retry
        port = str(29500 + (os.getpid() + 17 * attempt) % 400)
        p = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                            "--main_process_port", port, script, str(out)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)  # ranks that disagree deadlock
        if p.returncode == 0:
            break
    return p


def nan_aux(bad_calls):
    """An aux loss (05's hook) that is NaN on the listed calls (0-based) and 0 otherwise, with a gradient path."""
    calls = []

    def aux(raw, h, b, adv):
        calls.append(1)
        return h.sum(-1) * (float("nan") if len(calls) - 1 in bad_calls else 0.0), {}
    return aux


def adam_state(opt):
    import copy
    return copy.deepcopy(opt.state_dict())


def same_state(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_nonfinite_step_is_skipped_and_leaves_adapter_and_optimizer_untouched():
    from accelerate import Accelerator
    policy = dp_update.build()
    samples = dp_update.batch(policy)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    G.update(policy, opt, Accelerator(), dp_update.Tok, samples, dp_update.update_args())  # Adam has state now
    params = {k: v.detach().clone() for k, v in policy.named_parameters() if v.requires_grad}
    state = adam_state(opt)
    stats = G.update(policy, opt, Accelerator(), dp_update.Tok, samples, dp_update.update_args(), nan_aux({0}))
    assert stats["skipped_steps"] == 1 and math.isnan(stats["loss"])
    assert all(torch.equal(v, params[k]) for k, v in policy.named_parameters() if v.requires_grad)
    assert same_state(adam_state(opt), state)
    # a finite step afterwards moves the weights again: the guard resets, nothing was left broken
    stats = G.update(policy, opt, Accelerator(), dp_update.Tok, samples, dp_update.update_args())
    assert stats["skipped_steps"] == 0 and math.isfinite(stats["loss"])
    assert any(not torch.equal(v, params[k]) for k, v in policy.named_parameters() if v.requires_grad)


def test_skipped_minibatch_leaves_the_other_steps_as_they_would_be():
    """2 mini-batches, the first NaN: the result is the second mini-batch's step alone, bit for bit."""
    from accelerate import Accelerator
    runs = []
    for bad, part in (({0}, slice(None)), (set(), slice(4, 8))):
        policy = dp_update.build()
        samples = dp_update.batch(policy)
        opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
        args = dp_update.update_args(minibatches=2 if bad else 1)
        stats = G.update(policy, opt, Accelerator(), dp_update.Tok, samples[part], args, nan_aux(bad))
        runs.append(({k: v.detach().clone() for k, v in policy.named_parameters() if v.requires_grad}, stats))
    (a, sa), (b, sb) = runs
    assert sa["skipped_steps"] == 1 and sb["skipped_steps"] == 0
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sa["loss"] == sb["loss"] and sa["kl"] == sb["kl"]  # the statistics are those of the step taken


def test_persistent_nonfinite_steps_stop_the_update():
    from accelerate import Accelerator
    policy = dp_update.build()
    samples = dp_update.batch(policy)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    guard = {"streak": 1}  # one skipped at the end of the previous update: the streak crosses updates
    args = dp_update.update_args(minibatches=2, max_skipped_steps=3)
    with pytest.raises(G.NonFiniteStop, match="3 optimizer steps in a row"):
        G.update(policy, opt, Accelerator(), dp_update.Tok, samples, args, nan_aux({0, 1}), guard)
    guard = {"streak": 0}
    stats = G.update(policy, opt, Accelerator(), dp_update.Tok, samples, args, nan_aux({0}), guard)
    assert stats["skipped_steps"] == 1 and guard["streak"] == 0  # a finite step resets the streak


def test_two_processes_skip_the_same_step(tmp_path):
    """A NaN in rank 1's loss value only (its gradients finite): both ranks must skip, or their weights part."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, DP_NAN_RANK="1", DP_SHARE_PREFIX="0")
    p = launch_two(os.path.join(ROOT, "tests", "dp_update.py"), tmp_path / "nan.pt", env)
    assert p.returncode == 0, p.stderr[-3000:]
    r0, r1 = (torch.load(f"{tmp_path / 'nan.pt'}.rank{r}") for r in (0, 1))
    assert r0["stats"]["skipped_steps"] == r1["stats"]["skipped_steps"] == 1
    assert all(torch.equal(v, r1["params"][k]) for k, v in r0["params"].items())
    start = {k: v for k, v in dp_update.build().named_parameters() if v.requires_grad}
    assert any(not torch.equal(v, start[k]) for k, v in r0["params"].items())  # the second step was taken


def test_sign_test_matches_enumeration():
    # p = probability, under a fair coin for each disagreeing task, of a split at least as uneven as the one seen
    import itertools
    a, b = [0, 0, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 1, 1]   # 4 gained, 1 lost, 3 ties
    n, seen = 5, abs(4 - 1)
    slow = sum(abs(2 * sum(x) - n) >= seen for x in itertools.product([0, 1], repeat=n)) / 2 ** n
    r = G.sign_test(a, b)
    assert (r["gained"], r["lost"]) == (4, 1) and abs(r["p"] - slow) < 1e-12
    assert G.sign_test(b, a)["p"] == r["p"] and G.sign_test(a, a) == {"gained": 0, "lost": 0, "p": 1.0}



def test_saved_adapter_reloads_with_plain_peft_and_merges(tmp_path):
    """ckpt/adapter is what PEFT's save_pretrained writes: PeftModel.from_pretrained on a fresh base gives the same
    log-probs as the trained policy, merge_and_unload too, and --eval_ckpt's loader puts the same weights back."""
    from peft import PeftModel
    policy = _trained_policy()  # B is no longer zero
    G.save_adapter(policy.lm, 7, str(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors", "update.json"} <= set(os.listdir(tmp_path / "adapter"))
    ids = torch.randint(1, 64, (2, 10))
    policy.eval()
    with torch.no_grad():
        want = policy.lm(input_ids=ids).logits.log_softmax(-1)
        peft = PeftModel.from_pretrained(F.tiny_model(64, seed=0), str(tmp_path / "adapter")).eval()
        assert torch.allclose(peft(input_ids=ids).logits.log_softmax(-1), want, atol=1e-5)
        merged = peft.merge_and_unload()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        assert torch.allclose(merged(input_ids=ids).logits.log_softmax(-1), want, atol=1e-5)
        fresh = R.Policy(F.add_lora(F.tiny_model(64, seed=0), r=4)).eval()
        assert not torch.allclose(fresh.lm(input_ids=ids).logits.log_softmax(-1), want, atol=1e-3)
        assert G.load_adapter(fresh, str(tmp_path / "adapter")) == 7
        assert torch.allclose(fresh.lm(input_ids=ids).logits.log_softmax(-1), want, atol=1e-6)


def _trained_policy(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    policy = R.Policy(F.add_lora(F.tiny_model(64, seed=0), r=4))
    with torch.no_grad():  # move the adapter away from zero so that ratio, KL and every LoRA gradient are non-trivial
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    if dtype != torch.float32:
        state = policy.state_dict()
        policy = R.Policy(F.add_lora(F.tiny_model(64, seed=0).to(dtype), r=4))
        policy.load_state_dict(state)  # the same values, base weights rounded to dtype; LoRA stays float32
    return policy


def _update_grads(policy, samples, **kw):
    """One update() on a copy of the samples; returns (stats, {LoRA parameter: gradient}). lr 0: nothing moves."""
    import copy
    from accelerate import Accelerator
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    args = dp_update.update_args(max_grad_norm=1e9, **kw)
    stats = G.update(policy, opt, Accelerator(cpu=True), dp_update.Tok, copy.deepcopy(samples), args)
    return stats, {n: p.grad.detach().float().clone() for n, p in policy.named_parameters() if p.requires_grad}


def test_bfloat16_update_stays_within_bfloat16_tolerance_of_float32():
    policy = _trained_policy()
    samples = dp_update.batch(policy, n=8, seed=1, distinct=3)
    for s in samples:
        s["old_logp"] = [x - 0.05 for x in s["old_logp"]]  # a ratio away from 1
    want, g32 = _update_grads(policy, samples)
    bf16 = _trained_policy(torch.bfloat16)
    assert {p.dtype for n, p in bf16.named_parameters() if "lora_" in n} == {torch.float32}
    got, g16 = _update_grads(bf16, samples)
    assert got["loss"] == pytest.approx(want["loss"], rel=3e-2, abs=1e-3)
    a, b = torch.cat([g.flatten() for g in g32.values()]), torch.cat([g.flatten() for g in g16.values()])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    assert (b - a).norm() / a.norm() < 0.1
    assert not torch.equal(a, b)  # bfloat16 did run: the rounding shows


def test_gradient_checkpointing_gives_the_same_update():
    policy = _trained_policy()
    samples = dp_update.batch(policy, n=8, seed=2, distinct=3)
    want, g_plain = _update_grads(policy, samples, micro_batch=3, share_prefix=False)
    policy.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # asked to share prompts, update() runs them unshared: checkpointing turns off the cache the shared path needs
    got, g_ckpt = _update_grads(policy, samples, micro_batch=3, share_prefix=True, gradient_checkpointing=True)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    for n in g_plain:
        assert torch.allclose(g_ckpt[n], g_plain[n], rtol=1e-5, atol=1e-7), n
