"""01 - Formats: prompts, the <think>/<action> parser, the lock-step play loop, and the mid-training on expert demos.

Everything the agent reads and writes goes through this file.

Prompt (verl-agent's templates, our copy of the wording): the task, the last k records
"[Observation n: '...', Action n: '...']" joined by newlines, the current observation and the admissible actions
(ALFWorld: joined by newline + space; WebShop: one per line, each followed by a comma; WebShop observations show
only the [SEP] parts after the instruction, each in single quotes), in the model's chat template (ChatML for Qwen).
The first step uses the shorter template without history.

Response and projection (verl-agent's alfworld/webshop projection):
    response = "<think> ... </think><action> ... </action>"
    action   = lower(text)[first "<action>" + 8 : first "</action>"].strip()     ("" when </action> comes first)
             = lower(text)[-30:] (ALFWorld) / lower(text)[-20:] (WebShop)      when either action tag is missing
    valid    = both action tags present  and  "<think>" and "</think>" in text (case-sensitive, any order)
               and  no CJK character [\u4e00-\u9fff]
The env always receives the action, valid or not, and the history records it; validity only decides the -0.1
penalty (applied by the trainer, see 03_grpo.py). An inadmissible action does nothing in the env.

Deviations from the reference (flags of Args below):
    --history_length 2   verl-agent shows the last 5 steps; 2 keeps prompts CPU-sized (pass 5 for a real model)
    the WebShop results page shows product ids lower-case (WebShop: upper-case), so the tiny model can copy them

Embedded default model ("--model tiny"): a Qwen2ForCausalLM built from a config (random init, ~1M parameters) with a
byte-level BPE trained on environment text. It is "mid-trained" (as the paper mid-trains Llama) by SFT on expert
demonstrations (expert_demos, sft below), minimising the response-token negative log-likelihood plus w (default 1)
times the prompt's own
    L_SFT = - (1 / |y|) * sum_t log pi(y_t | x, y_<t)  -  w * (1 / |x|) * sum_t log pi(x_t | x_<t),
so that it learns the format and part of the skill, leaving room for RL. (The prompt term teaches copying: prompts
repeat their product ids, queries and objects; without it the tiny model memorised training ids instead.) The
experts and the share of malformed demos are the recipe's knobs (expert_demos). base/build.py runs the build and
its report; the project ships the builds in base/ (base/tiny: both envs, oracle experts; base/tiny-alfworld:
ALFWorld's searching expert with format noise), and a real checkpoint (`--model Qwen/Qwen2.5-1.5B-Instruct` or a
local folder) goes through the same load -> (SFT) -> LoRA path.

The tiny model, its tokenizer, LoRA and the loader of the shipped bases live in helpers/model.py; batching,
sampling and the exact speed-ups (prompt sharing, merged LoRA, the lean decoding loop) in helpers/batches.py. 01
hands their names on, so the scripts after it write F.load_base, F.sample, F.pack, ...

    python 01_formats.py --env webshop --steps 1    # a prompt, the expert's response, a malformed one, their parse
    python base/build.py --force                    # rebuild base/tiny (SFT + report; ~45 min on 2 cores)
"""
import hashlib
import json
import os
import random
import re
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as Fn

from envs import make_env, ENVS, DEFAULTS as ENV_DEFAULTS, DataError, configure
from helpers.batches import (batches, generate, merged_lora, micro_batches, pack, pack_shared,  # noqa: F401
                             response_hidden, sample, shifted_masks)
from helpers.cli import parse_args  # noqa: F401
from helpers.model import (CHATML_EXAMPLE, add_lora, body_and_head, eos_ids, load_base,  # noqa: F401
                           load_pretrained, resolve_dtype, tiny_model, train_tokenizer)

ROOT = os.path.dirname(os.path.abspath(__file__))  # paths the project ships resolve from here, not from the cwd

