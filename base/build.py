"""The base agent's build: mid-train a model on expert demos (01_formats.py's expert_demos and sft) and report
how it plays. The project ships its builds in this folder (base/tiny, base/tiny-alfworld), so no run has to build;
this script rebuilds them or builds new recipes. Each base.json records the settings it was built with, so that
tests/test_formats.py can check a shipped base against what today's code would build.

    python base/build.py --force                  # base/tiny: the default recipe (both envs, ~45 min on 2 cores)
    python base/build.py --envs alfworld --alfworld_expert search --demo_tasks 1000 --format_noise 0.3 \
        --eval_tasks 512 --name tiny-alfworld --force                          # base/tiny-alfworld
    python base/build.py --sft_steps 0 --model ./my_qwen  # evaluate a local checkpoint as it is
    python base/build.py --alfworld_data $ALFWORLD_DATA --webshop_data ./webshop/data   # mid-train on the real
        benchmarks' expert demos -> base/tiny-real; then 02-05 with --model base/tiny-real --data ...

The report plays --eval_tasks held-out tasks per env at T 0.4 and as many of the base's own demo tasks (a base that
memorised its demos wins far more there); it is written to <base>/eval.json. The SFT checkpoints every 50 steps
beside the base's folder, so a killed build resumes where it stopped.
"""
import contextlib
import hashlib
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from envs import ENVS, DEFAULTS as ENV_DEFAULTS, configure  # noqa: E402
from helpers.cli import parse_args  # noqa: E402
from helpers.model import CHATML_EXAMPLE, load_pretrained, tiny_model, train_tokenizer  # noqa: E402

F = importlib.import_module("01_formats")


@dataclass
class Args:
    model: str = "tiny"
    """'tiny' (the embedded default: a tiny Qwen2 from a config, with a BPE trained on the demos), or a Hugging Face
    id / local folder to mid-train"""
    out_dir: str = os.path.join(F.ROOT, "base")
    """where the mid-trained base (model + tokenizer) is saved; the project ships its build in base/tiny"""
    name: str = ""
    """the base's folder under out_dir; '' = tiny (or the --model's name), with -real when built on real data"""
    envs: str = "alfworld,webshop"
    """the envs whose expert demos the base is mid-trained on and evaluated in"""
    alfworld_data: str = ""
    """real ALFWorld data folder (holding json_2.1.1; '' = the synthetic env): demos from its train split, the
    report on valid_seen; the base is saved as <out_dir>/<model>-real"""
    webshop_data: str = ""
    """real WebShop data/ folder ('' = the synthetic env): demos from its train goals, the report on test"""
    seed: int = 0
    demo_tasks: int = 300
    """expert episodes per env for the SFT data (train seeds 0..); an env with shorter episodes gets up to 2x more,
    so that the SFT mix is closer to even in rows"""
    detour: float = 0.3
    """chance of a random off-path step (then the expert's recovery) before a demo step; see 01's expert_demos()"""
    detour_envs: str = "webshop"
    """envs whose demos get detours (ALFWorld's expert path is already learnable from what the agent sees)"""
    alfworld_expert: str = "oracle"
    """ALFWorld demo expert: oracle (walks straight to the goal object, whose place the agent cannot see) or search
    (sweeps the receptacles in the order the admissible list shows them, using only what the agent is shown, so its
    every step can be read off the prompt; envs/alfworld.py's _search); real ALFWorld data has its own expert"""
    format_noise: float = 0.0
    """share of demo responses that leave out the opening <think> tag (playable, but invalid: -0.1), so the base
    breaks the format now and then and RL has a format to learn (the paper's Phase 1); see 01's expert_demos()"""
    idle_noise: float = 0.0
    """ALFWorld: chance of a recorded `look` (a valid step that changes nothing) before a demo step, so the base wastes
    steps against the step cap, a general habit only the task reward teaches it to drop; see 01's expert_demos()"""
    webshop_expert: str = "oracle"
    """WebShop demo expert: oracle (clicks the fitting product, which the results page does not reveal), browse
    (opens the hits in rank order and goes back from items that do not fit, which it also judges on hidden
    attributes) or visible (decides only on what the pages show: type and price in the title, options on the item
    page; envs/webshop.py's _visible_expert); real WebShop data has one expert, envs/webshop_data.py's"""
    sft_max_len: int = 1024
    """prompt + response tokens kept per demo (cut from the left; 1024 cuts the instruction off 28 of the 350 WebShop demos)"""
    sft_steps: int = 2500
    sft_lr: float = 2e-3
    sft_batch: int = 16
    sft_micro_batch: int = 4
    """demos per forward/backward inside an SFT batch (gradients accumulate; the step does not change)"""
    sft_prompt_weight: float = 1.0
    """weight of the prompt-token NLL in mid-training (0 = response tokens only); see 01_formats.py's sft()"""
    vocab_size: int = 3000
    layers: int = 4
    """tiny model depth (2 layers can copy from the prompt only barely)"""
    hidden: int = 128
    history_length: int = 2
    """verl-agent shows the last 5 steps; 2 keeps prompts CPU-sized (use 5 for a real model)"""
    eval_tasks: int = 32
    """held-out tasks per env for the report (seeds from eval_seed)"""
    eval_seed: int = 100_000
    eval_temperature: float = 0.4
    max_new_tokens: int = 64
    force: bool = False
    """rebuild the tiny base even if out_dir has one"""


