"""The gate's verdict (PLAN.md) from the committed logs of one env's GRPO run and its control, then a Markdown table
of both runs' means over blocks of 10 updates.

    python results/base-gate/verdict.py alfworld-search-fmt0.4
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def rows(folder, name):
    with open(os.path.join(folder, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(prefix):
    grpo, control = (os.path.join(HERE, f"{prefix}-{r}") for r in ("grpo", "lr0"))
    final = [r for r in rows(grpo, "eval.jsonl") if r["ckpt"] != "base" and "vs_base" in r]
    base = [r for r in rows(grpo, "eval.jsonl") if r["ckpt"] == "base"]
    g = {r["update"]: r["success"] for r in rows(grpo, "metrics.jsonl")}
    c = {r["update"]: r["success"] for r in rows(control, "metrics.jsonl")}
    after = [u for u in sorted(g) if u > 10 and u in c]
    above = sum(g[u] > c[u] for u in after)
    out = {"updates": len(g), "control_updates": len(c), "train_success_above_control": [above, len(after)],
           "train_rule": above > len(after) / 2}
    if final and base:
        v = final[-1]["vs_base"]
        out.update(base=base[-1]["val_success"], adapter=final[-1]["val_success"], update=final[-1]["update"],
                   tasks=final[-1]["val_tasks"], gained=v["gained"], lost=v["lost"], p=v["p"],
                   held_out_rule=v["gained"] > v["lost"] and v["p"] < 0.01)
        bt, at = base[-1].get("val_by_type") or {}, final[-1].get("val_by_type") or {}
        if bt and at:  # ALFWorld: [base won, adapter won, played] per task type
            out["by_type"] = {k: [bt[k][0], at[k][0], bt[k][1]] for k in sorted(bt)}
    out["passes"] = bool(out.get("held_out_rule")) and out["train_rule"]
    print(json.dumps(out))
    print(blocks(rows(grpo, "metrics.jsonl"), rows(control, "metrics.jsonl")))
    return out


def blocks(grpo, control, size=10):
    keys = (("success", "train success"), ("valid_ratio", "valid ratio"), ("entropy", "token entropy"))
    if all("verbs" in r for r in grpo + control) and any("look" in r["verbs"] for r in grpo + control):
        for r in grpo + control:  # ALFWorld runs that log their command verbs: how often the policy looks
            r["look"] = r["verbs"].get("look", 0.0)
        keys += (("look", "look share"),)
    head = "| updates | " + " | ".join(f"{name}, GRPO / control" for _, name in keys) + " | KL (GRPO) |"
    lines = [head, "|---|" + "---|" * (len(keys) + 1)]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    for a in range(0, len(grpo), size):
        g, c = grpo[a:a + size], control[a:a + size]
        cells = [f"{mean(g, k):.3f} / {mean(c, k):.3f}" if c else f"{mean(g, k):.3f} / n/a" for k, _ in keys]
        lines.append(f"| {a + 1}-{a + len(g)} | " + " | ".join(cells) + f" | {mean(g, 'kl'):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1])