# --------------------------------------------------------------------------------------------- prompts (verl-agent)
# Our own copy of the wording of verl-agent's agent_system/environments/prompts/{alfworld,webshop}.py (upstream, with
# its "observaitons" typo fixed), filled in as its env_manager.py does. The trailing spaces and WebShop's
# non-breaking hyphen in "e\u2011commerce" are part of the reference text.
ALF_ASK = ("\nNow it's your turn to take an action.\n"
           "You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed "
           "within <think> </think> tags. \nOnce you've finished your reasoning, you should choose an admissible "
           "action for current step and present it within <action> </action> tags.\n")
SHOP_ASK = ("\nNow it's your turn to take one action for the current step.\n"
            "You should first reason step-by-step about the current situation, then think carefully which admissible "
            "action best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> "
            "tags. \nOnce you've finished your reasoning, you should choose an admissible action for current step and "
            "present it within <action> </action> tags.\n")
PAST = ("Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} "
        "observations and the corresponding actions you took: {history}\n")
SHOP = "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment."
TEMPLATES = {
    "alfworld": ("\nYou are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task}\n"
                 + PAST + "You are now at step {current_step} and your current observation is: {obs}\n"
                 "Your admissible actions of the current situation are: [{actions}].\n" + ALF_ASK),
    "webshop": (SHOP + "\nYour task is to: {task}.\n" + PAST +
                "You are now at step {current_step} and your current observation is: {obs}.\n"
                "Your admissible actions of the current situation are: \n[\n{actions}\n].\n" + SHOP_ASK),
}
NO_HISTORY = {  # the first step (or history_length 0): verl-agent's shorter template without the history lines
    "alfworld": ("\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
                 "Your current observation is: {obs}\n"
                 "Your admissible actions of the current situation are: [{actions}].\n" + ALF_ASK),
    "webshop": (SHOP + " \nYour task is to: {task}.\nYour current observation is: {obs}.\n"
                "Your admissible actions of the current situation are: \n[\n{actions}\n].\n" + SHOP_ASK),
}


def view(env_name, task, obs):
    """The observation as the prompt shows it. WebShop (verl-agent's format_obs): only the [SEP] parts after the
    instruction, each in single quotes; the raw text when the instruction is not among the parts."""
    if env_name != "webshop":
        return obs
    parts = obs.split(" [SEP] ")
    if task not in parts:
        return obs
    return " [SEP] ".join(f"'{p}'" for p in parts[parts.index(task) + 1:])


def build_prompt(env_name, task, obs, admissible, history, history_length):
    """history: list of (raw observation, projected action) already taken; only the last `history_length` shown."""
    task = task_text(task)
    if env_name == "alfworld":
        actions = "\n ".join(f"'{a}'" for a in admissible)
    else:
        actions = "\n".join(f"'{a}'," for a in admissible)
    if not history or history_length <= 0:
        return NO_HISTORY[env_name].format(task=task, obs=view(env_name, task, obs), actions=actions)
    recent = history[-history_length:]
    first = len(history) - len(recent) + 1
    lines = "\n".join(f"[Observation {first + i}: '{view(env_name, task, o)}', Action {first + i}: '{a}']"
                      for i, (o, a) in enumerate(recent))
    return TEMPLATES[env_name].format(task=task, step_count=len(history), history_length=len(recent), history=lines,
                                      current_step=len(history) + 1, obs=view(env_name, task, obs), actions=actions)


def task_text(task):
    """The env's task line without the 'Your task is to:' lead that the templates already say."""
    task = task.strip()
    lead = "your task is to:"
    return task[len(lead):].strip() if task.lower().startswith(lead) else task


# --------------------------------------------------------------------------------------------- parser
CJK = re.compile(r"[\u4e00-\u9fff]")
TAIL = {"alfworld": 30, "webshop": 20}  # characters sent when the action tags are missing (verl-agent's projection)


def parse_action(text, env_name="alfworld"):
    """verl-agent's projection: (the action the env receives, valid). The action is always a string: a response
    without both action tags still sends its last 30 (ALFWorld) / 20 (WebShop) lower-cased characters."""
    low = text.lower()
    start, end = low.find("<action>"), low.find("</action>")  # both searched from the start of the text
    if start == -1 or end == -1:
        return low[-TAIL.get(env_name, 30):], False
    action = low[start + len("<action>"):end].strip()  # empty when </action> comes first
    valid = "<think>" in text and "</think>" in text and not CJK.search(text)  # case-sensitive, any order
    return action, valid