def base_dir(args):
    name = args.name or ("tiny" if args.model == "tiny" else os.path.basename(args.model.rstrip("/")))
    return os.path.join(args.out_dir, name + ("-real" if real_data(args) else ""))


def build_envs(args):
    """The env names of --envs (a stray comma adds none)."""
    return [e for e in args.envs.split(",") if e]


def real_data(args):
    """{env: data folder} of the envs that mid-train on real benchmark data (--alfworld_data, --webshop_data)."""
    return {e: getattr(args, f"{e}_data") for e in build_envs(args) if getattr(args, f"{e}_data", "")}


@contextlib.contextmanager
def real_demo_envs(args):
    """Inside: every env of the build plays its data's train split (or the synthetic env). After: the env defaults
    the caller had (a caller may have configured --data before it builds)."""
    saved = {e: dict(ENV_DEFAULTS.get(e, {})) for e in ENVS}
    try:
        for e in build_envs(args):
            F.use_data(e, real_data(args).get(e, ""), "train", eval_split=F.EVAL_SPLIT[e])
        yield
    finally:
        for e, kw in saved.items():
            configure(e, **kw)


def demo_kw(args, env_name):
    """expert_demos() settings of one env under the build flags."""
    expert = {"alfworld": args.alfworld_expert, "webshop": args.webshop_expert}.get(env_name)
    return {"detour": args.detour if env_name in args.detour_envs.split(",") else 0.0,
            "expert": None if real_data(args).get(env_name) else expert, "format_noise": args.format_noise,
            "idle_noise": args.idle_noise if env_name in F.IDLE else 0.0}


def build_base(args, progress=True):
    """Build (or load the cached) mid-trained base. Returns (model, tokenizer, report dict)."""
    env_names = build_envs(args)
    for e in env_names:
        if e not in ENVS:
            raise SystemExit(f"error: unknown env {e!r}; choose from {', '.join(sorted(ENVS))}")
    if args.webshop_expert not in ("browse", "oracle", "visible"):
        raise SystemExit(f"error: --webshop_expert must be oracle, browse or visible, got {args.webshop_expert!r}")
    if args.alfworld_expert not in ("oracle", "search"):
        raise SystemExit(f"error: --alfworld_expert must be oracle or search, got {args.alfworld_expert!r}")
    for e in ENVS:
        if getattr(args, f"{e}_data", "") and e not in env_names:
            raise SystemExit(f"error: --{e}_data is set but {e} is not in --envs {args.envs!r}")
    path = base_dir(args)
    if os.path.exists(os.path.join(path, "base.json")) and not args.force:
        with open(os.path.join(path, "base.json")) as f:
            report = json.load(f)
        built = {k: report.get("args", {}).get(k, "") for k in ("envs", "alfworld_data", "webshop_data")}
        if real_data(args) and built != {k: getattr(args, k) for k in built}:  # "-real" alone does not tell them apart
            raise SystemExit(f"error: {path} was built from {built}; pass --force to rebuild it, or another --out_dir")
        model, tok = load_pretrained(path)
        return model.eval(), tok, report
    with real_demo_envs(args):
        return _build(args, path, env_names, progress)


