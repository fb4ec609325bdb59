"""06_analysis.py log mode: phase labels, separation score, plots + summary from synthetic logs, interference."""
import json
import math
import os
import random
import statistics
import subprocess
import sys

import pytest
import torch

from conftest import load, ROOT
from helpers.plots import pca2

F, R, A = load("01_formats"), load("02_rollouts"), load("06_analysis")
sys.path.insert(0, os.path.join(ROOT, "tests"))
import dp_update  # noqa: E402


def base_curve(n=100, noise=0.02, seed=0):
    rng = random.Random(seed)
    return [2 * math.exp(-t / 30) + 0.5 + rng.gauss(0, noise) for t in range(n)]


def bump(n, at, height=1.0, width=4.0):
    return [height * math.exp(-((t - at) / width) ** 2) for t in range(n)]


def two_bumps(n=100):
    return [b + x + y for b, x, y in zip(base_curve(n), bump(n, 30), bump(n, 70))]


# --------------------------------------------------------------------------------------------- phase labels
def test_descending_curve_has_no_eruption():
    r = A.label_phases(base_curve())
    assert r["intervals"] == [] and set(r["labels"]) == {"descent"}
    assert A.label_phases([1.0] * 20)["intervals"] == []  # flat: range 0, nothing to find


def test_two_bumps_give_two_eruptions_in_place():
    r = A.label_phases(two_bumps())
    assert len(r["intervals"]) == 2, r["intervals"]
    for (a, p, e), at in zip(r["intervals"], (30, 70)):
        assert abs(p - at) <= 2 and a < p < e and at - 15 < a and e < at + 15
        assert r["labels"][p] == "eruption" and r["labels"][a] == "eruption" and r["labels"][p + 1] == "subsidence"
        assert r["labels"][a - 1] == "descent" and r["labels"][e] == "subsidence"
        s = r["smoothed"]
        assert s[e] <= s[a] < s[e - 1]  # subsidence ends on the first update back at the level it rose from
    assert r["labels"][0] == "descent" and r["labels"][50] == "descent" and r["labels"][-1] == "descent"


def test_a_dip_smaller_than_the_threshold_does_not_end_the_eruption():
    up = [1.5 + 0.1 * t for t in range(11)]                       # updates 20..30 rise to 2.5
    curve = ([3 - 0.075 * t for t in range(20)] + up + [2.35, 2.35] + [2.4, 2.5, 2.6]   # dip, then up to the peak
             + [2.6 - 0.15 * t for t in range(1, 11)] + [1.1 - 0.005 * t for t in range(30)])
    r = A.label_phases(curve, window=1)
    assert [p for _, p, _ in r["intervals"]] == [35], r["intervals"]
    assert r["labels"][31] == "eruption" and r["labels"][36] == "subsidence"


def test_threshold_controls_detection():
    curve = [b + x for b, x in zip(base_curve(), bump(100, 50, height=0.8))]
    assert len(A.label_phases(curve)["intervals"]) == 1
    assert A.label_phases(curve, rise=0.6)["intervals"] == []  # a rise smaller than the threshold is no eruption
    assert len(A.label_phases(curve, rise_abs=0.1)["intervals"]) == 1
    # a rise still going at the end is an open eruption that ends at the last update
    (a, p, e), = A.label_phases([3 - 0.02 * t for t in range(50)] + [2 + 0.05 * t for t in range(20)])["intervals"]
    assert p == e == 69 and 45 <= a <= 52


def test_eruption_during_subsidence_starts_at_its_trough():
    lin = lambda a, b, n: [a + (b - a) * i / n for i in range(n)]  # noqa: E731  n points from a towards b
    curve = lin(3.0, 2.0, 10) + lin(2.0, 3.0, 10) + lin(3.0, 2.4, 6) + lin(2.4, 3.5, 10) + lin(3.5, 1.0, 25)
    r = A.label_phases(curve, window=1)  # never back down to 2.0 between the two rises
    (a1, p1, e1), (a2, p2, e2) = r["intervals"]
    assert (a1, p1, a2, p2) == (10, 20, 26, 36) and e1 == a2 - 1
    assert r["labels"][25] == "subsidence" and r["labels"][26] == "eruption"


