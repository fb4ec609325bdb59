"""End to end on a small mid-trained base: rollouts, GRPO, GiGPO, SEAL, resume, bad input."""
import json
import os
import subprocess
import sys

import pytest

from conftest import load, ROOT

F, R, G, GG, S = (load(m) for m in ("01_formats", "02_rollouts", "03_grpo", "04_gigpo", "05_seal"))
B = load("base.build")


@pytest.fixture(scope="session")
def small_base(tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    B.build_base(B.Args(out_dir=str(out), demo_tasks=12, sft_steps=8, sft_batch=4, vocab_size=600), progress=False)
    return os.path.join(out, "tiny")


def quick(base, out, *extra):
    return ["--model", base, "--updates", "2", "--tasks", "2", "--group_size", "2", "--max_steps", "3",
            "--max_new_tokens", "24", "--val_every", "2", "--val_tasks", "2", "--save_every", "1",
            "--rollouts_every", "2", "--snapshot_every", "2", "--out_dir", str(out), *extra]


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_rollout_records(small_base, tmp_path):
    m = R.main(["--model", small_base, "--env", "alfworld", "--tasks", "2", "--group_size", "2", "--max_steps", "3",
                "--max_new_tokens", "24", "--out", str(tmp_path)])
    assert m["episodes"] == 4 and 0 <= m["valid_ratio"] <= 1 and m["entropy"] > 0
    from datasets import load_dataset
    ds = load_dataset("json", data_files=str(tmp_path / "alfworld.jsonl"), split="train")
    steps = json.loads(ds[0]["steps"])
    s = steps[0]
    assert len(s["old_logp"]) == len(s["entropy"]) == len(s["response_ids"]) > 0
    assert all(lp <= 0 for lp in s["old_logp"]) and len(s["hidden_mean"]) == 128
    assert s["obs"].startswith("You are in the middle of a room")


@pytest.mark.parametrize("script,env,extra", [("03_grpo", "webshop", []), ("04_gigpo", "alfworld", []),
                                              ("05_seal", "webshop", ["--algo", "empg", "--empg_base", "gigpo"])])
def test_training_runs_logs_and_resumes(small_base, tmp_path, script, env, extra):
    mod = {"03_grpo": G, "04_gigpo": GG, "05_seal": S}[script]
    mod.main(quick(small_base, tmp_path, "--env", env, *extra))
    first = rows(tmp_path)
    assert [r["update"] for r in first] == [1, 2]
    keys = {"entropy", "valid_ratio", "success", "reward", "kl", "pg_clipfrac", "grad_norm", "logp_correct",
            "logp_wrong", "logp_valid", "duplication", "hallucination", "val_success"}
    assert keys <= set(first[-1]), keys - set(first[-1])
    assert os.path.exists(os.path.join(tmp_path, "rollouts", "update00002-rank0.jsonl"))
    # TensorBoard through Accelerate's tracker, under the names TRL / verl-agent users know
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(tmp_path, "tb"))
    events.Reload()
    assert {"episode/success_rate", "entropy", "clip_ratio", "frac_reward_zero_std", "completions/clipped_ratio",
            "episode/valid_action_ratio"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("episode/success_rate")] == [1, 2]
    assert [e.value for e in events.Scalars("episode/success_rate")] == pytest.approx([r["success"] for r in first])
    assert os.path.exists(os.path.join(tmp_path, "ckpt", "state-u00002.pt"))
    # the run ends with 06's report of its own logs
    assert {"summary.md", "entropy.png", "success.png"} <= set(os.listdir(os.path.join(tmp_path, "analysis")))
    if script == "05_seal":
        assert 0 <= first[-1]["seal_acc"] <= 1 and first[-1]["seal_bce"] > 0
    # resume: asking for 3 updates continues at update 3 instead of starting over
    mod.main(quick(small_base, tmp_path, "--env", env, *extra)[:2] + ["--updates", "3"] +
             quick(small_base, tmp_path, "--env", env, *extra)[4:])
    assert [r["update"] for r in rows(tmp_path)] == [1, 2, 3]
    # --eval_ckpt: a snapshot and the base meet on the same held-out seeds, through the run's own policy class
    ev = [mod.main(quick(small_base, tmp_path, "--env", env, *extra) + ["--eval_ckpt", c, "--val_seed", "200000"])
          for c in ("base", os.path.join(tmp_path, "ckpt", "state-u00002.pt"),
                    os.path.join(tmp_path, "ckpt", "state.pt"), os.path.join(tmp_path, "ckpt"))]  # ckpt: PEFT export
    assert [e["update"] for e in ev] == [0, 2, 3, 3] and all(0 <= e["val_success"] <= 1 for e in ev)
    assert ev[2]["val_won"] == ev[3]["val_won"] and ev[2]["val_mean_steps"] == ev[3]["val_mean_steps"]
    assert all(sum(e["val_verbs"].values()) == pytest.approx(1) for e in ev) and ev[2]["val_verbs"] == ev[3]["val_verbs"]
    with open(os.path.join(tmp_path, "eval.jsonl")) as f:
        assert [json.loads(line)["val_seed"] for line in f] == [200000] * 4
    # per-seed wins, and the snapshot is compared task by task with the base pass before it
    assert all(len(e["val_won"]) == e["val_tasks"] and sum(e["val_won"]) / e["val_tasks"] == e["val_success"]
               for e in ev)
    diff = [b - a for a, b in zip(ev[0]["val_won"], ev[1]["val_won"])]
    assert "vs_base" not in ev[0] and (ev[1]["vs_base"]["gained"], ev[1]["vs_base"]["lost"]) == (diff.count(1),
                                                                                                 diff.count(-1))
    assert [r["update"] for r in rows(tmp_path)] == [1, 2, 3]  # evaluating trains nothing