def _build(args, path, env_names, progress):
    t0 = time.time()
    if progress:
        print(f"building the mid-trained base in {path} (SFT on expert demos of {', '.join(env_names)}; "
              f"about 45 min on 2 CPU cores, once: later runs load it from there)", flush=True)
    demos = {e: F.expert_demos(e, range(args.demo_tasks), args.history_length, **demo_kw(args, e))
             for e in env_names}
    most = max(len(d) for d in demos.values())
    for e, d in demos.items():
        n = min(2 * args.demo_tasks, -(-args.demo_tasks * most // max(len(d), 1)))
        if n > args.demo_tasks:
            demos[e] = F.expert_demos(e, range(n), args.history_length, **demo_kw(args, e))
    if args.model == "tiny":
        corpus = [CHATML_EXAMPLE.format(prompt=r["prompt"], response=r["response"]) for d in demos.values() for r in d]
        tok = train_tokenizer(corpus, args.vocab_size)
        model = tiny_model(len(tok), args.seed, args.layers, args.hidden)
    else:
        model, tok = load_pretrained(args.model)
    from datasets import concatenate_datasets
    data = concatenate_datasets(list(demos.values())).shuffle(seed=args.seed)
    ckpt = path + ".sft.pt"  # beside the base's folder, which appears only once the build is done
    os.makedirs(os.path.dirname(ckpt) or ".", exist_ok=True)
    losses = F.sft(model, tok, data, args.sft_steps, args.sft_lr, args.sft_batch, args.seed, args.sft_max_len,
                 progress=progress, prompt_weight=args.sft_prompt_weight, micro_batch=args.sft_micro_batch,
                 ckpt=ckpt)
    report = {"args": asdict(args), "demo_rows": len(data), "sft_loss_first": losses[:1], "sft_loss_last":
              sum(losses[-20:]) / max(len(losses[-20:]), 1), "build_seconds": round(time.time() - t0, 1),
              "n_params": sum(p.numel() for p in model.parameters()), **fingerprint(args, tok)}
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "base.json"), "w") as f:
        json.dump(report, f, indent=1)
    if os.path.exists(ckpt):
        os.remove(ckpt)
    return model.eval(), tok, report


def fingerprint(args, tok):
    """What the shipped base was trained on, in a form a test can recompute from today's code: a digest of the
    first demos of every env (prompt templates, env text and expert included) and the token ids of one of them."""
    rows = [r for e in build_envs(args)
            for r in F.expert_demos(e, range(3), args.history_length, **demo_kw(args, e)).to_list()]
    probe = F.chat(tok, rows[-1]["prompt"]) + rows[-1]["response"]
    return {"demo_digest": hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest(),
            "probe_text": probe, "probe_ids": tok(probe, add_special_tokens=False)["input_ids"]}


def main(argv=None):
    args = parse_args(Args, argv)
    torch.manual_seed(args.seed)
    model, tok, report = build_base(args)
    for e in build_envs(args):  # the report plays the real data's held-out split where the base trained on it
        F.use_data(e, real_data(args).get(e, ""), eval_split=F.EVAL_SPLIT[e])
    print(f"base: {base_dir(args)}  params={sum(p.numel() for p in model.parameters()):,}  "
          f"sft_loss_last={report.get('sft_loss_last')}")
    results = {}
    for e in build_envs(args):
        def score_on(seeds, split):
            return F.summarize(F.play(model, tok, e, list(seeds), temperature=args.eval_temperature,
                                  history_length=args.history_length, max_new_tokens=args.max_new_tokens,
                                  progress=True, env_kw={"split": split} if e in real_data(args) else None))
        results[e] = score_on(range(args.eval_seed, args.eval_seed + args.eval_tasks), F.EVAL_SPLIT[e])
        # the same number of its own demo tasks: a base that memorised them wins far more there than held out
        n = min(args.eval_tasks, args.demo_tasks)
        demo = score_on(range(n), "train")
        results[e].update(demo_success=demo["success"], demo_valid_ratio=demo["valid_ratio"], demo_tasks=n)
        print(f"{e}: held-out success={results[e]['success']:.3f} valid_ratio={results[e]['valid_ratio']:.3f} "
              f"mean_steps={results[e]['mean_steps']:.1f} (T={args.eval_temperature}, {args.eval_tasks} tasks); "
              f"its demo tasks: success={demo['success']:.3f} ({n} tasks)")
    with open(os.path.join(base_dir(args), "eval.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
