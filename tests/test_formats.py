import pytest

from conftest import load
from envs import make_env

F = load("01_formats")


@pytest.mark.parametrize("text,action,valid", [
    ("<think>go</think><action>go to desk 1</action>", "go to desk 1", True),
    ("<think>x</think><action>  Take Apple 1 From Desk 1 \n</action>", "take apple 1 from desk 1", True),
    ("<THINK>x</THINK><ACTION>look</ACTION>", "look", True),            # tags are matched case-insensitively
    ("<action>look</action>", "look", False),                           # no think: action read, but invalid
    ("<think>unclosed <action>look</action>", "look", False),
    ("<think>a</think><action>look", None, False),                      # unclosed action
    ("<think>a</think>look", None, False),
    ("", None, False),
    ("<think>a</think><action></action>", "", True),                    # empty action is well-formed
    ("<think>a</think><action>go to 桌子</action>", "go to 桌子", False),   # CJK rule
    ("<think>a</think><action>one</action><action>two</action>", "one", True),  # the first pair wins
    ("</action><think>a</think><action>x</action>", "x", True),        # a stray close before the open is skipped
])
def test_parse_action(text, action, valid):
    assert F.parse_action(text) == (action, valid)
    assert F.env_action(text) == (action if valid else None)


def test_prompt_history_window():
    hist = [(f"obs{i}", f"act{i}") for i in range(6)]
    p = F.build_prompt("alfworld", "put a mug in desk.", "now", ["look", "go to desk 1"], hist, 2)
    assert "[Observation 5: 'obs4', Action 5: 'act4']" in p and "[Observation 6: 'obs5', Action 6: 'act5']" in p
    assert "obs3" not in p and "already taken 6 step(s)" in p and "step 7" in p
    assert "['look', 'go to desk 1']" in p and "<think> </think>" in p
    first = F.build_prompt("webshop", "buy socks", "WebShop [SEP] Search", ["search[<query>]"], [], 2)
    assert "Your task is to: buy socks." in first and "'search[<query>]'" in first and "Observation 1" not in first


def test_expert_response_parses_back():
    for env, action in [("alfworld", "heat egg 1 with microwave 1"), ("webshop", "click[buy now]"),
                        ("webshop", "search[red shoes]")]:
        assert F.parse_action(F.expert_response(env, "do the thing.", action)) == (action, True)


def test_detour_demos_record_the_expert_recovery():
    import re
    straight = F.expert_demos("webshop", range(40), 2)
    assert not any("< prev" in r["response"] for r in straight)
    rows = F.expert_demos("webshop", range(40), 2, detour=0.5)
    assert rows.to_list() == F.expert_demos("webshop", range(40), 2, detour=0.5).to_list()  # seeded
    assert len(rows) > len(straight)
    backs = [r for r in rows if F.parse_action(r["response"])[0] == "click[< prev]"]
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
            assert shown == taken and F.parse_action(r["response"]) == (info["expert_action"], True)
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
