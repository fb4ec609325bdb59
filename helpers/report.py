"""The results pipeline's file reading and table / summary writing, which a first reading skips: a run's logs
(metrics.jsonl, rollouts, args.json) and its saved checkpoint measurements, the runs of an experiment folder with
their labels and order, the held-out passes in their eval.jsonl, and the writers of summary.md, table.md and the
JSON files. 06_analysis.py
computes the numbers and hands them in; nothing here analyses them.
"""
import json
import math
import os
import re

import torch

from helpers.runs import EVAL_KEY, finite, read_jsonl, series, sign_test


def jsonable(x, max_numel=256):
    """Scalars, strings, small tensors (as lists) and containers of them; large tensors are dropped."""
    if isinstance(x, dict):
        out = {k: jsonable(v, max_numel) for k, v in x.items()}
        return {k: v for k, v in out.items() if v is not None}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, max_numel) for v in x]
    if isinstance(x, torch.Tensor):
        return x.detach().tolist() if x.numel() <= max_numel else None
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def mean(xs):
    xs = [x for x in xs if finite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def load_metrics(run):
    """metrics.jsonl of a run, one row per update (a resumed run may log an update twice: the last row wins)."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"error: no metrics.jsonl in {run!r} (a folder written by 03_grpo.py / 04 / 05)")
    rows = {int(r["update"]): r for r in read_jsonl(path) if "update" in r}
    return [rows[u] for u in sorted(rows)]


def load_rollouts(run):
    """{update: [episode, ...]} from run/rollouts/updateNNNNN-rankR.jsonl (all ranks of an update together)."""
    folder, out = os.path.join(run, "rollouts"), {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        hit = re.match(r"update(\d+)-rank\d+\.jsonl$", name)
        if hit:
            for ep in read_jsonl(os.path.join(folder, name)):
                steps = ep["steps"]
                ep["steps"] = json.loads(steps) if isinstance(steps, str) else steps
                out.setdefault(int(hit.group(1)), []).append(ep)
    return out


def run_args(run):
    path = os.path.join(run, "args.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def snapshot_measure(info, args, key, compute):
    """A checkpoint measurement of a run: computed when asked (and saved as run/<key>.json, small enough to commit
    with the run's logs), else read from that file when it is there (committed results have no checkpoints)."""
    path = os.path.join(info["run"], f"{key}.json")
    if getattr(args, key):
        res = compute(info, args)
        if res["points"]:
            with open(path, "w") as f:
                json.dump(jsonable(res), f)
        return res
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def fmt(x):
    return "n/a" if not finite(x) else f"{x:.3f}"


def write_summary(infos, stats, pngs, args, path, back, noise=None):
    """summary.md of the log analysis; back: the actions counted as back-navigation in the WebShop outcomes."""
    if noise:
        rule = (f"{noise['threshold']:.4f} nats = {noise['k']} x sd_c x sqrt(2/{noise['window']}), sd_c = "
                f"{noise['sd']:.4f} the update-to-update sd of the no-learning control `{noise['run']}` "
                f"({noise['updates']} updates)")
    else:
        rule = (f"{args.rise_abs} nats" if args.rise_abs > 0 else f"{args.rise} x the range of the smoothed curve: "
                "relative to the run itself, so noise alone finds 'eruptions'; pass --control for a noise floor")
    lines = ["# Entropy-dynamics analysis", "",
             f"Phases from the per-update mean token entropy, centred moving average over {args.smooth} updates; an "
             f"eruption is a rise of more than the threshold above the running minimum (threshold = {rule}). "
             "Interval = start (trough) -> peak -> end of subsidence. All numbers are read from the run logs.", "",
             "| run | updates | eruptions | success start -> end | valid start -> end | separation first -> last |",
             "|---|---|---|---|---|---|"]
    for info in infos:
        st = stats[info["name"]]
        se, sep = st["start_end"], st["separation_first_last"]
        lines.append(f"| {info['name']} | {st['updates']} | {len(st['eruptions'])} | {fmt(se['success'][0])} -> "
                     f"{fmt(se['success'][1])} | {fmt(se['valid_ratio'][0])} -> {fmt(se['valid_ratio'][1])} | "
                     + (f"{fmt(sep[0][1])} -> {fmt(sep[1][1])} |" if sep else "n/a |"))
    for info in infos:
        st, name = stats[info["name"]], info["name"]
        se, io, sep = st["start_end"], st["inside_outside"], st["separation_first_last"]
        lines += ["", f"## {name}", "", f"- folder: `{info['run']}`; updates: {st['updates']}",
                  f"- eruptions: {len(st['eruptions'])} (threshold {st['threshold']:.4f} nats)" +
                  ("; intervals (start -> peak -> end, updates): " +
                   ", ".join(f"{a} -> {p} -> {e}" for a, p, e in st["eruptions"]) if st["eruptions"] else ""),
                  f"- success (mean of the first / last {args.smooth} updates): {fmt(se['success'][0])} -> "
                  f"{fmt(se['success'][1])}; valid ratio: {fmt(se['valid_ratio'][0])} -> {fmt(se['valid_ratio'][1])}"
                  f"; val_success first -> last logged: {fmt(se['val_success'][0])} -> {fmt(se['val_success'][1])}",
                  f"- duplication inside / outside eruption intervals: {fmt(io['duplication'][0])} / "
                  f"{fmt(io['duplication'][1])}; hallucination: {fmt(io['hallucination'][0])} / "
                  f"{fmt(io['hallucination'][1])}",
                  "- separation (Fisher ratio of mean hidden states, correct vs wrong): " +
                  (f"update {sep[0][0]}: {fmt(sep[0][1])} -> update {sep[1][0]}: {fmt(sep[1][1])}" if sep else
                   f"n/a ({'no rollout records' if not st['rollout_updates'] else 'fewer than 2 correct or 2 wrong'}"
                   " trajectories at every saved update)")]
        for source, rows_ in (st.get("eruption_sweep") or {}).items():
            whose = "the control's" if source == "control" else "the run's own"
            lines.append(f"- eruptions by threshold, k x {whose} update-to-update noise (count, subsided, back to "
                         "their starting level): " + "; ".join(
                             f"k {k} ({r['threshold']:.4f} nats): {r['eruptions']}, {r['subsided']}, {r['returned']}"
                             for k, r in rows_.items()))
        nulls = st.get("separation_null") or {}
        if nulls:  # C2's null: the same ratio under shuffled labels
            perms = next(iter(nulls.values()))["perms"]
            lines.append(f"- separation against shuffled correct/wrong labels (same counts, {perms} shuffles), per "
                         "saved update: " + "; ".join(
                             f"{u}: {fmt(v['ratio'])} vs null median {fmt(v['null_median'])} (95%: "
                             f"{fmt(v['null_q95'])}), p = {v['p']:.3g}, {v['n_correct']} / {v['n_wrong']}"
                             for u, v in sorted(nulls.items())))
        if st["outcomes"]:
            oc = st["outcomes"]
            lines.append(f"- WebShop outcomes of the {oc['episodes']} saved episodes (replayed): " +
                         ", ".join(f"{k} {v}" for k, v in oc["outcomes"].items()) +
                         f"; back-navigation steps ({' / '.join(back)}): {oc['back_rate']:.4f} of all steps")
        if st["by_type"]:
            lines.append(f"- success per task type over the saved episodes (won / played): " +
                         ", ".join(f"{k} {w}/{n}" for k, (w, n) in st["by_type"].items()))
        lines += ["",
                  "| phase | updates | entropy | duplication | hallucination | valid ratio | success |",
                  "|---|---|---|---|---|---|---|"]
        for p, v in st["per_phase"].items():
            lines.append(f"| {p} | {v['updates']} | " + " | ".join(fmt(v[k]) for k in
                         ("entropy", "duplication", "hallucination", "valid_ratio", "success")) + " |")
        if "interference" in st:
            res = st["interference"]
            lines += ["", "Gradient interference (c_j vs A_j, up to "
                      f"{args.interference_samples} steps per checkpoint): " +
                      ("; ".join(f"ckpt {p['update']} ({p['where']}, rollouts {p['rollout_update']}): "
                                 f"(1/G) sum_j A_j c_j = {p['sum_Ac_over_G']:.4g}" for p in res["points"]) or "none")
                      + (f". {res['note']}" if res["note"] else "")]
        if st.get("rescore"):
            res = st["rescore"]
            ex = res.get("expert_steps")
            lines += ["", f"Fixed steps re-scored (C4; {res.get('steps')} steps drawn from the rollouts of updates "
                      f"{res.get('rollout_updates')}, {res.get('won_steps')} in won episodes"
                      + (f"; {ex} expert steps on the run's tasks" if ex else "") + "), mean token logp valid / "
                      "correct / wrong" + (" / expert" if ex else "") + ": " +
                      ("; ".join(f"update {p['update']} ({p['where']}): {fmt(p['logp_valid'])} / "
                                 f"{fmt(p['logp_correct'])} / {fmt(p['logp_wrong'])}"
                                 + (f" / {fmt(p['logp_expert'])}" if ex else "") for p in res["points"]) or "none")
                      + (f". {res['note']}" if res.get("note") else "")]
        lines += ["", " ".join(f"[{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs[name])]
    lines += ["", "All runs: " + " ".join(f"[{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs["all"])]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def safe_name(name):
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def experiment_runs(folder, all_controls=False):
    """The runs of a results/<experiment> folder: (trained runs, the control). The control is the no-learning run
    (lr 0) of the trained runs' env with the most updates (with one control per seed, seed 0's when it is longest);
    all_controls: the list of every such run instead."""
    runs = sorted(os.path.join(folder, d) for d in os.listdir(folder)
                  if os.path.exists(os.path.join(folder, d, "metrics.jsonl")))
    if not runs:
        raise SystemExit(f"error: no run folder with a metrics.jsonl under {folder}")
    trained = [r for r in runs if run_args(r).get("lr", 1) != 0]
    envs = {run_args(r).get("env") for r in trained}
    controls = [r for r in runs if run_args(r).get("lr", 1) == 0 and run_args(r).get("env") in envs]
    if all_controls:
        return trained, controls
    control = max(controls, key=lambda r: (len(load_metrics(r)), -run_args(r).get("seed", 0)), default="")
    return trained, control


def label(run):
    """grpo, gigpo+seal, ...; a SEAL run off the released alpha (0.02) is its own algorithm, "grpo+seal alpha 0.1"."""
    a = run_args(run)
    if a.get("lr") == 0:
        return "control"
    alpha = a.get("alpha", 0)
    return a.get("algo", "?") + ("+seal" if alpha > 0 else "") + (f" alpha {alpha:g}" if alpha not in (0, 0.02) else "")


def algo_order(algo):
    """grpo, grpo+seal, gigpo, gigpo+seal, then the alpha sweep by alpha: each algorithm next to itself with SEAL."""
    alpha = re.search(r"alpha (\S+)", algo)
    return "alpha" in algo, "gigpo" in algo, float(alpha.group(1)) if alpha else 0.0, algo


def algo_name(run, lrs):
    """label(run), with the lr when the experiment sweeps it (lr tells its runs apart)."""
    return label(run) + (f" lr {run_args(run).get('lr'):g}" if len(lrs) > 1 else "")


def entropy_area(smoothed):
    """Sum over updates of the smoothed entropy above its running minimum (nats x updates)."""
    lo, area = float("inf"), 0.0
    for v in smoothed:
        lo = min(lo, v)
        area += v - lo
    return area


LOGP_KEYS = ("logp_valid", "logp_correct", "logp_wrong", "logp_expert")


def tallies_markdown(t, threshold):
    """The tables of snapshot_tallies, for table.md."""
    if not (t["c4"] or t["c3"]):
        return []
    lines = []
    if t["c4"]:
        lines += ["", f"C4, fixed steps re-scored at consecutive snapshots (all runs with rescore.json; threshold "
                  f"{threshold:.4g} nats): mean log-prob fell / rose, sign-test p", "",
                  "| smoothed entropy between snapshots | intervals | valid steps | correct steps | wrong steps | "
                  "the expert's steps on the run's tasks |", "|---|---|---|---|---|---|"]
        for kind in ("rose", "fell", "within the threshold"):
            if kind in t["c4"]:
                row = t["c4"][kind]
                cells = [f"{d} / {u}, p={sign_test([1] * d + [0] * u, [0] * d + [1] * u)['p']:.2g}"  # gained=rose
                         if (d, u) != (0, 0) else "n/a" for d, u in (row.get(k, (0, 0)) for k in LOGP_KEYS)]
                lines.append(f"| {kind} | {sum(row['logp_valid'])} | " + " | ".join(cells) + " |")
        rc = t.get("c4_rank_correlation", {})
        if rc:
            cells = [f"{rc[k]['rho']:+.2f} (p={rc[k]['p']:.2g})" if k in rc else "n/a" for k in LOGP_KEYS]
            lines.append(f"| all: Spearman rho of the log-prob change with the entropy change (permutation p) | "
                         f"{rc['logp_valid']['n']} | " + " | ".join(cells) + " |")
    if t["c3"]:
        lines += ["", "C3, (1/G) sum_j A_j c_j per snapshot (all runs with interference.json): before or in the rise "
                  "of an eruption vs while one subsides or after one", "",
                  "| run | before / rising | subsiding / after | before more negative | snapshots where negative-"
                  "advantage steps have the larger mean c_j |", "|---|---|---|---|---|"]
        for r in t["c3"]:
            lines.append(f"| {r['run']} | {', '.join(f'{x:.3g}' for x in r['before']) or '-'} | "
                         f"{', '.join(f'{x:.3g}' for x in r['after']) or '-'} | {r['verdict']} | "
                         f"{r['neg_larger']} / {r['both_signs']} |")
        v = [r["verdict"] for r in t["c3"]]
        lines.append(f"\nC3 over runs: for {v.count('for')}, against {v.count('against')}, n/a {v.count('n/a')}. "
                     f"The sum is negative (a GRPO step lowers the batch's mean likelihood) at "
                     f"{sum(r['negative'] for r in t['c3'])} of {sum(r['live'] for r in t['c3'])} snapshots whose "
                     f"steps carry any advantage.")
    return lines


def passes(run, base=False):
    """{task-set key: the last pass on it} of a run's eval.jsonl: its adapters' passes, or (base=True) the base's."""
    out = {}
    for r in read_jsonl(os.path.join(run, "eval.jsonl")):
        if "val_won" in r and (r.get("ckpt") == "base") == base:
            out[tuple(r.get(k) for k in EVAL_KEY)] = r
    return out


def held_out(run):
    """The run's score: its last --eval_ckpt pass on the most held-out tasks (results/matrix/eval.sh scores the final
    adapter only), or None."""
    evs = list(passes(run).values())
    return max(reversed(evs), key=lambda r: len(r["val_won"])) if evs else None


def paired(run_a, run_b):
    """Both runs' passes on the largest task set they share (same seeds, temperature, split): (won_a, won_b, key)."""
    a, b = passes(run_a), passes(run_b)
    common = sorted(set(a) & set(b), key=lambda k: len(a[k]["val_won"]))
    return (a[common[-1]]["val_won"], b[common[-1]]["val_won"], common[-1]) if common else None


def results_table(infos, path):
    """table.md of an experiment: one row per run, then per algorithm the mean over seeds and the paired tests of
    each algorithm with SEAL against the same algorithm without it on the same seed (on the largest held-out task set
    both runs were scored on). Held-out cells name their number of tasks."""
    rows, per = [], {}
    lrs = {run_args(i["run"]).get("lr") for i in infos}
    for info in sorted(infos, key=lambda i: (algo_order(label(i["run"])), run_args(i["run"]).get("seed", 0))):
        a, ev = run_args(info["run"]), held_out(info["run"])
        s, ph = info["phases"]["smoothed"], info["eruptions"]
        peak = max((s[info["updates"].index(p)] - s[info["updates"].index(b)] for b, p, _ in ph), default=0.0)
        _, succ = series(info["rows"], "success")
        r = {"run": info["name"], "path": info["run"], "algo": algo_name(info["run"], lrs), "seed": a.get("seed"),
             "eruptions": len(ph), "peak": peak, "area": entropy_area(s), "success": (mean(succ[:5]), mean(succ[-5:])),
             "held_out": ev and ev["val_success"], "tasks": ev and len(ev["val_won"]),
             "key": ev and tuple(ev.get(k) for k in EVAL_KEY)}
        rows.append(r)
        per.setdefault(r["algo"], []).append(r)
    sd = lambda xs: math.sqrt(sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan")
    cell = lambda x, n: f"{fmt(x)} ({n})" if x is not None else "n/a"  # noqa: E731
    lines = ["| run | algorithm | seed | eruptions | largest rise (nats) | entropy area | train success first / last 5 "
             "| held-out success (tasks) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['algo']} | {r['seed']} | {r['eruptions']} | {fmt(r['peak'])} | {fmt(r['area'])}"
                     f" | {fmt(r['success'][0])} / {fmt(r['success'][1])} | {cell(r['held_out'], r['tasks'])} |")
    lines += ["", "| algorithm | runs | eruptions per run | entropy area | held-out success mean +- sd (tasks) | with vs "
              "without SEAL over seeds: ahead / behind (sign test p), mean difference | with vs without SEAL, paired "
              "over seeds x tasks (gained / lost, p; secondary) |", "|---|---|---|---|---|---|---|"]
    for algo, rs in sorted(per.items(), key=lambda kv: algo_order(kv[0])):
        ho = [r for r in rs if r["held_out"] is not None]
        without = re.sub(r"\+seal( alpha \S+)?", "", algo)  # the same algorithm without SEAL, any alpha
        base = {r["seed"]: r for r in per.get(without, [])} if "+seal" in algo else {}
        pairs = [p for p in (paired(base[r["seed"]]["path"], r["path"]) for r in rs if r["seed"] in base) if p]
        test = sign_test([x for a, _, _ in pairs for x in a], [x for _, b, _ in pairs for x in b]) if pairs else None
        diffs = [mean(b) - mean(a) for a, b, _ in pairs]  # the training seed is the unit: one difference per seed
        seeds = sign_test([int(d < 0) for d in diffs], [int(d > 0) for d in diffs]) if diffs else None
        sizes = "/".join(str(n) for n in sorted({r["tasks"] for r in ho}))
        lines.append(f"| {algo} | {len(rs)} | {fmt(mean([r['eruptions'] for r in rs]))} | "
                     f"{fmt(mean([r['area'] for r in rs]))} | "
                     + (f"{fmt(mean([r['held_out'] for r in ho]))} +- {fmt(sd([r['held_out'] for r in ho]))} ({sizes})"
                        if ho else "n/a") + " | "
                     + (f"{seeds['gained']} / {seeds['lost']} of {len(diffs)} (p={seeds['p']:.3g}), "
                        f"{mean(diffs):+.3f} +- {fmt(sd(diffs))}" if seeds else "n/a") + " | "
                     + (f"{test['gained']} / {test['lost']}, p={test['p']:.3g} "
                        f"({'/'.join(sorted({str(k[2]) for _, _, k in pairs}))} tasks)" if test else "n/a") + " |")
    types = sorted({t for r in rows if r["key"] for t in (held_out(r["path"]).get("val_by_type") or {})})
    if types:  # ALFWorld: held-out success per task type, mean +- sd over seeds
        lines += ["", "| algorithm | " + " | ".join(t.replace("_", " ") for t in types) + " |",
                  "|---|" + "---|" * len(types)]
        for algo, rs in sorted(per.items(), key=lambda kv: algo_order(kv[0])):
            by = [held_out(r["path"]).get("val_by_type") or {} for r in rs if r["key"]]
            rates = {t: [b[t][0] / b[t][1] for b in by if b.get(t) and b[t][1]] for t in types}
            lines.append(f"| {algo} | " + " | ".join(f"{fmt(mean(v))} +- {fmt(sd(v))}" if v else "n/a"
                                                     for v in rates.values()) + " |")
    keys = sorted({r["key"] for r in rows if r["key"]}, key=lambda k: k[2])
    bases = {}
    for i in infos:  # the runs' paired passes share one base pass per task set (results/matrix/eval.sh)
        bases.update(passes(i["run"], base=True))
    found = [bases[k] for k in keys if k in bases]
    if found:
        lines += ["", "The base (zero adapter) on the same held-out tasks: " + "; ".join(
            f"{fmt(b['val_success'])} on {b['val_tasks']} tasks" for b in found) +
            f" (from seed {found[0]['val_seed']}, T {found[0]['val_temperature']}); each run's paired test against "
            "it is `vs_base` in its eval.jsonl."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path, rows
