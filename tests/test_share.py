"""Prompt sharing (helpers/batches.py's pack_shared) computes the same numbers as running every sample's own copy of its
prompt."""
import copy
import importlib
import os
import sys

import pytest
import torch
from accelerate import Accelerator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
F = importlib.import_module("01_formats")
R = importlib.import_module("02_rollouts")
G = importlib.import_module("03_grpo")
S = importlib.import_module("05_seal")
import dp_update  # noqa: E402

TOL = dict(rtol=0, atol=1e-8)


def shared_batch(policy, n=12, distinct=4, seed=1):
    samples = dp_update.batch(policy, n=n, seed=seed, distinct=distinct)
    for s in samples:
        for k in ("old_logp", "entropy", "hidden_mean", "ref_logp"):
            s.pop(k, None)
    return samples


def test_micro_batches_keep_a_prompt_together():
    policy = dp_update.build()
    samples = shared_batch(policy, n=20, distinct=6)
    runs = F.micro_batches(samples, 5, share=True)
    assert sorted(id(s) for r in runs for s in r) == sorted(id(s) for s in samples)
    owners = [{tuple(s["prompt_ids"]) for s in r} for r in runs]
    assert all(not (a & b) for i, a in enumerate(owners) for b in owners[i + 1:])  # no prompt in two runs
    assert len(runs) > 1
    b = F.pack_shared(dp_update.Tok, runs[0])
    assert b["prefix"]["input_ids"].shape[0] == len(owners[0]) < len(runs[0]) + 1


@pytest.mark.parametrize("size", [0, 3, 16])
@pytest.mark.parametrize("merge", [False, True])
def test_shared_scoring_and_reference_equal_the_unshared_passes(size, merge):
    policy = dp_update.build()
    a = shared_batch(policy)
    b = copy.deepcopy(a)
    R.score(policy, dp_update.Tok, a, batch_size=size, share=False, merge=False)
    R.score(policy, dp_update.Tok, b, batch_size=size, share=True, merge=merge)
    G.reference_logps(policy, dp_update.Tok, a, batch_size=size, share=False)
    G.reference_logps(policy, dp_update.Tok, b, batch_size=size, share=True)
    for x, y in zip(a, b):
        for k in ("old_logp", "entropy", "hidden_mean", "ref_logp"):
            assert torch.allclose(torch.tensor(x[k]), torch.tensor(y[k]), **TOL), k
    assert any(abs(u - v) > 1e-3 for x in a for u, v in zip(x["old_logp"], x["ref_logp"]))  # the adapter matters


def states(policy, samples, share):
    pk = F.pack_shared if share else F.pack
    b = pk(dp_update.Tok, samples)
    out = [policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"], logit_states=ls,
                  prefix=b.get("prefix")) for ls in (False, True)]
    return out, b["mask"]


def test_shared_forward_gives_both_hidden_states():
    """The states at the response tokens (SEAL, analysis) and at the positions whose logits give their log-probs."""
    policy = dp_update.build()
    samples = shared_batch(policy)
    (a, ma), (b, mb) = states(policy, samples, False), states(policy, samples, True)
    m = ma.bool()
    assert torch.equal(ma, mb)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert torch.allclose(u[m], v[m], **TOL)


