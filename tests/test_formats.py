import dataclasses
import os

import pytest

from conftest import load
from envs import make_env

F = load("01_formats")
B = load("base.build")


def reference_projection(text, env_name):
    """verl-agent's alfworld/webshop projection, step by step as shared/README.md states it (not our parser)."""
    low = text.lower()
    start = low.find("<action>")
    end = low.find("</action>")
    if start == -1 or end == -1:
        tail = 30 if env_name == "alfworld" else 20
        return low[-tail:], False
    action = low[start + 8:end].strip()
    valid = True
    if text.find("<think>") == -1 or text.find("</think>") == -1:
        valid = False
    for ch in text:
        if "\u4e00" <= ch <= "\u9fff":
            valid = False
    return action, valid


LONG = "I keep thinking about it but never close the tag, then Go To Desk 1"
CASES = [
    ("<think>go</think><action>go to desk 1</action>", "go to desk 1", True),
    ("<think>x</think><action>  Take Apple 1 From Desk 1 \n</action>", "take apple 1 from desk 1", True),
    ("<THINK>x</THINK><ACTION>look</ACTION>", "look", False),           # action tags any case, think tags exact
    ("<think>x</think><ACTION>Look</Action>", "look", True),
    ("</think>x<think><action>look</action>", "look", True),           # think order is not checked
    ("<action>look</action>", "look", False),                           # no think: action read, but invalid
    ("<think>unclosed <action>look</action>", "look", False),
    ("<think>a</think><action>look", "<think>a</think><action>look", False),  # unclosed action: the tail is sent
    ("<think>a</think>look", "<think>a</think>look", False),
    ("", "", False),
    ("<think>a</think><action></action>", "", True),                    # empty action is well-formed
    ("<think>a</think><action>go to 桌子</action>", "go to 桌子", False),   # CJK rule
    ("<think>a</think><action>one</action><action>two</action>", "one", True),  # the first pair wins
    ("</action><think>a</think><action>x</action>", "", True),         # </action> before <action>: empty action
]


@pytest.mark.parametrize("text,action,valid", CASES)
def test_parse_action(text, action, valid):
    assert F.parse_action(text, "alfworld") == (action, valid) == reference_projection(text, "alfworld")


def test_missing_tags_send_the_last_30_or_20_characters():
    assert F.parse_action(LONG, "alfworld") == (LONG.lower()[-30:], False)
    assert F.parse_action(LONG, "webshop") == (LONG.lower()[-20:], False)
    assert F.parse_action(LONG + "</action>", "webshop") == ((LONG + "</action>").lower()[-20:], False)


def test_parser_matches_the_reference_on_random_text():
    import random
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<action>", "</action>", "<ACTION>", "</THINK>", "look", " Go To Desk 1 ", "\n",
              "桌", "click[buy now]", "x" * 25]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        for env_name in ("alfworld", "webshop"):
            assert F.parse_action(text, env_name) == reference_projection(text, env_name), text


def test_prompt_history_window():
    hist = [(f"obs{i}", f"act{i}") for i in range(6)]
    p = F.build_prompt("alfworld", "Your task is to: put a mug in desk.", "now", ["look", "go to desk 1"], hist, 2)
    assert ("Your task is to: put a mug in desk.\nPrior to this step, you have already taken 6 step(s). Below are the "
            "most recent 2 observations and the corresponding actions you took: [Observation 5: 'obs4', Action 5: "
            "'act4']\n[Observation 6: 'obs5', Action 6: 'act5']\nYou are now at step 7 and your current observation "
            "is: now\nYour admissible actions of the current situation are: ['look'\n 'go to desk 1'].\n") in p
    assert "obs3" not in p and "<think> </think> tags. \nOnce" in p
    first = F.build_prompt("alfworld", "Your task is to: put a mug in desk.", "You are in a room. Your task is to: "
                           "put a mug in desk.", ["look"], [], 2)
    assert first.startswith("\nYou are an expert agent operating in the ALFRED Embodied Environment.\nYour current "
                            "observation is: You are in a room.") and "step(s)" not in first
    assert F.build_prompt("alfworld", "t", "o", ["look"], hist, 0) == F.build_prompt("alfworld", "t", "o", ["look"],
                                                                                    [], 2)