def test_smooth_keeps_the_peak():
    x = bump(41, 20)
    s = A.smooth(x, 5)
    assert len(s) == 41 and max(range(41), key=s.__getitem__) == 20 and s[20] < x[20]
    assert A.smooth([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]


def test_eruption_sweep_counts_over_thresholds_and_whether_they_subside():
    """C1 over thresholds: a control of pure noise sets the scale; one clear bump on that noise is one eruption that
    subsides and comes back at every k, the noise alone has none at large k, and a rise that never comes down is
    counted but not as subsided."""
    rng = random.Random(0)
    noise = [0.05 + rng.gauss(0, 0.002) for _ in range(80)]
    bumped = [x + y for x, y in zip(noise, bump(80, 40, height=0.1, width=5.0))]
    sweep = A.eruption_sweep(bumped, 5, control_entropy=noise)
    assert set(sweep) == {"control", "own"} and list(sweep["control"]) == [2, 3, 4, 6]
    for k in (4, 6):
        assert (sweep["control"][k]["eruptions"], sweep["control"][k]["subsided"], sweep["control"][k]["returned"]) \
            == (1, 1, 1)
    assert A.eruption_sweep(noise, 5, control_entropy=noise)["control"][6]["eruptions"] == 0
    rise = [x + 0.1 / (1 + math.exp(-(t - 60) / 2)) for t, x in enumerate(noise)]  # up at 60 and stays up
    r = A.eruption_sweep(rise, 5, control_entropy=noise)["control"][6]
    assert r["eruptions"] == 1 and r["subsided"] == 0 and r["returned"] == 0
    assert "control" not in A.eruption_sweep(bumped, 5)  # no control: the run's own noise only


# --------------------------------------------------------------------------------------------- separation
def clusters(gap, n=40, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    won = [i % 2 == 0 for i in range(n)]
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    X[torch.tensor(won), 0] += gap
    return X, won


def test_fisher_ratio_separated_beats_overlapping():
    far, near = A.fisher_ratio(*clusters(6.0)), A.fisher_ratio(*clusters(0.0))
    assert far > 1.0 and near < 0.1 and far > 20 * near
    X, won = clusters(6.0)
    assert A.fisher_ratio(X * 10, won) == pytest.approx(far)  # scale-free
    assert math.isnan(A.fisher_ratio(X[:3], [True, False, False]))  # one correct trajectory: undefined


def test_fisher_null_tells_separation_from_small_class_chance():
    """C2's null: separated clusters beat every shuffle; random rows do not; with 14 vs 2 random rows the ratio is
    large by chance, and the null's median shows it (the reason a ratio alone says nothing about overlap)."""
    sep = A.fisher_null(*clusters(6.0), perms=100)
    assert sep["p"] == pytest.approx(1 / 101) and sep["ratio"] > 10 * sep["null_q95"]
    assert (sep["n_correct"], sep["n_wrong"]) == (20, 20)
    noise = [A.fisher_null(*clusters(0.0, seed=k), perms=100, seed=k)["p"] for k in range(20)]
    assert 0.2 < sum(noise) / len(noise) < 0.8  # p roughly uniform when the labels carry nothing
    g = torch.Generator().manual_seed(1)
    X = torch.randn(16, 8, generator=g, dtype=torch.float64)
    few = A.fisher_null(X, [True] * 2 + [False] * 14, perms=100)
    even = A.fisher_null(X, [True, False] * 8, perms=100)
    assert few["null_median"] > 2 * even["null_median"] and few["p"] > 0.05
    assert A.fisher_null(X[:3], [True, False, False]) is None


def test_pca2_finds_the_spread_direction():
    X, _ = clusters(10.0)
    Z = pca2(X)
    assert Z.shape == (40, 2) and Z[:, 0].var() > 5 * Z[:, 1].var()


# --------------------------------------------------------------------------------------------- plots + summary
def write_run(folder, entropy, sep_gap, seed, prompt=False):
    """A fake run: metrics.jsonl (entropy given, degenerate rates up inside bumps) and rollouts every 10 updates."""
    os.makedirs(os.path.join(folder, "rollouts"))
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for u, h in enumerate(entropy, 1):
            m = {"update": u, "entropy": h, "valid_ratio": min(1, 0.5 + u / 200), "success": u / 200,
                 "reward": u / 20, "duplication": 0.1 * h, "hallucination": 0.05 * h,
                 "logp_correct": -1 / h, "logp_wrong": -2 / h, "logp_valid": -1.5 / h if u > 1 else float("nan")}
            if u % 10 == 0 or u == 1:
                m["val_success"] = u / 150
            f.write(json.dumps(m) + "\n")
    for u in range(10, len(entropy) + 1, 10):
        with open(os.path.join(folder, "rollouts", f"update{u:05d}-rank0.jsonl"), "w") as f:
            for i in range(12):
                won = i % 3 == 0
                steps = []
                for k in range(2):
                    h = torch.randn(8, generator=g) + (sep_gap * u / 100 if won else 0)
                    s = {"response": "<think>x</think><action>look</action>", "valid": True, "reward": 0.0,
                         "obs": "o", "old_logp": [-1.0], "entropy": [1.0], "hidden_mean": h.tolist(),
                         "adv": (1.0 if won else -0.5) + 0.01 * i}
                    if prompt:
                        s.update(prompt=f"go to the kitchen {i} {k}", response_ids=[rng.randrange(3, 200)
                                                                                     for _ in range(3 + k)])
                    steps.append(s)
                f.write(json.dumps({"seed": i, "group": i // 4, "won": won, "steps": json.dumps(steps)}) + "\n")


def test_plots_and_summary_from_synthetic_logs(tmp_path):
    erupt, calm = str(tmp_path / "grpo-webshop-s0"), str(tmp_path / "grpo+seal-webshop-s0")
    write_run(erupt, two_bumps(), sep_gap=0.5, seed=0)
    write_run(calm, base_curve(seed=1), sep_gap=4.0, seed=1)
    out = tmp_path / "analysis"
    rep = A.main(["--runs", f"{erupt},{calm}", "--out_dir", str(out), "--interference"])
    assert "tiny_random" not in rep  # --runs alone: no lemma checks
    n_erupt = len(A.label_phases(two_bumps())["intervals"])
    assert n_erupt == 2
    for name in ("entropy", "success", "logp", "degenerate", "separation",
                 "hidden-grpo-webshop-s0", "hidden-grpo_seal-webshop-s0"):
        p = out / f"{name}.png"
        assert p.exists() and p.stat().st_size > 1000, name
    text = (out / "summary.md").read_text()
    st = rep["logs"]["stats"]
    assert len(st["grpo-webshop-s0"]["eruptions"]) == n_erupt and st["grpo+seal-webshop-s0"]["eruptions"] == []
    assert f"eruptions: {n_erupt} " in text and "eruptions: 0 " in text and "(entropy.png)" in text
    a, p, e = st["grpo-webshop-s0"]["eruptions"][0]  # update numbers = index + 1
    assert f"{a} -> {p} -> {e}" in text and abs(p - 31) <= 2
    assert "not computed: no checkpoint" in text  # --interference without a checkpoint: said, not invented
    # the degenerate rates were made to follow entropy: higher inside the eruptions
    dup_in, dup_out = st["grpo-webshop-s0"]["inside_outside"]["duplication"]
    assert dup_in > dup_out
    assert f"{dup_in:.3f} / {dup_out:.3f}" in text
    # separation first -> last from the rollouts (the gap grows with the update)
    (u0, s0), (u1, s1) = st["grpo+seal-webshop-s0"]["separation_first_last"]
    assert (u0, u1) == (10, 100) and s1 > s0
    assert f"update 10: {s0:.3f} -> update 100: {s1:.3f}" in text
    per = st["grpo-webshop-s0"]["per_phase"]
    assert per["eruption"]["entropy"] > per["descent"]["entropy"] - 1  # finite numbers for every phase
    assert sum(v["updates"] for v in per.values()) == 100
    saved = json.loads((out / "analysis.json").read_text())
    assert saved["stats"]["grpo-webshop-s0"]["updates"] == 100


def test_missing_run_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "06_analysis.py", "--runs", str(tmp_path / "nope")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "no metrics.jsonl" in p.stderr and "Traceback" not in p.stderr


# --------------------------------------------------------------------------------------------- interference
def test_interference_matches_lemma_3_3():
    policy = dp_update.build()
    samples = dp_update.batch(policy)
    r = A.interference(policy, dp_update.Tok, samples)
    G = len(samples)
    assert r["A"].shape == r["c"].shape == (G,) and torch.isfinite(r["c"]).all() and torch.isfinite(r["gram"]).all()
    assert torch.allclose(r["c"], r["gram"].mean(0)) and (r["gram"].diagonal() > 0).all()
    # (1/G) sum_j A_j c_j = <grad mean_i l_i, grad (1/G) sum_j A_j l_j>, by two independent backward passes
    params = [p for p in policy.lm.parameters() if p.requires_grad]
    b = F.pack(dp_update.Tok, samples)
    logp, _, _ = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
    l = (logp * b["mask"]).sum(1)
    g_mean = torch.autograd.grad(l.mean(), params, retain_graph=True)
    g_obj = torch.autograd.grad((r["A"].to(l.dtype) * l).mean(), params)
    dot = sum((x * y).sum() for x, y in zip(g_mean, g_obj)).item()
    assert A.predicted_drift(r["gram"], r["A"], 1.0).item() == pytest.approx(dot, rel=1e-6)
    assert (r["A"] * r["c"]).mean().item() == pytest.approx(dot, rel=1e-6)
    # and the step itself: theta += eta * grad of the objective changes mean l by ~ predicted_drift (first order)
    pred = A.predicted_drift(r["gram"], r["A"], 1.0).item()
    eta = 1e-3 / abs(pred)
    with torch.no_grad():
        for p, gp in zip(params, g_obj):
            p.add_(eta * gp)
        logp1, _, _ = policy(b["input_ids"], b["attention_mask"], b["gather_index"], b["targets"])
    actual = ((logp1 * b["mask"]).sum(1) - l.detach()).mean().item()
    assert actual == pytest.approx(eta * pred, rel=0.05)


def run_on_a_saved_base(tmp_path):
    """A saved tiny random base (LoRA rank 4 in args.json) and a run on it with rollouts: (run, lm, tok)."""
    base = str(tmp_path / "base")
    tok = F.train_tokenizer(["go to the kitchen 0 1 <think> look </think><action> look </action>"] * 10, 300)
    lm = F.tiny_model(len(tok), seed=0)
    lm.save_pretrained(base)
    tok.save_pretrained(base)
    run = str(tmp_path / "grpo-alfworld-s0")
    write_run(run, two_bumps(), sep_gap=1.0, seed=0, prompt=True)
    with open(os.path.join(run, "args.json"), "w") as f:
        json.dump({"model": base, "lora_r": 4}, f)
    return run, lm, tok


def save_snapshot(run, policy, name):
    """policy's trainable parameters as 03's checkpoint file run/ckpt/<name>, saved at update 50."""
    os.makedirs(os.path.join(run, "ckpt"))
    torch.save({"update": 50, "params": {k: v.detach() for k, v in policy.named_parameters() if v.requires_grad}},
               os.path.join(run, "ckpt", name))


def test_interference_mode_on_a_run(tmp_path):
    """A saved tiny base + a checkpoint + rollouts: c_j vs A_j plot, and the summary says one side is missing."""
    run, lm, tok = run_on_a_saved_base(tmp_path)
    torch.manual_seed(0)
    policy = dp_update.move_adapter(R.Policy(F.add_lora(lm, r=4)))
    save_snapshot(run, policy, "state.pt")
    out = tmp_path / "analysis"
    rep = A.main(["--runs", run, "--out_dir", str(out), "--interference", "--interference_samples", "8"])
    res = rep["logs"]["stats"]["grpo-alfworld-s0"]["interference"]
    (pt,) = res["points"]
    assert pt["update"] == 50 and pt["rollout_update"] == 50 and len(pt["A"]) == len(pt["c"]) == 8
    assert all(math.isfinite(c) for c in pt["c"]) and pt["where"] == "after eruption 1, before 2"
    assert not res["both_sides"]
    p = out / "interference-grpo-alfworld-s0.png"
    assert p.exists() and p.stat().st_size > 1000
    text = (out / "summary.md").read_text()
    assert "no checkpoints on both sides of an eruption" in text and "(interference-grpo-alfworld-s0.png)" in text


def test_webshop_outcomes_replays_saved_episodes():
    env = F.make_env("webshop")
    _, info = env.reset(7)
    expert, done = [], False
    while not done:  # the expert's own episode: a win
        expert.append({"action": info["expert_action"], "valid": True})
        _, _, done, info = env.step(info["expert_action"])
    env.reset(7)
    query = expert[0]["action"]
    env.step(query)
    first = next(a for a in env._admissible() if a.startswith("click[") and "search" not in a and "next" not in a)
    browse = [{"action": query, "valid": True}, {"action": first, "valid": True},
              {"action": "click[< prev]", "valid": True}, {"action": None, "valid": False}]
    rollouts = {1: [{"seed": 7, "steps": expert}, {"seed": 7, "steps": browse}]}
    r = A.webshop_outcomes(rollouts)
    assert r["episodes"] == 2 and r["outcomes"] == {"won": 1, "no purchase": 1}
    assert r["back_rate"] == pytest.approx(1 / (len(expert) + len(browse)))


def test_control_run_sets_the_noise_floor(tmp_path):
    """--control: the threshold is k x the control's update-to-update sd x sqrt(2/w); with it, a run that is noise
    of the same size shows no eruption while the same noise plus two bumps shows both (the relative default rule
    labels eruptions in the noise run too)."""
    rng = random.Random(5)
    noise = lambda: [0.05 + rng.gauss(0, 0.01) for _ in range(150)]  # noqa: E731
    control, flat, bumpy = (str(tmp_path / n) for n in ("lr0-webshop-s0", "flat", "bumpy"))
    c = noise()
    write_run(control, c, sep_gap=1.0, seed=0)
    write_run(flat, noise(), sep_gap=1.0, seed=1)
    write_run(bumpy, [x + y + z for x, y, z in zip(noise(), bump(150, 40, 0.08, 6), bump(150, 110, 0.08, 6))],
              sep_gap=1.0, seed=2)
    d = [b - a for a, b in zip(c, c[1:])]
    md = sum(d) / len(d)
    sd = (sum((x - md) ** 2 for x in d) / (len(d) - 1)) ** 0.5 / 2 ** 0.5
    rep = A.main(["--runs", f"{flat},{bumpy}", "--control", control, "--out_dir", str(tmp_path / "a")])
    noise_info, st = rep["logs"]["noise"], rep["logs"]["stats"]
    assert math.isclose(noise_info["threshold"], 4 * sd * math.sqrt(2 / 5), rel_tol=1e-12)
    assert 0.008 < noise_info["sd"] < 0.012  # the sd the noise was drawn with
    assert st["flat"]["eruptions"] == []
    assert [abs(p - at) <= 6 for (_, p, _), at in zip(st["bumpy"]["eruptions"], (40, 110))] == [True, True]
    assert "no-learning control" in (tmp_path / "a" / "summary.md").read_text()
    assert len(A.label_phases(series_of(flat))["intervals"]) > 0  # the relative rule finds 'eruptions' in noise


def series_of(run):
    return [r["entropy"] for r in A.load_metrics(run)]


def test_entropy_area_sums_the_rise_above_the_running_minimum():
    assert A.entropy_area([0.1, 0.05, 0.2, 0.1]) == pytest.approx(0.15 + 0.05)
    assert A.entropy_area([0.3, 0.2, 0.1]) == 0.0  # a pure descent has no area


def test_results_regenerates_a_committed_experiment(tmp_path):
    """One command rebuilds an experiment's figures and table from the logs committed under results/."""
    folder = os.path.join(ROOT, "results", "sweep")
    report = A.main(["--results", folder, "--out_dir", str(tmp_path)])
    logs = report["logs"]
    assert logs["noise"]["run"].endswith("alfworld-lr0-s0")  # the ALFWorld lr-0 run, not the 2-update WebShop one
    trained = sorted(d for d in os.listdir(folder) if "grpo" in d)
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {d} |" in table for d in trained)
    for row in logs["rows"]:  # eruption counts by the control's threshold, recomputed from metrics.jsonl here
        ent = [json.loads(line)["entropy"] for line in open(os.path.join(folder, row["run"], "metrics.jsonl"))]
        assert row["eruptions"] == len(A.label_phases(ent, 5, rise_abs=logs["noise"]["threshold"])["intervals"])
    assert {"entropy.png", "entropy-grid.png", "success.png", "summary.md", "table.md"} <= set(os.listdir(tmp_path))


def test_results_table_keeps_an_alpha_sweep_apart_and_pairs_it_with_the_run_without_seal(tmp_path):
    """SEAL at another alpha is its own row of the per-algorithm table, and its paired test is against the run
    without SEAL on the same seed (not against the alpha-0.02 runs), on the largest task set both were scored on."""
    won = {"grpo": [1, 0, 0, 0, 1, 0], "grpo+seal": [1, 1, 1, 1, 1, 0], "grpo+seal alpha 0.1": [0, 0, 0, 0, 1, 0]}
    ev = lambda w: json.dumps({"ckpt": "x", "val_won": w, "val_success": sum(w) / len(w), "val_seed": 7,  # noqa: E731
                               "val_tasks": len(w)}) + "\n"
    infos = []
    for name, algo, alpha in (("g", "grpo", 0), ("s", "grpo", 0.02), ("a", "grpo", 0.1)):
        run = tmp_path / name
        run.mkdir()
        (run / "args.json").write_text(json.dumps({"algo": algo, "alpha": alpha, "lr": 2e-3, "seed": 0}))
        (run / "eval.jsonl").write_text(ev(won[A.label(str(run))]))
        infos.append({"run": str(run), "name": name, "rows": [{"update": 1, "success": 0.5}], "eruptions": [],
                      "phases": {"smoothed": [0.1]}, "updates": [1]})
    assert [A.label(i["run"]) for i in infos] == ["grpo", "grpo+seal", "grpo+seal alpha 0.1"]
    table = open(A.results_table(infos, str(tmp_path / "table.md"))[0]).read()
    assert ("| grpo+seal | 1 | 0.000 | 0.000 | 0.833 +- n/a (6) | 1 / 0 of 1 (p=1), +0.500 +- n/a | 3 / 0, p=0.25 "
            "(6 tasks) |") in table
    assert ("| grpo+seal alpha 0.1 | 1 | 0.000 | 0.000 | 0.167 +- n/a (6) | 0 / 1 of 1 (p=1), -0.167 +- n/a | "
            "0 / 1, p=1 (6 tasks) |") in table
    with open(tmp_path / "s" / "eval.jsonl", "a") as f:
        f.write(ev([1] * 8 + [0] * 4))  # a larger pass is the run's score; the partner has none, so no pair on it
        f.write(ev([1] * 6))  # a later pass on the shared 6 tasks replaces the first one in the pair
    table = open(A.results_table(infos, str(tmp_path / "table.md"))[0]).read()
    assert "| s | grpo+seal | 0 | 0 | 0.000 | 0.000 | 0.500 / 0.500 | 0.667 (12) |" in table
    assert ("| grpo+seal | 1 | 0.000 | 0.000 | 0.667 +- n/a (12) | 1 / 0 of 1 (p=1), +0.667 +- n/a | "
            "4 / 0, p=0.125 (6 tasks) |") in table
    with open(tmp_path / "g" / "eval.jsonl", "a") as f:  # another seed set of the same size is not the same tasks
        f.write(json.dumps({"ckpt": "x", "val_won": [0] * 12, "val_success": 0.0, "val_seed": 8, "val_tasks": 12}) + "\n")
    assert "4 / 0, p=0.125 (6 tasks)" in open(A.results_table(infos, str(tmp_path / "table.md"))[0]).read()


def test_results_table_tests_seal_over_training_seeds_and_by_task_type(tmp_path):
    """The training seed is the unit: one held-out difference per seed, a sign test over seeds; the pooled test over
    seeds x tasks is secondary. ALFWorld passes also give success per task type, mean +- sd over seeds."""
    infos = []
    for seed, (plain, seal) in enumerate(((2, 4), (3, 5), (4, 3), (1, 6))):  # wins of 8 tasks: SEAL ahead in 3 of 4
        for name, alpha, wins in (("g", 0, plain), ("s", 0.02, seal)):
            run = tmp_path / f"{name}{seed}"
            run.mkdir()
            (run / "args.json").write_text(json.dumps({"algo": "grpo", "alpha": alpha, "lr": 1e-3, "seed": seed}))
            won = [1] * wins + [0] * (8 - wins)
            by_type = {"pick_and_place_simple": [won[:4].count(1), 4], "pick_two_obj_and_place": [won[4:].count(1), 4]}
            (run / "eval.jsonl").write_text(json.dumps({"ckpt": "x", "val_won": won, "val_success": wins / 8,
                                                        "val_seed": 7, "val_tasks": 8, "val_by_type": by_type}) + "\n")
            infos.append({"run": str(run), "name": run.name, "rows": [{"update": 1, "success": 0.5}], "eruptions": [],
                          "phases": {"smoothed": [0.1]}, "updates": [1]})
    table = open(A.results_table(infos, str(tmp_path / "table.md"))[0]).read()
    diffs = [2 / 8, 2 / 8, -1 / 8, 5 / 8]
    sd = statistics.stdev(diffs)
    assert f"| 3 / 1 of 4 (p=0.625), +{statistics.mean(diffs):.3f} +- {sd:.3f} |" in table
    assert "| algorithm | pick and place simple | pick two obj and place |" in table
    plain = [min(w, 4) / 4 for w in (2, 3, 4, 1)]
    assert f"| grpo | {statistics.mean(plain):.3f} +- {statistics.stdev(plain):.3f} |" in table


def test_snapshot_tallies_count_c4_intervals_and_c3_verdicts_per_run():
    """C4 intervals are classed by the entropy change against the threshold (the base point, with no entropy, is left
    out); C3 compares the mean sum before / rising with the mean while subsiding / after, where "after k, before k+1"
    counts as before; snapshots whose steps carry no advantage are not counted as negative or positive."""
    def pt(u, e, v):
        return {"update": u, "entropy_smoothed": e, "logp_valid": v, "logp_correct": v, "logp_wrong": -v}

    def ip(w, A, c):
        return {"where": w, "A": A, "c": c, "sum_Ac_over_G": sum(a * x for a, x in zip(A, c)) / len(A)}

    rescore = {"points": [pt(0, None, -9.0), pt(10, 0.02, -0.5), pt(20, 0.30, -0.6), pt(30, 0.31, -0.4),
                          pt(40, 0.05, -0.3)]}
    interf = {"points": [ip("after eruption 1, before 2", [-1.0, 1.0], [5.0, 1.0]),
                         ip("rising part of eruption 2", [0.0, 0.0], [3.0, 3.0]),
                         ip("subsidence of eruption 2", [-1.0, 1.0], [1.0, 2.0])]}
    t = A.snapshot_tallies({"r": {"rescore": rescore, "interference": interf}, "s": {}}, threshold=0.05)
    assert t["c4"]["rose"]["logp_valid"] == [1, 0]  # 10 -> 20: entropy +0.28, valid fell
    assert t["c4"]["within the threshold"]["logp_valid"] == [0, 1]  # 20 -> 30
    assert t["c4"]["fell"]["logp_wrong"] == [1, 0]  # 30 -> 40: entropy -0.26, wrong (= -valid) fell
    assert len(t["changes"]["logp_valid"]) == 3
    # entropy changes +0.28, +0.01, -0.26 against valid changes -0.1, +0.2, +0.1: ranks (2, 1, 0) vs (0, 2, 1)
    assert t["c4_rank_correlation"]["logp_valid"]["rho"] == pytest.approx(-0.5)
    perfect = A.rank_correlation(list(range(12)), [x ** 3 for x in range(12)])
    assert perfect["rho"] == pytest.approx(1.0) and perfect["p"] < 1e-3 and perfect["n"] == 12
    (c3,) = t["c3"]
    assert c3["before"] == [-2.0, 0.0] and c3["after"] == [0.5] and c3["verdict"] == "for"
    assert (c3["neg_larger"], c3["both_signs"], c3["negative"], c3["live"]) == (1, 2, 1, 2)
    md = "\n".join(A.tallies_markdown(t, 0.05))
    assert "| rose | 1 | 1 / 0, p=1 |" in md and "C3 over runs: for 1, against 0, n/a 0." in md


def test_rescore_scores_fixed_steps_under_the_base_and_each_snapshot(tmp_path):
    """C4 measured on fixed steps: update 0 is the zero adapter, later points load the snapshots; the result is saved
    with the run and read back by a later analysis that has no checkpoints."""
    run, _, tok = run_on_a_saved_base(tmp_path)
    torch.manual_seed(0)
    policy = R.Policy(F.add_lora(F.tiny_model(len(tok), seed=0), r=4))
    steps = [(ep["won"], s) for eps in A.load_rollouts(run).values() for ep in eps for s in ep["steps"]]
    samples = [{"prompt_ids": tok(s["prompt"], add_special_tokens=False)["input_ids"], "response_ids": s["response_ids"]}
               for _, s in steps]
    # valid steps the run did not sample: the ALFWorld expert's on the tasks (seeds) of the run's episodes
    seeds = sorted({ep["seed"] for eps in A.load_rollouts(run).values() for ep in eps})
    demos = F.demo_pairs(tok, F.expert_demos("alfworld", seeds, history_length=2))
    R.score(policy, tok, samples + demos)  # the zero adapter: the base's log-probs
    want = A.mean([x for (_, s), x_s in zip(steps, samples) if s["valid"] for x in x_s["old_logp"]])
    want_expert = A.mean([x for d in demos for x in d["old_logp"]])
    dp_update.move_adapter(policy, 3.0)
    save_snapshot(run, policy, "state-u00050.pt")
    rep = A.main(["--runs", run, "--out_dir", str(tmp_path / "a"), "--rescore", "--rescore_samples", "100000"])
    res = rep["logs"]["stats"]["grpo-alfworld-s0"]["rescore"]
    assert [p["update"] for p in res["points"]] == [0, 50] and res["steps"] == len(steps)
    # 06 scores the steps in another order, so in other padded micro-batches of this random model: 2e-3 of slack
    assert res["points"][0]["logp_valid"] == pytest.approx(want, abs=2e-3)
    assert res["expert_steps"] == len(demos) > 0
    assert res["points"][0]["logp_expert"] == pytest.approx(want_expert, abs=2e-3)
    assert abs(res["points"][1]["logp_expert"] - want_expert) > 0.01
    # the snapshot's adapter moves them (this near-uniform random model, logp ~ -log V, moves little: 0.019)
    assert abs(res["points"][1]["logp_valid"] - want) > 0.01
    again = A.main(["--runs", run, "--out_dir", str(tmp_path / "b")])["logs"]["stats"]["grpo-alfworld-s0"]["rescore"]
    keys = ("update", "logp_valid", "logp_correct", "logp_wrong", "logp_expert")
    assert [[p[k] for k in keys] for p in again["points"]] == [[p[k] for k in keys] for p in res["points"]]
    assert "Fixed steps re-scored" in (tmp_path / "b" / "summary.md").read_text()


def test_separation_is_kept_with_the_logs_when_rollouts_are_gone(tmp_path):
    import shutil
    run = str(tmp_path / "grpo-alfworld-s0")
    write_run(run, two_bumps(), sep_gap=1.0, seed=0)
    first = A.main(["--runs", run, "--out_dir", str(tmp_path / "a")])["logs"]["stats"]["grpo-alfworld-s0"]
    assert first["separation_first_last"] is not None
    shutil.rmtree(os.path.join(run, "rollouts"))  # committed results keep args, metrics and these small files only
    again = A.main(["--runs", run, "--out_dir", str(tmp_path / "b")])["logs"]["stats"]["grpo-alfworld-s0"]
    flat = lambda pairs: [x for pair in pairs for x in pair]  # noqa: E731
    assert flat(again["separation_first_last"]) == pytest.approx(flat(first["separation_first_last"]))
    assert first["separation_null"] and again["separation_null"] == first["separation_null"]  # kept as well