@pytest.mark.parametrize("seal", [False, True])
def test_shared_update_gives_the_same_loss_and_gradients(seal):
    """One update (2 minibatches, micro-batches of 3) with and without sharing: the same loss, metrics, LoRA (and
    SEAL head) gradients and parameters after the step, in float64."""
    results = []
    for share in (False, True):
        base = dp_update.build()
        policy = S.SealPolicy(base.lm, depth=3, dropout=0.0).double() if seal else base
        samples = shared_batch(policy, n=16, distinct=5)
        R.score(policy, dp_update.Tok, samples, share=False)
        G.reference_logps(policy, dp_update.Tok, samples, share=False)
        opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
        args = dp_update.update_args(minibatches=2, micro_batch=3, share_prefix=share)
        aux = S.seal_loss(0.5) if seal else None
        stats = G.update(policy, opt, Accelerator(cpu=True), dp_update.Tok, samples, args, aux)
        named = [(k, v) for k, v in policy.named_parameters() if v.requires_grad]
        results.append((stats, {k: v.detach().clone() for k, v in named}, {k: v.grad.clone() for k, v in named}))
    (sa, pa, ga), (sb, pb, gb) = results
    # dp_update.build() runs RMSNorm in float64 too, so the two summation orders agree to ~1e-15; a detached or
    # misplaced prompt is off by O(1).
    assert set(sa) == set(sb) and all(sa[k] == pytest.approx(sb[k], rel=0, abs=1e-8) for k in sa)
    if seal:
        assert "seal_bce" in sa and any("seal_head" in k for k in ga)
    for k in pa:
        torch.testing.assert_close(ga[k], gb[k], **TOL, msg=k)
        torch.testing.assert_close(pa[k], pb[k], **TOL, msg=k)
    assert sum(ga[k].abs().sum() > 0 for k in ga) > len(ga) // 2  # the gradients are not trivially zero


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefill_samples_the_same_tokens(temperature):
    """generate() with each distinct prompt prefilled once draws the same tokens as generate's own prefill of every
    row (same seed; float64 so that no near-tie can flip)."""
    model, tok = F.load_base("tiny")
    model = copy.deepcopy(model).double().eval()
    env = F.make_env("alfworld")
    prompts = []
    for seed in (3, 4, 5):
        obs, info = env.reset(seed)
        text = F.build_prompt("alfworld", info["task"], obs, info["admissible_actions"], [], 2)
        prompts += [F.chat(tok, text)] * (2 + seed % 2)
    out = []
    for share in (False, True):
        torch.manual_seed(7)
        out.append(F.generate(model, tok, prompts, temperature, 24, share=share))
    assert out[0] == out[1]
    assert len({tuple(r) for r in out[0]}) > 1


def test_bench_speed_times_both_paths_on_the_same_batch(capsys):
    """benchmarks/speed.py on the shipped base: both paths score and update the same samples and agree (float32)."""
    speed = importlib.import_module("benchmarks.speed")
    out = speed.main(["--env", "alfworld", "--tasks", "1", "--group_size", "3", "--max_steps", "2",
                      "--max_new_tokens", "16"])
    assert out["steps"] == out["rollout_steps_plain"] > 0
    assert out["distinct_prompts"] < out["steps"]  # 3 episodes of one task share at least their first prompt
    assert 0 < out["tokens_saved"] < 1
    assert max(out["max_abs_diff_scores"].values()) < 1e-4
    assert abs(out["max_abs_diff_update"]["loss"]) < 1e-5
    assert all(out[f"{p}_s_{n}"] > 0 for p in ("rollout", "score", "reference", "update") for n in ("plain", "fast")
               if (p, n) != ("score", "fast"))
    assert out["score_s_fast"] == 0 and out["same_rollout"]  # lean sampling: the scores come with the rollout
    assert max(out["max_abs_diff_rollout_scores"].values()) < 1e-4
    assert "speed-up" in capsys.readouterr().out