def test_webshop_prompt_wording_and_observation_format():
    task = "i need a red hat"
    obs = f"Instruction: [SEP] {task} [SEP] Back to Search [SEP] Page 1 (Total results: 1) [SEP] b0abc [SEP] Hat"
    first = F.build_prompt("webshop", task, f"WebShop [SEP] Instruction: [SEP] {task} [SEP] Search",
                           ["search[<your query>]"], [], 2)
    assert first.startswith("\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce "
                            "environment. \nYour task is to: i need a red hat.\nYour current observation is: "
                            "'Search'.\nYour admissible actions of the current situation are: \n[\n"
                            "'search[<your query>]',\n].\n\nNow it's your turn to take one action")
    p = F.build_prompt("webshop", task, obs, ["click[back to search]", "click[b0abc]"],
                       [(f"WebShop [SEP] Instruction: [SEP] {task} [SEP] Search", "search[red hat]")], 2)
    assert ("environment.\nYour task is to: i need a red hat.\nPrior to this step, you have already taken 1 step(s). "
            "Below are the most recent 1 observations and the corresponding actions you took: [Observation 1: "
            "''Search'', Action 1: 'search[red hat]']\nYou are now at step 2 and your current observation is: "
            "'Back to Search' [SEP] 'Page 1 (Total results: 1)' [SEP] 'b0abc' [SEP] 'Hat'.\n"
            "Your admissible actions of the current situation are: \n[\n'click[back to search]',\n'click[b0abc]',"
            "\n].\n") in p  # the history shows the formatted observation inside its own quotes, as verl-agent's
    done = "Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 1.00"
    assert F.view("webshop", task, done) == done and F.view("alfworld", task, obs) == obs


def test_expert_response_parses_back():
    for env, action in [("alfworld", "heat egg 1 with microwave 1"), ("webshop", "click[buy now]"),
                        ("webshop", "search[red shoes]")]:
        assert F.parse_action(F.expert_response(env, "do the thing.", action), env) == (action, True)


def test_detour_demos_record_the_expert_recovery():
    import re
    straight = F.expert_demos("webshop", range(40), 2)
    assert not any("< prev" in r["response"] for r in straight)
    rows = F.expert_demos("webshop", range(40), 2, detour=0.5)
    assert rows.to_list() == F.expert_demos("webshop", range(40), 2, detour=0.5).to_list()  # seeded
    assert len(rows) > len(straight)
    backs = [r for r in rows if F.parse_action(r["response"], "webshop")[0] == "click[< prev]"]
    assert len(backs) >= 5
    env = make_env("webshop")
    for seed in sorted({r["seed"] for r in rows}):  # replay: every detour is off the expert's path, every row on it
        _, info = env.reset(seed)
        taken = 0
        for r in [r for r in rows if r["seed"] == seed]:
            shown = int(re.search(r"already taken (\d+) step", r["prompt"]).group(1)) if taken else 0
            if shown == taken + 1:  # one unrecorded step since the last row: the detour, last in the history
                detour = re.findall(r"Action \d+: '([^']*)'\]", r["prompt"])[-1]
                assert detour != info["expert_action"] and detour in info["admissible_actions"]
                _, _, _, info = env.step(detour)
                taken += 1
            assert shown == taken and F.parse_action(r["response"], "webshop") == (info["expert_action"], True)
            _, _, _, info = env.step(info["expert_action"])
            taken += 1


def test_unknown_env_is_a_clear_error():
    with pytest.raises(ValueError, match="alfworld, webshop"):
        make_env("minecraft")