INVALID_PENALTY = 0.1


def command_verb(action):
    """The command's first word: 'go' of 'go to shelf 1', 'click' of 'click[buy now]'."""
    return action.split("[")[0].split(" ")[0]


def expert_response(env_name, task, action):
    """The demonstration the tiny model imitates: one short reasoning sentence, then the expert's command.

    The sentence names the kind of move, not its arguments, so the only thing to copy from the prompt is the action.
    """
    verb = command_verb(action)
    if env_name == "webshop" and verb == "click":
        target = action[6:-1]
        kind = {"buy now": "buy the item", "next >": "look at the next page", "< prev": "go back",
                "back to search": "search again"}.get(target, "open the best matching product"
                                                       if re.fullmatch(r"b0[0-9a-z]{8}", target) else "pick the option")
        think = f"The page fits my goal, so I will {kind} now."
    elif env_name == "webshop":
        think = "I will search for the product in the instruction."
    else:
        think = f"To finish the task I will {ALF_VERBS.get(verb, 'act')} now."
    return f"<think>{think}</think><action>{action}</action>"


def malformed(response):
    """A demo response without its opening <think> tag: parse_action still finds the action, but marks it invalid."""
    return response.replace("<think>", "", 1)


IDLE = {"alfworld": "look"}  # the command that changes nothing, per env (idle_noise)
ALF_VERBS = {"go": "go to a place", "take": "take the object", "move": "put the object down", "open": "open it",
             "close": "close it", "clean": "clean the object", "heat": "heat the object", "cool": "cool the object",
             "use": "turn on the light", "examine": "examine the object", "look": "look around",
             "inventory": "check my inventory"}


def chat(tok, prompt):
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


_POOL = {}
EVAL_SPLIT = {"alfworld": "valid_seen", "webshop": "test"}  # verl-agent's held-out split of the real data


def use_data(env_name, data="", split="train", goals="synthetic", eval_split=None, single_turn=False):
    """The scripts' --data/--split/--goals: play the real benchmark (envs/alfworld_data.py, envs/webshop_data.py)
    instead of the synthetic env from here on. A missing or malformed data folder (or split, eval_split included)
    ends the script in one line. single_turn: the synthetic env's one-decision task (03's --single_turn)."""
    if single_turn and data:
        raise SystemExit("error: --single_turn plays the synthetic envs only; leave out --data")
    if not data:
        configure(env_name, **({"single_turn": True} if single_turn else {}))  # whatever an earlier call set
        return
    configure(env_name, data=data, split=split, **({"goals": goals} if env_name == "webshop" else {}))
    try:
        for s in {split, eval_split or split}:
            make_env(env_name, split=s)
    except DataError as e:
        raise SystemExit(f"error: {e}")


def env_pool(env_name, n, env_kw=None):
    """Reuse env objects across calls: building an ALFWorld env loads a planner library (~0.1 s each). One pool per
    env configuration (envs.configure's defaults, then env_kw, e.g. {"split": "valid_seen"} on real data)."""
    kw = {**ENV_DEFAULTS.get(env_name, {}), **(env_kw or {})}
    pool = _POOL.setdefault((env_name, json.dumps(kw, sort_keys=True)), [])
    while len(pool) < n:
        pool.append(make_env(env_name, **kw))
    return pool[:n]


