"""The base-recipe table: one row per recipe folder under results/base-study (base.json + eval.json).

    python results/base-study/table.py            # Markdown to stdout
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = {"alfworld_expert": "oracle", "webshop_expert": "oracle", "format_noise": 0.0, "idle_noise": 0.0,
            "layers": 4, "hidden": 128}


def rows():
    for name in sorted(os.listdir(HERE)):
        folder = os.path.join(HERE, name)
        if not os.path.isfile(os.path.join(folder, "eval.json")):
            continue
        base = json.load(open(os.path.join(folder, "base.json")))
        for env, m in json.load(open(os.path.join(folder, "eval.json"))).items():
            yield name, env, base, m


def main():
    print("| recipe | env | expert | demo tasks | detour | format noise | idle noise | SFT steps | model | demo rows | "
          "SFT loss (last 20) | held-out success (tasks) | valid | demo-task success (tasks) | demo / held-out |")
    print("|" + "---|" * 15)
    for name, env, base, m in rows():
        a = {**DEFAULTS, **base["args"]}
        detour = a["detour"] if env in a["detour_envs"].split(",") else 0.0
        demo = m.get("demo_success")
        ratio = f"{demo / m['success']:.2f}" if demo is not None and m["success"] else "n/a"
        print(f"| {name} | {env} | {a[env + '_expert']} | {a['demo_tasks']} | {detour} | {a['format_noise']} | "
              f"{a['idle_noise']} | "
              f"{a['sft_steps']} | {a['layers']} x {a['hidden']} | {base['demo_rows']} | {base['sft_loss_last']:.4f} | "
              f"{m['success']:.3f} ({m['episodes']}) | {m['valid_ratio']:.3f} | "
              + (f"{demo:.3f} ({m['demo_tasks']})" if demo is not None else "n/a") + f" | {ratio} |")


if __name__ == "__main__":
    main()