def test_saved_base_reloads_with_the_same_token_ids(tmp_path):
    """AutoTokenizer would map a qwen2 config to Qwen2Tokenizer and re-split the text: a reloaded base then reads
    other ids than it was trained on (held-out ALFWorld success fell from 6/32 to 0/32 that way)."""
    text = "<|im_start|>user\nYou see a cabinet 1, a countertop 2.\nYour task is to: put a clean apple in fridge.<|im_end|>\n"
    tok = F.train_tokenizer([text] * 20, 400)
    model = F.tiny_model(len(tok), 0, layers=1, hidden=64)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    (tmp_path / "base.json").write_text("{}")
    _, tok2 = F.load_pretrained(str(tmp_path))
    assert tok2(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert tok2.pad_token == tok.pad_token and tok2.padding_side == "left" and F.chat(tok2, "x") == F.chat(tok, "x")


def _nll_split(model, tok, pairs):
    """(response NLL, prompt NLL) of the batch, both token means, recomputed outside sft()."""
    import torch
    import torch.nn.functional as Fn
    b = F.pack(tok, pairs)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    nll = Fn.cross_entropy(logits.flatten(0, 1), b["input_ids"][:, 1:].flatten(), reduction="none").view(
        logits.shape[:2])
    resp, prompt = F.shifted_masks(b)
    return ((nll * resp).sum() / resp.sum()).item(), ((nll * prompt).sum() / prompt.sum()).item()


def test_sft_prompt_weight_trains_the_prompt_tokens_too():
    data = F.expert_demos("webshop", range(4), 2)
    tok = F.train_tokenizer([F.CHATML_EXAMPLE.format(**r) for r in data], 400)
    pairs = F.demo_pairs(tok, data)
    out = {}
    for w in (0.0, 1.0):
        model = F.tiny_model(len(tok), 0, layers=1, hidden=64)
        before = _nll_split(model, tok, pairs)
        losses = F.sft(model, tok, data, 30, 3e-3, 4, 0, progress=False, prompt_weight=w)
        out[w] = (before, _nll_split(model, tok, pairs), losses)
    (b0, a0, l0), (b1, a1, l1) = out[0.0], out[1.0]
    assert b0 == b1  # same init
    assert a0[0] < b0[0] and a1[0] < b1[0]  # both learn the responses
    assert a1[1] < a0[1] - 0.5  # only the weighted run learns the prompt text
    assert len(l1) == 30 and l1[-1] < l1[0]  # what sft() reports is the response NLL, and it falls


def test_sft_micro_batches_give_the_same_step_as_one_batch():
    import torch
    data = F.expert_demos("webshop", range(4), 2, detour=0.3)
    tok = F.train_tokenizer([F.CHATML_EXAMPLE.format(**r) for r in data], 400)
    params, losses = [], []
    for micro in (0, 3):  # 0 = the whole batch at once; 3 does not divide 8, so the last micro-batch is short
        model = F.tiny_model(len(tok), 0, layers=1, hidden=64).double()
        losses.append(F.sft(model, tok, data, 3, 3e-3, 8, 0, progress=False, prompt_weight=1.0, micro_batch=micro))
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert (params[0] - params[1]).abs().max() < 1e-10
    assert abs(losses[0][-1] - losses[1][-1]) < 1e-5  # sft() takes the NLL in float32
    before = torch.cat([p.detach().flatten() for p in F.tiny_model(len(tok), 0, layers=1, hidden=64).parameters()])
    assert (params[0] - before.double()).abs().max() > 1e-4  # the steps did move the weights


def test_an_invalid_format_response_with_a_winning_action_still_wins(monkeypatch):
    """verl-agent executes the projected action whatever the format: no <think> costs 0.1, not the episode."""
    env = make_env("webshop")
    _, info = env.reset(7)
    plan = []
    while info["expert_action"]:
        plan.append(info["expert_action"])
        _, _, _, info = env.step(plan[-1])
    assert info["won"]

    class Tok:
        eos_token_id = unk_token_id = None

        def convert_tokens_to_ids(self, token):
            return None

        def apply_chat_template(self, messages, **kw):
            return messages[0]["content"]

        def decode(self, ids, **kw):
            return ids

    replies = iter(f"<action>{a.upper()}</action>" for a in plan)  # no think tags, upper case
    monkeypatch.setattr(F, "sample", lambda model, tok, prompts, *a, **k: [next(replies) for _ in prompts])
    traj, = F.play(None, Tok(), "webshop", [7], temperature=1.0)
    assert traj["won"] and len(traj["steps"]) == len(plan) and not any(s["valid"] for s in traj["steps"])
    assert [s["action"] for s in traj["steps"]] == plan and traj["steps"][-1]["reward"] == 10.0
    assert f"Action 1: '{plan[0]}']" in traj["steps"][1]["prompt"]  # the history records the projected action


SHIPPED = sorted(d for d in os.listdir(os.path.join(F.ROOT, "base"))
                 if os.path.isfile(os.path.join(F.ROOT, "base", d, "base.json")))


def test_shipped_base_is_the_default_build():
    """base/tiny is what `python base/build.py --force` builds: its recorded settings are today's defaults."""
    import dataclasses
    import json
    with open(os.path.join(F.ROOT, "base", "tiny", "base.json")) as f:
        built = json.load(f)["args"]
    now = dataclasses.asdict(B.Args())
    differ = {k: (built.get(k), now.get(k)) for k in set(built) | set(now)
              if k not in ("out_dir", "force", "name") and built.get(k) != now.get(k)}
    assert not differ, f"the shipped base was built with other settings (built, now): {differ}"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_base_was_built_by_todays_code(name):
    """The bases in base/ are committed so that no run has to build them. If prompts, envs or experts change, this
    fails until the base is rebuilt with the settings its base.json records (`python base/build.py --force ...`)
    and committed again."""
    import json
    path = os.path.join(F.ROOT, "base", name)
    with open(os.path.join(path, "base.json")) as f:
        report = json.load(f)
    known = {f.name for f in dataclasses.fields(B.Args)}
    args = B.Args(**{k: v for k, v in report["args"].items() if k in known})
    assert set(report["args"]) <= known, "base.json names a setting base/build.py no longer has"
    _, tok = F.load_pretrained(path)
    fresh = B.fingerprint(args, tok)
    assert fresh["demo_digest"] == report["demo_digest"], "demo prompts changed since the base was built"
    assert fresh["probe_text"] == report["probe_text"]
    assert tok(report["probe_text"], add_special_tokens=False)["input_ids"] == report["probe_ids"]


def test_format_noise_breaks_the_format_of_that_share_and_keeps_the_action():
    clean = F.expert_demos("alfworld", range(30), 2).to_list()
    noisy = F.expert_demos("alfworld", range(30), 2, format_noise=0.3).to_list()
    assert [r["prompt"] for r in clean] == [r["prompt"] for r in noisy]  # the same episodes
    broken = [(c, n) for c, n in zip(clean, noisy) if c != n]
    assert 0.2 < len(broken) / len(clean) < 0.4
    for c, n in broken:
        assert F.parse_action(c["response"]) == (F.parse_action(n["response"])[0], True)
        assert F.parse_action(n["response"])[1] is False
    assert F.expert_demos("alfworld", range(30), 2, format_noise=0.0).to_list() == clean


def test_summarize_counts_the_share_of_steps_per_command_verb():
    step = lambda a: {"action": a, "valid": a is not None}  # noqa: E731
    trajs = [{"won": True, "steps": [step("look"), step("go to shelf 1")]},
             {"won": False, "steps": [step(None), step("look")]}, {"won": False, "steps": [step("click[buy now]")]}]
    m = F.summarize(trajs)
    assert m["verbs"] == {"(none)": 0.2, "click": 0.2, "go": 0.2, "look": 0.4}
    assert (m["success"], m["valid_ratio"], m["mean_steps"]) == (pytest.approx(1 / 3), 0.8, pytest.approx(5 / 3))


def test_idle_noise_records_a_look_before_that_share_of_steps_and_the_expert_goes_on():
    clean = F.expert_demos("alfworld", range(30), 2).to_list()
    noisy = F.expert_demos("alfworld", range(30), 2, idle_noise=0.3).to_list()
    act = lambda r: F.parse_action(r["response"])[0]  # noqa: E731
    looks = [i for i, r in enumerate(noisy) if act(r) == "look"]
    assert 0.15 < len(looks) / len(clean) < 0.45
    assert all(F.parse_action(noisy[i]["response"])[1] for i in looks)  # a valid step
    assert all(act(noisy[i + 1]) != "look" for i in looks)  # at most one in a row, then the expert's step
    # without the looks, every episode takes the expert's steps to its end
    by_seed = lambda rows: {s: [act(r) for r in rows if r["seed"] == s and act(r) != "look"] for s in range(30)}  # noqa: E731
    assert by_seed(noisy) == by_seed(clean)
    assert F.expert_demos("alfworld", range(30), 2, idle_noise=0.0).to_list() == clean
    with pytest.raises(ValueError, match="no idle command"):
        F.expert_demos("webshop", range(2), 2, idle_noise=0.3)


def test_sft_killed_midway_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """A build killed between checkpoints resumes from the last one and ends where an unbroken build ends."""
    import torch
    data = F.expert_demos("webshop", range(4), 2)
    tok = F.train_tokenizer([F.CHATML_EXAMPLE.format(**r) for r in data], 400)
    run = lambda model, **kw: F.sft(model, tok, data, 7, 3e-3, 4, 0, progress=False, **kw)  # noqa: E731
    flat = lambda model: torch.cat([p.detach().flatten() for p in model.parameters()])  # noqa: E731
    whole = F.tiny_model(len(tok), 0, layers=1, hidden=64).double()
    losses = run(whole)
    ckpt = str(tmp_path / "sft.pt")
    step, calls = torch.optim.AdamW.step, []

    def dies_at_the_fifth_step(self, *a, **kw):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return step(self, *a, **kw)
    monkeypatch.setattr(torch.optim.AdamW, "step", dies_at_the_fifth_step)
    killed = F.tiny_model(len(tok), 0, layers=1, hidden=64).double()
    with pytest.raises(KeyboardInterrupt):
        run(killed, ckpt=ckpt, ckpt_every=2)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    assert torch.load(ckpt, weights_only=False)["step"] == 4
    resumed = F.tiny_model(len(tok), 0, layers=1, hidden=64).double()  # a fresh process starts from the init
    assert run(resumed, ckpt=ckpt, ckpt_every=2) == losses
    assert (flat(resumed) - flat(whole)).abs().max() < 1e-12
    other = F.tiny_model(len(tok), 0, layers=1, hidden=64).double()  # other settings: the file is not resumed
    F.sft(other, tok, data, 7, 1e-3, 4, 0, progress=False, ckpt=ckpt, ckpt_every=2)
    assert (flat(other) - flat(whole)).abs().max() > 1e-4