def play(model, tok, env_name, seeds, group_size=1, temperature=1.0, max_steps=None, history_length=2,
         max_new_tokens=64, progress=False, share=True, env_kw=None, merge=True, lean=True, scores=False):
    """Run len(seeds) x group_size episodes in lock step, one batched sampling call per env step (share: the
    prefill's; merge: sample from the merged LoRA weights, merged_lora(); lean: sample() instead of transformers'
    generate, the same tokens; scores: each step also gets old_logp, entropy and hidden_mean from the sampling
    forwards, see sample(); needs lean).

    Returns one trajectory (dict) per episode: seed, group (index of its task), won, and steps, each step with the
    prompt text, response ids/text, the action, validity, env reward, the raw observation the step acted on (GiGPO's
    anchor state) and env extras. 02_rollouts.py adds log-probs, entropies and hidden states on top of this.
    """
    n = len(seeds) * group_size
    envs = env_pool(env_name, n, env_kw)
    cap = max_steps or envs[0].max_steps
    for e in envs:
        e.max_steps = cap
    trajs, state = [], []
    for i, env in enumerate(envs):
        obs, info = env.reset(seeds[i // group_size])
        trajs.append({"seed": seeds[i // group_size], "group": i // group_size, "won": False, "steps": [],
                      **({"task_type": info["task_type"]} if "task_type" in info else {})})
        state.append((obs, info, []))
    active = list(range(n))
    stops = set(eos_ids(tok))
    bar = range(cap)
    if progress:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"play {env_name}", leave=False)
    with merged_lora(model, merge):  # one merge for the whole rollout
        for _ in bar:
            if not active:
                break
            prompts = [chat(tok, build_prompt(env_name, state[i][1]["task"], state[i][0],
                                              state[i][1]["admissible_actions"], state[i][2], history_length))
                       for i in active]
            if lean:
                responses = sample(model, tok, prompts, temperature, max_new_tokens, share, scores)
                responses, scored = responses if scores else (responses, [{}] * len(prompts))
            else:
                responses, scored = generate(model, tok, prompts, temperature, max_new_tokens, share), [{}] * len(prompts)
            still = []
            for i, prompt, resp, sc in zip(active, prompts, responses, scored):
                obs, info, history = state[i]
                text = tok.decode(resp, skip_special_tokens=True)
                action, valid = parse_action(text, env_name)  # executed even when invalid: validity only costs 0.1
                next_obs, reward, done, next_info = envs[i].step(action)
                trajs[i]["steps"].append({
                    "prompt": prompt, "response_ids": resp, "response": text, "action": action, "valid": valid,
                    "reward": float(reward), "obs": obs, "done": bool(done),
                    "truncated": len(resp) >= max_new_tokens and resp[-1] not in stops,  # cut at max_new_tokens
                    "extras": {k: next_info.get(k) for k in ("hallucinated", "option_click", "score")
                               if k in next_info}, **sc})
                history = history + [(obs, action)]
                state[i] = (next_obs, next_info, history)
                if next_info.get("won"):
                    trajs[i]["won"] = True
                if not done:
                    still.append(i)
            active = still
    return trajs


def summarize(trajs):
    steps = [s for t in trajs for s in t["steps"]]
    verbs = Counter(command_verb(s["action"] or "") or "(none)" for s in steps)
    out = {"success": sum(t["won"] for t in trajs) / max(len(trajs), 1),
           "valid_ratio": sum(s["valid"] for s in steps) / max(len(steps), 1),
           "mean_steps": len(steps) / max(len(trajs), 1), "episodes": len(trajs),
           # the share of steps per command verb: how often a policy looks, goes, takes, clicks, searches
           "verbs": {v: n / len(steps) for v, n in sorted(verbs.items())}}
    types = sorted({t["task_type"] for t in trajs if "task_type" in t})
    if types:  # ALFWorld reports success per task type
        out["success_by_type"] = {k: [sum(t["won"] for t in trajs if t.get("task_type") == k),
                                      sum(t.get("task_type") == k for t in trajs)] for k in types}
    return out


# --------------------------------------------------------------------------------------------- mid-training (SFT)
PLACEHOLDER = "search[<your query>]"  # WebShop's search box: a form to fill in, not an action to take


def expert_demos(env_name, seeds, history_length, max_steps=None, detour=0.0, expert=None, format_noise=0.0,
                 idle_noise=0.0):
    """Prompt/response pairs from the env's expert policy, as a datasets.Dataset.

    detour > 0 adds DAgger-style recoveries: before a recorded step, with probability `detour`, the episode first
    takes a random admissible action that is not the expert's (not recorded, but shown in the history), and the
    expert's way back from there is recorded. Without it every demo is a straight path: the WebShop expert clicks
    the one fitting product using facts the results page hides (its options), so a model trained on straight paths
    never sees an item that does not fit, never learns `< prev`, and RL cannot sample a recovery it gives ~0 chance.
    expert: the env's expert (WebShop: "oracle", the default of build_base, "browse" or "visible"; ALFWorld:
    "oracle" or "search"; None: the env's default).
    format_noise: the share of recorded responses that leave out the opening <think> tag: still playable (the
    action tags are intact), but invalid, so the base pays the -0.1 penalty now and then and RL has a format to
    learn (the paper's Phase 1).
    idle_noise: before a recorded step, with this probability, the demo first records the env's idle command
    (ALFWorld's `look`: a valid step that changes nothing) and plays it; the expert's step follows. A base that
    imitates it wastes steps against the step cap, a habit that only the task reward tells it to drop. The demos
    get twice the env's step cap (unless max_steps is given), so that the looks do not cut the expert's path short."""
    from datasets import Dataset
    if idle_noise and env_name not in IDLE:
        raise ValueError(f"idle_noise: {env_name} has no idle command (only {', '.join(IDLE)})")
    rows = []
    env = make_env(env_name, **({"expert": expert} if expert else {}))
    if max_steps:
        env.max_steps = max_steps
    elif idle_noise:  # the looks must not cut the expert's path short
        env.max_steps *= 2
    for seed in seeds:
        rng = random.Random(1_000_003 * seed + 17)
        noise = random.Random(7_919 * seed + 3)  # its own stream: format_noise 0 leaves the demos as they were
        idle = random.Random(104_729 * seed + 11)  # and idle_noise's
        obs, info = env.reset(seed)
        history, done, detoured, idled = [], False, False, False
        while not done and info.get("expert_action"):
            action = info["expert_action"]
            others = [a for a in info["admissible_actions"]
                      if a not in (action, PLACEHOLDER, "click[buy now]")]
            if detour and not detoured and others and rng.random() < detour:
                action, detoured = rng.choice(others), True  # a step off the path; the expert's recovery is recorded
            else:
                if (idle_noise and not idled and IDLE.get(env_name) in info["admissible_actions"]
                        and idle.random() < idle_noise):
                    action, idled = IDLE[env_name], True  # recorded; the expert's step follows
                else:
                    detoured = idled = False
                rows.append({"env": env_name, "seed": seed,
                             "prompt": build_prompt(env_name, info["task"], obs, info["admissible_actions"], history,
                                                    history_length),
                             "response": malformed(expert_response(env_name, info["task"], action))
                             if format_noise and noise.random() < format_noise
                             else expert_response(env_name, info["task"], action)})
            history.append((obs, action))
            obs, _, done, info = env.step(action)
    return Dataset.from_list(rows)


def demo_pairs(tok, dataset, max_len=1024):
    """Demo rows -> prompt_ids (chat-templated, cut from the left to fit max_len) and response_ids (eos kept)."""
    pairs = []
    for row in dataset:
        p = tok(chat(tok, row["prompt"]), add_special_tokens=False)["input_ids"]
        r = tok(row["response"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        pairs.append({"prompt_ids": p[-(max_len - len(r)):], "response_ids": r})
    return pairs


def sft(model, tok, dataset, steps, lr, batch_size, seed, max_len=1024, progress=True, prompt_weight=0.0,
        micro_batch=4, ckpt=None, ckpt_every=50):
    """NLL on expert demos: response tokens, plus `prompt_weight` x the mean NLL of the prompt tokens.

    The prompt term is plain language modelling on env text. Prompts repeat their own strings (product ids, queries,
    objects appear in the observation, the admissible list and the history), so predicting them rewards copying
    from the context; with response-only loss the tiny model memorised training ids and queries instead of copying.
    Each batch runs as length-sorted micro-batches whose gradients add up to the batch's: padding 16 random demos
    to the longest cost 1.8 s a step in the default build, sorted micro-batches of 4 cost 1.1 s.
    ckpt: a file that holds the weights, optimizer, schedule and sampler every `ckpt_every` steps; a build killed
    midway resumes from it and ends with the same weights as one that ran through (a long build on a CPU outlives
    a shell). It records what it was started with, so a file from another build is not resumed.
    Returns the list of response losses."""
    if steps <= 0:
        return []
    from tqdm import tqdm
    rng = random.Random(seed)
    pairs = demo_pairs(tok, dataset, max_len)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    model.train()
    body, head = body_and_head(model)
    losses, start = [], 0
    setup = ckpt and sft_setup(model, tok, dataset, steps, lr, batch_size, seed, prompt_weight)
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if state["setup"] == setup:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            rng.setstate(state["rng"])
            losses, start = state["losses"], state["step"]
            if progress:
                print(f"mid-training SFT resumes at step {start} from {ckpt}", flush=True)
    for step in tqdm(range(start, steps), desc="mid-training SFT", disable=not progress, initial=start, total=steps):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        # the loss is a mean over the whole batch's tokens, so each micro-batch divides by the batch's counts
        n_resp = sum(len(p["response_ids"]) for p in batch)
        n_prompt = max(sum(len(p["prompt_ids"]) - 1 for p in batch), 1)
        opt.zero_grad()
        resp_loss = 0.0
        for part in micro_batches(batch, micro_batch):
            b = pack(tok, part)
            hidden = body(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state[:, :-1]
            nll = Fn.cross_entropy(head(hidden).flatten(0, 1).float(), b["input_ids"][:, 1:].flatten(),
                                   reduction="none").view(hidden.shape[:2])
            resp, prompt = shifted_masks(b)
            loss = (nll * resp).sum() / n_resp
            resp_loss += loss.item()
            if prompt_weight:
                loss = loss + prompt_weight * (nll * prompt).sum() / n_prompt
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(resp_loss)
        if ckpt and (step + 1) % ckpt_every == 0 and step + 1 < steps:
            torch.save({"setup": setup, "model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "rng": rng.getstate(), "losses": losses, "step": step + 1},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)  # atomic: a kill mid-save leaves the previous checkpoint
    model.eval()
    return losses


def sft_setup(model, tok, dataset, steps, lr, batch_size, seed, prompt_weight):
    """What an SFT checkpoint must match to be resumed: the run's settings, the vocabulary and the demo rows."""
    digest = hashlib.sha256(json.dumps([tok.get_vocab(), dataset[:]], sort_keys=True, default=str).encode())
    return {"steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed, "prompt_weight": prompt_weight,
            "n_params": sum(p.numel() for p in model.parameters()), "data": digest.hexdigest()}


@dataclass
class Args:
    env: str = "alfworld"
    """the env whose formats to show: alfworld or webshop"""
    seed: int = 0
    """the task (env seed) whose first steps are shown"""
    steps: int = 2
    """expert steps to play before the prompt that is shown (its history then has that many records)"""
    history_length: int = 2
    """verl-agent shows the last 5 steps; 2 keeps prompts CPU-sized (use 5 for a real model)"""


def main(argv=None):
    """A prompt as the agent reads it, the expert's response, a malformed one, and what the parser makes of each."""
    args = parse_args(Args, argv)
    if args.env not in ENVS:
        raise SystemExit(f"error: unknown env {args.env!r}; choose from {', '.join(sorted(ENVS))}")
    env = make_env(args.env)
    obs, info = env.reset(args.seed)
    history = []
    for _ in range(args.steps):
        if not info.get("expert_action"):
            break
        history.append((obs, info["expert_action"]))
        obs, _, done, info = env.step(info["expert_action"])
    print(build_prompt(args.env, info["task"], obs, info["admissible_actions"], history, args.history_length))
    good = expert_response(args.env, info["task"], info.get("expert_action") or "look")
    for response in (good, malformed(good), "I will look around."):
        action, valid = parse_action(response, args.env)
        print(f"\nresponse: {response}\n  -> action {action!r}, valid {valid}"
              + ("" if valid else f" (penalty -{INVALID_PENALTY})"))
    return good


if __name__ == "__main__":
    main()