def test_merged_lora_is_the_adapted_function_and_restores_the_base():
    """merged_lora(): the policy on W + s B A with the adapter off gives the LoRA path's outputs; afterwards the base
    weights are the very tensors they were, and the adapter is back on."""
    policy = dp_update.build()
    samples = shared_batch(policy)
    b = F.pack(dp_update.Tok, samples)
    before = {k: v for k, v in policy.lm.named_parameters() if "base_layer" in k}
    data = {k: v.detach().clone() for k, v in before.items()}
    ptr = {k: v.data_ptr() for k, v in before.items()}
    lora = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
    with F.merged_lora(policy.lm):
        assert any(not torch.equal(v.data, data[k]) for k, v in before.items())  # merged in
        merged = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
    with policy.lm.disable_adapter():
        base = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
    m = b["mask"].bool()
    for x, y, z in zip(lora, merged, base):
        torch.testing.assert_close(x[m], y[m], **TOL)
        assert not torch.allclose(x[m], z[m], atol=1e-4)  # the adapter matters
    assert all(v.data_ptr() == ptr[k] and torch.equal(v, data[k]) for k, v in before.items())  # the same tensors
    after = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
    assert all(torch.equal(x, y) for x, y in zip(lora, after))
    half = copy.deepcopy(policy.lm).to(torch.bfloat16)
    kept = [v.clone() for v in half.parameters()]
    with F.merged_lora(half):  # half precision keeps the adapter path: the sum would round the delta away
        assert all(torch.equal(v, w) for v, w in zip(half.parameters(), kept))
    mixed = copy.deepcopy(policy.lm)
    lora = [m for m in mixed.modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")]
    lora[0].get_base_layer().to(torch.bfloat16)  # one half-precision layer: merging the rest would drop its adapter
    kept = [v.clone() for v in mixed.parameters()]
    with F.merged_lora(mixed):
        assert all(torch.equal(v, w) for v, w in zip(mixed.parameters(), kept))
        assert not any(m.disable_adapters for m in lora)


def test_merged_rollout_samples_the_same_tokens():
    """play() on merged weights draws the same tokens as on the LoRA path (float64, same seed)."""
    model, tok = F.load_base("tiny")
    lm = dp_update.move_adapter(F.add_lora(copy.deepcopy(model).double(), r=4).eval())
    out = []
    for merge in (False, True):
        torch.manual_seed(3)
        trajs = F.play(lm, tok, "alfworld", [1, 2], group_size=2, max_steps=3, max_new_tokens=24, merge=merge)
        out.append([s["response_ids"] for t in trajs for s in t["steps"]])
    assert out[0] == out[1]
    torch.manual_seed(3)
    with lm.disable_adapter():
        trajs = F.play(lm, tok, "alfworld", [1, 2], group_size=2, max_steps=3, max_new_tokens=24, merge=False)
    assert [s["response_ids"] for t in trajs for s in t["steps"]] != out[0]  # the adapter changes what is drawn


def env_prompts(tok, seeds=(3, 4, 5)):
    """First-step ALFWorld prompts, each repeated 2-3 times as a task's G episodes start."""
    env, prompts = F.make_env("alfworld"), []
    for seed in seeds:
        obs, info = env.reset(seed)
        text = F.build_prompt("alfworld", info["task"], obs, info["admissible_actions"], [], 2)
        prompts += [F.chat(tok, text)] * (2 + seed % 2)
    return prompts


@pytest.mark.parametrize("temperature", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("share", [False, True])
def test_lean_sampling_draws_what_generate_draws(temperature, share):
    """helpers/batches.py's sample() against transformers' generate(): the same tokens for the same seed (float64: no
    near-tie can flip), over several calls in a row (the random stream is consumed the same way)."""
    model, tok = F.load_base("tiny")
    model = copy.deepcopy(model).double().eval()
    prompts = env_prompts(tok)
    out = []
    for fn in (F.generate, F.sample):
        torch.manual_seed(7)
        out.append([fn(model, tok, prompts, temperature, 24, share=share) for _ in range(2)])
    assert out[0] == out[1]
    assert len({tuple(r) for r in out[0][0]}) > 1


@pytest.mark.parametrize("merge,max_new", [(False, 40), (True, 40), (True, 12)])
def test_lean_rollout_scores_equal_the_scoring_pass(merge, max_new, monkeypatch):
    """play(scores=True) reads old_logp, entropy and hidden_mean off the sampling forwards; 02's score() computes
    them in a pass of its own over the finished steps: equal to 1e-8 in float64, truncated responses included."""
    from transformers.models.qwen2 import modeling_qwen2
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", dp_update.rmsnorm_in_input_dtype)
    model, tok = F.load_base("tiny")
    torch.manual_seed(0)  # the adapter's draw, whatever ran before
    lm = dp_update.move_adapter(F.add_lora(copy.deepcopy(model).double(), r=4).eval(), sd=0.02)
    policy = R.Policy(lm)
    torch.manual_seed(3)
    trajs = F.play(lm, tok, "alfworld", [1, 2], group_size=2, max_steps=3, max_new_tokens=max_new, merge=merge,
                   scores=True)
    samples = R.flatten(trajs, tok)
    passed = R.score(policy, tok, copy.deepcopy(samples), merge=False)
    ended = [not s["truncated"] for s in samples]  # by end-of-turn, or cut at the cap
    assert any(ended) if max_new == 40 else not all(ended)
    for a, b in zip(samples, passed):
        for k in ("old_logp", "entropy", "hidden_mean"):
            assert torch.allclose(torch.tensor(a[k]), torch.tensor(b[k]), **TOL), k
