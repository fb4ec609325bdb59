"""Text environments for agent RL, one interface for all of them.

    obs, info = env.reset(seed)                 # seeded, deterministic task
    obs, reward, done, info = env.step(action)  # action: plain command string, or None

`action` is the command the parser in 01_formats.py projected out of the model's response. As in verl-agent the
env always receives it, valid format or not: the -0.1 format penalty is the trainer's business (GiGPO subtracts it
after computing discounted returns), and rewards returned by the env are the task rewards only (10 on success, else
0). None is accepted as a no-op (info["is_action_valid"] = False) for callers that want to skip a step.

info always has:
    task                str        the instruction ("Your task is to: ...", or the shop instruction)
    admissible_actions  list[str]  commands that do something in the current state
    won                 bool       the task is solved
    is_action_valid     bool       False only when step() got None (the trainer's validity is the parser's)
    expert_action       str|None   the next command of the expert policy from the current state (None when done)
and env.max_steps is the episode cap (ALFWorld 25... runners may lower it).
"""
from importlib import import_module

ENVS = {"alfworld": ("envs.alfworld", "AlfWorldEnv"), "webshop": ("envs.webshop", "WebShopEnv")}


def make_env(name, **kwargs):
    """Build an env by name; an unknown name is a clear ValueError, not a KeyError deep inside."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; choose one of: {', '.join(sorted(ENVS))}")
    module, cls = ENVS[name]
    return getattr(import_module(module), cls)(**kwargs)
