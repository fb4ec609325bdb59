"""The base-recipe table: one row per recipe folder under results/base-study (base.json + eval.json).

    python results/base-study/table.py            # Markdown to stdout
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
KNOBS = ("envs", "alfworld_expert", "webshop_expert", "demo_tasks", "detour", "format_noise", "sft_steps", "layers",
         "hidden")


def rows():
    for name in sorted(os.listdir(HERE)):
        folder = os.path.join(HERE, name)
        if not os.path.isfile(os.path.join(folder, "eval.json")):
            continue
        base = json.load(open(os.path.join(folder, "base.json")))
        for env, m in json.load(open(os.path.join(folder, "eval.json"))).items():
            yield name, env, base, m


def main():
    print("| recipe | env | " + " | ".join(KNOBS[1:]) + " | demo rows | SFT loss (last 20) | held-out success "
          "(tasks) | valid | demo-task success (tasks) | demo / held-out |")
    print("|" + "---|" * (len(KNOBS) + 8))
    for name, env, base, m in rows():
        a = base["args"]
        demo = m.get("demo_success")
        ratio = f"{demo / m['success']:.2f}" if demo is not None and m["success"] else "n/a"
        print(f"| {name} | {env} | " + " | ".join(str(a.get(k, "")) for k in KNOBS[1:]) +
              f" | {base['demo_rows']} | {base['sft_loss_last']:.4f} | {m['success']:.3f} ({m['episodes']}) | "
              f"{m['valid_ratio']:.3f} | " + (f"{demo:.3f} ({m['demo_tasks']})" if demo is not None else "n/a") +
              f" | {ratio} |")


if __name__ == "__main__":
    main()