def test_train_seeds_fix_the_tasks_of_every_update(small_base, tmp_path):
    G.main(quick(small_base, tmp_path, "--env", "webshop", "--train_seeds", "7,11", "--rollouts_every", "1",
                 "--val_every", "0"))
    for u in (1, 2):
        with open(os.path.join(tmp_path, "rollouts", f"update{u:05d}-rank0.jsonl")) as f:
            assert sorted({json.loads(line)["seed"] for line in f}) == [7, 11]


@pytest.mark.parametrize("argv,msg", [
    (["03_grpo.py", "--env", "minecraft"], "unknown env 'minecraft'"),
    (["05_seal.py", "--algo", "ppo"], "unknown algo 'ppo'"),
    (["03_grpo.py", "--model", "/no/such/checkpoint"], "cannot load model '/no/such/checkpoint'"),
    (["03_grpo.py", "--model", "tiny-nope"], "no base 'tiny-nope' in"),
    (["04_gigpo.py", "--group_size", "1"], "--group_size must be >= 2"),
    (["03_grpo.py", "--lr", "fast"], "invalid float value"),
    (["03_grpo.py", "--merge_lora", "flase"], "expected true or false, got 'flase'"),
    (["03_grpo.py", "--eval_ckpt", "/no/such/state.pt"], "no checkpoint file '/no/such/state.pt'"),
    (["03_grpo.py", "--val_seed", "7"], "--val_seed 7 lies in the train pool"),
    (["03_grpo.py", "--train_seeds", "3,x"], "--train_seeds must be comma-separated integers"),
    (["03_grpo.py", "--adv_level", "token"], "--adv_level must be row or traj"),
    (["04_gigpo.py", "--gigpo_mode", "std"], "--gigpo_mode must be mean_norm or mean_std_norm"),
    (["05_seal.py", "--algo", "gigpo", "--adv_level", "traj"], "--adv_level traj is a GRPO option"),
    (["05_seal.py", "--algo", "empg", "--empg_base", "ppo"], "--empg_base must be one of"),
    (["03_grpo.py", "--report_to", "mlflow"], "--report_to must be tensorboard, wandb or none"),
])
def test_bad_input_is_one_line(argv, msg):
    p = subprocess.run([sys.executable, *argv, "--updates", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and msg in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("script", ["01_formats", "02_rollouts", "03_grpo", "04_gigpo", "05_seal", "06_analysis",
                                    "base/build"])
def test_help(script):
    p = subprocess.run([sys.executable, f"{script}.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "usage:" in p.stdout and p.stdout.count("--") > 3


def test_sigkill_then_resume_equals_an_uninterrupted_run(small_base, tmp_path):
    """A real SIGKILL mid-run, then the same command: every update is logged once, and the result is the
    uninterrupted run's (same seeds, same parameters), because a checkpoint is written every update."""
    import signal
    import time
    import torch

    def cmd(out):
        return [sys.executable, "03_grpo.py", *quick(small_base, out, "--env", "webshop", "--updates", "4",
                                                      "--val_every", "0", "--rollouts_every", "1")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd(tmp_path / "whole"), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    killed = tmp_path / "killed"
    p = subprocess.Popen(cmd(killed), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(killed / "metrics.jsonl") and len(rows(killed)) >= 2):
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL and 2 <= len(rows(killed)) < 4
    subprocess.run(cmd(killed), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    a, b = rows(tmp_path / "whole"), rows(killed)
    assert [r["update"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if "seconds" not in k} == {k: v for k, v in y.items() if "seconds" not in k}
    assert sorted(os.listdir(killed / "rollouts")) == sorted(os.listdir(tmp_path / "whole" / "rollouts"))
    pa, pb = (torch.load(d / "ckpt" / "state.pt", weights_only=False)["params"] for d in (tmp_path / "whole", killed))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_persistent_nan_stops_in_one_line_and_the_checkpoint_resumes(small_base, tmp_path, capsys):
    """NaN advantages from update 2 on: its optimizer steps are skipped, the run stops naming the update, ckpt/ keeps
    update 1 and metrics.jsonl stays valid JSON; the same command then resumes from update 1."""
    calls = []

    def poisoned(trajs, args):
        G.grpo_advantages(trajs, args)
        calls.append(1)
        for t in trajs if len(calls) >= 2 else []:
            for s in t["steps"]:
                s["adv"] = float("nan")
        return trajs
    argv = quick(small_base, tmp_path, "--env", "webshop", "--updates", "3", "--max_skipped_steps", "2",
                 "--val_every", "0")
    with pytest.raises(SystemExit) as e:
        G.train(G.check_args(F.parse_args(G.Args, argv)), poisoned)
    msg = str(e.value)
    assert msg.startswith("error: update 2: 2 optimizer steps in a row") and "holds update 1" in msg
    assert "\n" not in msg
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        logged = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for line in f]
    assert [r["update"] for r in logged] == [1] and logged[0]["skipped_steps"] == 0
    import torch
    policy = R.Policy(F.add_lora(F.load_base(small_base)[0]))
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    assert G.load_ckpt(policy, opt, os.path.join(tmp_path, "ckpt")) == 1  # the last good update, intact
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    G.main(argv)  # the same command, unpoisoned: resumes at update 2
    assert [r["update"] for r in rows(tmp_path)] == [1, 2, 3]
    assert "resuming" in capsys.readouterr().out


def test_analysis_reads_a_run_with_skipped_steps(tmp_path):
    """null where a metric could not be measured (every step of update 2 skipped), as metrics.jsonl writes it."""
    A = load("06_analysis")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for u in range(1, 13):
            row = {"update": u, "entropy": 0.3 + 0.01 * (u % 3), "success": 0.5, "valid_ratio": 0.9, "kl": 0.01,
                   "loss": 0.1, "grad_norm": 1.0, "skipped_steps": 2 if u == 2 else 0, "logp_correct": None}
            if u == 2:
                row.update(loss=None, kl=None, grad_norm=None)
            f.write(G.json_line(row))
    res = A.analyse_logs(A.Args(runs=str(tmp_path), out_dir=str(tmp_path / "analysis"), lemmas=False))
    assert os.path.exists(os.path.join(tmp_path, "analysis", "summary.md")) and res["summary"]


def test_trim_logs_cuts_back_to_the_checkpoint(tmp_path):
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "ckpt").mkdir()
    for u in (1, 2, 3):
        (tmp_path / "rollouts" / f"update{u:05d}-rank0.jsonl").write_text("{}\n")
        (tmp_path / "ckpt" / f"state-u{u:05d}.pt").write_text("")
    (tmp_path / "ckpt" / "state.pt").write_text("")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"update": u}) + "\n" for u in (1, 2, 3)) + '{"upd')
    G.trim_logs(str(tmp_path), 2)
    assert [r["update"] for r in rows(tmp_path)] == [1, 2]
    assert sorted(os.listdir(tmp_path / "rollouts")) == ["update00001-rank0.jsonl", "update00002-rank0.jsonl"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["state-u00001.pt", "state-u00002.pt", "state.pt"]


def test_flat_groups_counts_groups_whose_returns_are_all_equal():
    def traj(group, rewards):
        return {"group": group, "steps": [{"reward": r} for r in rewards]}
    trajs = [traj(0, [0, 10]), traj(0, [10]),          # same return 10 over different lengths: flat
             traj(1, [0, 0]), traj(1, [0, 10]),          # 0 vs 10: carries signal
             traj(2, [0]), traj(2, [0, 0, 0])]           # all fail: flat
    assert R.flat_groups(trajs) == pytest.approx(2 / 3)
    assert R.flat_groups(trajs[2:4]) == 0.0


@pytest.mark.parametrize("env", ["alfworld", "webshop"])
def test_real_data_end_to_end(small_base, tmp_path, env):
    """Trainer, validation on the held-out split, --eval_ckpt, rollouts and 06's tables on the real-format fixtures."""
    import real_data
    data = (real_data.write_alfworld if env == "alfworld" else real_data.write_webshop)(str(tmp_path / "data"))
    out = tmp_path / "run"
    try:
        S.main(quick(small_base, out, "--env", env, "--data", data, "--rollouts_every", "1"))
        assert len(rows(out)) == 2 and json.load(open(out / "args.json"))["data"] == data
        held_out = F.EVAL_SPLIT[env]
        G.main(quick(small_base, out, "--env", env, "--data", data, "--eval_ckpt", str(out / "ckpt")))
        ev = G.read_jsonl(str(out / "eval.jsonl"))[-1]
        assert ev["split"] == held_out and len(ev["val_won"]) == 2
        summary = open(out / "analysis" / "summary.md").read()
        if env == "alfworld":
            assert set(ev["val_by_type"]) == {"pick_and_place_simple"}  # the one valid_seen game
            assert "success per task type over the saved episodes" in summary
        else:
            assert "WebShop outcomes of the" in summary
        m = R.main(["--model", small_base, "--env", env, "--data", data, "--split", held_out, "--tasks", "1",
                    "--group_size", "2", "--max_steps", "2", "--max_new_tokens", "16", "--out", str(tmp_path / "r")])
        assert m["episodes"] == 2
    finally:
        F.use_data(env)  # back to the synthetic env for the tests after this one
    with pytest.raises(SystemExit, match=r"error: .*no folder .*nowhere"):
        G.main(quick(small_base, out, "--env", env, "--data", str(tmp_path / "nowhere")))
    F.use_data(env)


def test_rollout_only_control_plays_what_an_lr0_run_plays(small_base, tmp_path):
    """--rollout_only skips the reference pass and the update; its rollouts are the lr-0 run's, update by update
    (same tasks, same samples), and its adapter stays the initial one."""
    import torch
    runs = {}
    for name, extra in (("lr0", []), ("only", ["--rollout_only", "true"]), ("lr", ["--lr", "0.05"])):
        lr = [] if name == "lr" else ["--lr", "0"]
        G.main(quick(small_base, tmp_path / name, "--env", "alfworld", "--updates", "3", "--val_every", "0",
                     "--analyse", "false", "--report_to", "none", "--temperature", "1.5", *lr, *extra))
        runs[name] = rows(tmp_path / name)
    played = lambda r: {k: r[k] for k in ("success", "entropy", "valid_ratio", "response_tokens", "mean_steps")}
    assert [played(r) for r in runs["only"]] == [played(r) for r in runs["lr0"]]
    assert [played(r) for r in runs["lr"]][1:] != [played(r) for r in runs["lr0"]][1:]  # the check can fail
    assert "kl" in runs["lr0"][0] and "kl" not in runs["only"][0]
    state = torch.load(tmp_path / "only" / "ckpt" / "state.pt", weights_only=False)["params"]
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert lora_b and all(not v.any() for v in lora_b)  # PEFT starts B at 0; nothing moved it


@pytest.mark.parametrize("env", ["alfworld", "webshop"])
def test_single_turn_run_plays_one_decision_per_episode(small_base, tmp_path, env):
    G.main(quick(small_base, tmp_path, "--env", env, "--single_turn", "--val_every", "0", "--analyse", "false",
                 "--report_to", "none", "--max_steps", "0"))
    assert [r["mean_steps"] for r in rows(tmp_path)] == [1.0, 1.0]
    with pytest.raises(SystemExit, match="synthetic envs only"):
        G.main(quick(small_base, tmp_path / "real", "--env", env, "--single_turn", "--data", str(tmp_path)))
    F.use_data(env)  # the multi-turn env again for the tests after this one
