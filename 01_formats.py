"""01 - Formats: prompts, the <think>/<action> parser, the embedded tiny Qwen agent and its mid-training.

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
byte-level BPE trained here on environment text. It is "mid-trained" (as the paper mid-trains Llama) by SFT on expert
demonstrations, minimising the response-token negative log-likelihood plus w (default 1) times the prompt's own
    L_SFT = - (1 / |y|) * sum_t log pi(y_t | x, y_<t)  -  w * (1 / |x|) * sum_t log pi(x_t | x_<t),
so that it learns the format and part of the skill, leaving room for RL. (The prompt term teaches copying: prompts
repeat their product ids, queries and objects; without it the tiny model memorised training ids instead.) The
WebShop demos come from the oracle expert, which clicks the fitting product using what the results page hides (the
base built on it wins 21/512 WebShop test tasks); --webshop_expert browse opens the hits in rank order and goes back
from items that do not fit, using only what the agent is shown (a base built on it won 0/32 held-out tasks).
A real checkpoint (`--model Qwen/Qwen2.5-1.5B-Instruct` or a local folder) goes through the same load -> (SFT) ->
LoRA path.

Prompt sharing (pack_shared, shared_prefill; on by default, --share_prefix false in 03 turns it off). The G episodes
of a task start in the same state and often stay together, so many steps of a batch have the same prompt. Each
distinct prompt runs through the network once; its keys/values are copied to every response that continues it and
the responses run on top, at the positions they would have had. Exact, not an approximation: a response token
attends to the same prompt keys/values with the same RoPE positions either way (padding is masked), and in the
update the copies are autograd views, so the gradient through a shared prompt is the sum of its samples' gradients.
Only the floating-point summation order differs (tests/test_share.py: equal to 1e-8 in float64). The reference runs
every sample's own copy (it shares nothing). The prompts of a shared batch are right-padded and run without a padding
mask: under the causal mask no real token sees a pad, so attention takes its causal fast path.

Merged LoRA for the no-grad policy passes (merged_lora; on by default, --merge_lora false in 03 turns it off): the
rollout and the old log-probs run on W + s B A with the adapter off, the same function without the rank-16 side
matmuls (a quarter of a forward pass on the tiny model), as trainers that hand a LoRA policy to vLLM pass it merged
weights (TRL's GRPOTrainer: merge_adapter, copy, unmerge_adapter). The update and the reference pass keep the adapter.

    python 01_formats.py                      # build + mid-train the tiny base, report valid ratio / success
    python 01_formats.py --sft_steps 0 --model ./my_qwen   # evaluate a local checkpoint as it is
    python 01_formats.py --alfworld_data $ALFWORLD_DATA --webshop_data ./webshop/data   # mid-train on the real
        benchmarks' expert demos -> base/tiny-real; then 02-05 with --model base/tiny-real --data ...
"""
import contextlib
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, asdict

import torch
import torch.nn.functional as Fn

from envs import make_env, ENVS, DEFAULTS as ENV_DEFAULTS, DataError, configure

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


def expert_response(env_name, task, action):
    """The demonstration the tiny model imitates: one short reasoning sentence, then the expert's command.

    The sentence names the kind of move, not its arguments, so the only thing to copy from the prompt is the action.
    """
    verb = action.split("[")[0].split(" ")[0]
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


ALF_VERBS = {"go": "go to a place", "take": "take the object", "move": "put the object down", "open": "open it",
             "close": "close it", "clean": "clean the object", "heat": "heat the object", "cool": "cool the object",
             "use": "turn on the light", "examine": "examine the object", "look": "look around",
             "inventory": "check my inventory"}


# --------------------------------------------------------------------------------------------- tokenizer + model
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chat(tok, prompt):
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def train_tokenizer(texts, vocab_size):
    """Byte-level BPE (Qwen's scheme) trained on env text, so prompts stay short for a CPU-sized model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  padding_side="left")
    tok.chat_template = CHATML
    return tok


def tiny_model(vocab_size, seed, layers=2, hidden=128):
    """A Qwen2 architecture shrunk to CPU size: same blocks (RMSNorm, GQA, RoPE, SwiGLU), random init."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64,
                      max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    return Qwen2ForCausalLM(cfg)


def resolve_dtype(name="auto"):
    """--dtype: 'auto' = bfloat16 on a GPU, float32 on the CPU (where bfloat16 matmuls are slow and gain nothing)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if name not in ("bfloat16", "float32", "float64"):
        raise SystemExit(f"error: --dtype must be auto, bfloat16, float32 or float64, got {name!r}")
    return getattr(torch, name)


def load_pretrained(path, dtype=torch.float32, attn_implementation=None):
    """A real checkpoint or a saved base. One-line error instead of a deep traceback when it can't be found.
    attn_implementation: None = transformers' default (sdpa), or 'eager', 'flash_attention_2', ..."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    try:
        # Our own base: AutoTokenizer would see model_type qwen2 and swap in Qwen2Tokenizer's pre-tokenizer (regex
        # split + NFC), which encodes the same text into different ids than the BPE was trained and SFT'd on.
        own = os.path.exists(os.path.join(path, "base.json"))
        tok = (PreTrainedTokenizerFast if own else AutoTokenizer).from_pretrained(path)
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"error: cannot load model {path!r}: {first}")
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def add_lora(model, r=16, alpha=32, dropout=0.0):
    """LoRA on every linear map of the blocks; disabling the adapter gives back the reference policy."""
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, cfg)


@contextlib.contextmanager
def merged_lora(lm, merge=True):
    """Run the no-grad passes of the policy (rollout, old log-probs) on merged weights W + s B A with the adapter
    switched off: the same function (x W + s (x A^T) B^T = x (W + s B A)^T up to rounding), without the LoRA
    matmuls, which are a quarter of a forward pass on the tiny model (rank 16 next to width 128). The base weights
    are restored as the very tensors they were (no subtract-back, so no drift). Float32/64 only: in bf16 the sum
    W + s B A would round a young adapter's small delta away, so a model with any half-precision LoRA layer keeps
    the LoRA path everywhere (disable_adapter switches every layer off, so merging only some would drop the others).
    Costs a copy of the adapted weights while it runs; merge=False (--merge_lora false) skips it."""
    peft = merge and hasattr(lm, "disable_adapter")  # a plain model (or a stand-in) has nothing to merge
    layers = [m for m in lm.modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")] if peft else []
    full = all(m.get_base_layer().weight.dtype in (torch.float32, torch.float64) for m in layers)
    if not (layers and full):
        yield lm
        return
    saved = []
    try:
        with torch.no_grad():
            for m in layers:
                w = m.get_base_layer().weight
                delta = sum(m.get_delta_weight(a) for a in m.active_adapters if a in m.lora_A)
                saved.append((w, w.data))
                w.data = w.data + delta
        with lm.disable_adapter():
            yield lm
    finally:
        for w, data in saved:
            w.data = data


def eos_ids(tok):
    ids = {tok.eos_token_id}
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tok.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tok.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


# --------------------------------------------------------------------------------------------- batches
def body_and_head(lm):
    """(transformer body, unembedding) of a plain or LoRA-wrapped causal LM."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return base.model, base.lm_head


def response_hidden(lm, input_ids, attention_mask, gather_index, prefix=None):
    """Last-layer hidden states (after the final norm): (at the positions that predict the response tokens y_1..y_R,
    at the response tokens themselves). The second is one position later (y_R's is the end-of-turn token's): the
    states SEAL's head and the paper's representation analysis read.

    Applying the unembedding only at the first, not at every prompt position, is most of the cost saved on long
    prompts. pack() leaves room for the later index: a row's last response token sits inside the padded batch.
    """
    if prefix is not None:  # a pack_shared() batch
        return shared_response_hidden(lm, input_ids, attention_mask, gather_index, prefix)
    hidden = body_and_head(lm)[0](input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    idx = gather_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, idx), hidden.gather(1, idx + 1)


def shared_response_hidden(lm, ids, attn, positions, prefix):
    """response_hidden() for a pack_shared() batch, with the same two outputs.

    Each distinct prompt runs once; its keys/values are then copied to every sample that continues it (the cache's
    batch_select_indices) and the responses run on top. Exact: a response token attends to the same prompt keys and
    values either way (padding slots are masked), and RoPE sees the same positions. In the update the copies are
    views in the autograd graph, so the gradient through a shared prompt is the sum of its samples' gradients, as
    when every sample ran its own copy of the prompt.
    """
    body = body_and_head(lm)[0]
    # No padding mask on the prompt pass: the prompts are right-padded, so under the causal mask a real token never
    # sees a pad, and attention takes its causal fast path (no [U, P, P] mask, the upper triangle skipped). The pads'
    # keys/values are garbage but masked out below by the responses' attention_mask.
    out = body(input_ids=prefix["input_ids"], use_cache=True)
    cache = out.past_key_values
    cache.batch_select_indices(prefix["owner"])
    cont = body(input_ids=ids, attention_mask=attn, position_ids=positions, cache=cache,
                use_cache=True).last_hidden_state
    first = out.last_hidden_state[prefix["owner"], prefix["last"]]  # the prompt's last state predicts y_1
    return torch.cat([first.unsqueeze(1), cont[:, :-1]], 1), cont


def pack_shared(tok, samples, device="cpu"):
    """pack() that computes each distinct prompt once. The top-level keys describe the responses only (input_ids
    [B, R] right-padded, attention_mask [B, P + R] over prompt slots then response slots, gather_index = their RoPE
    positions, targets, mask as in pack()); `prefix` holds the distinct prompts, right-padded [U, P], which prompt
    each sample continues (owner) and that prompt's last position (last)."""
    uniq, owner = {}, []
    for s in samples:
        owner.append(uniq.setdefault(tuple(s["prompt_ids"]), len(uniq)))
    prompts = list(uniq)
    P, R = max(map(len, prompts)), max(len(s["response_ids"]) for s in samples)
    p_ids = torch.full((len(prompts), P), tok.pad_token_id, dtype=torch.long)
    p_attn = torch.zeros_like(p_ids)
    for u, p in enumerate(prompts):
        p_ids[u, :len(p)] = torch.tensor(p)
        p_attn[u, :len(p)] = 1
    ids = torch.full((len(samples), R), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(samples), P + R), dtype=torch.long)
    pos = torch.zeros_like(ids)
    mask = torch.zeros((len(samples), R))
    for b, (s, u) in enumerate(zip(samples, owner)):
        n, r = len(prompts[u]), s["response_ids"]
        ids[b, :len(r)] = torch.tensor(r)
        attn[b, :n] = 1
        attn[b, P:P + len(r)] = 1
        pos[b] = torch.arange(n, n + R)
        mask[b, :len(r)] = 1
    prefix = dict(input_ids=p_ids, attention_mask=p_attn, owner=torch.tensor(owner),
                  last=torch.tensor([len(prompts[u]) - 1 for u in owner]))
    out = dict(input_ids=ids, attention_mask=attn, gather_index=pos, targets=ids.clone(), mask=mask)
    out = {k: v.to(device) for k, v in out.items()}
    out["prefix"] = {k: v.to(device) for k, v in prefix.items()}
    return out


def pack(tok, samples, device="cpu"):
    """Right-padded prompt+response batch. samples: dicts with prompt_ids and response_ids."""
    lens = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    rmax = max(len(s["response_ids"]) for s in samples)
    ids = torch.full((len(samples), max(lens)), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    index = torch.zeros((len(samples), rmax), dtype=torch.long)
    targets = torch.full((len(samples), rmax), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(samples), rmax))
    for b, s in enumerate(samples):
        p, r = s["prompt_ids"], s["response_ids"]
        ids[b, :len(p) + len(r)] = torch.tensor(p + r)
        attn[b, :len(p) + len(r)] = 1
        index[b, :len(r)] = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        targets[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
    return {k: v.to(device) for k, v in
            dict(input_ids=ids, attention_mask=attn, gather_index=index, targets=targets, mask=mask).items()}



# --------------------------------------------------------------------------------------------- generation + play
def shared_prefill(model, enc, prompts, max_new_tokens):
    """The KV cache of all but the last token of every prompt, computed once per distinct prompt and copied to its
    rows (the G episodes of a task often stand in the same state). generate() then only runs the rest. Exact: the
    same keys and values at the same (left-padded) positions as generate's own prefill of every row.

    The copies go into a preallocated StaticCache: generate's default cache grows by concatenation, copying the whole
    cache at every new token (a first WebShop turn of 32 rows on the tiny model: 1.20 s -> 0.90 s)."""
    from transformers import StaticCache
    first = {}
    owner = torch.tensor([first.setdefault(p, len(first)) for p in prompts], device=enc["input_ids"].device)
    rows = torch.tensor([prompts.index(p) for p in first], device=owner.device)  # prompts: any keys, equal = shared
    attn = enc["attention_mask"][rows, :-1]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # generate's own position ids for left padding
    # the body, not the LM: only keys/values are needed, and logits at every prompt position cost a tenth of a turn
    body = body_and_head(model)[0]
    once = body(input_ids=enc["input_ids"][rows, :-1], attention_mask=attn, position_ids=pos,
                use_cache=True).past_key_values
    cache = StaticCache(config=body.config, max_cache_len=enc["input_ids"].shape[1] - 1 + max_new_tokens)
    for layer, src in zip(cache.layers, once.layers):
        layer.update(src.keys[owner], src.values[owner])
    return cache


@torch.no_grad()
def generate(model, tok, prompts, temperature, max_new_tokens, share=True):
    """Batched sampling with left padding and KV cache. Returns response token ids (eos kept) per prompt.
    share: prefill each distinct prompt once (shared_prefill)."""
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    device = next(model.parameters()).device
    enc = {k: v.to(device) for k, v in enc.items()}
    sample = temperature > 0
    cache = shared_prefill(model, enc, prompts, max_new_tokens) if share else None
    out = model.generate(**enc, do_sample=sample, temperature=temperature if sample else None, top_p=1.0, top_k=0,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_ids(tok), pad_token_id=tok.pad_token_id,
                         use_cache=True, cache=cache)
    return cut_at_stop(out[:, enc["input_ids"].shape[1]:].tolist(), eos_ids(tok))


def cut_at_stop(rows, stops):
    """Each sampled row up to and including its first end-of-turn id (the whole row when it has none)."""
    stops = set(stops)
    return [row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in rows]


@torch.no_grad()
def sample(model, tok, prompts, temperature, max_new_tokens, share=True, scores=False):
    """generate() without transformers' generation loop: the same tokens for the same seed (the same prefill, the
    same forward per new token, softmax(z / T) and torch.multinomial over the whole batch; argmax at T = 0), and
    none of generate's per-token machinery (processors, stopping criteria, cache bookkeeping), which costs more
    than the tiny model's arithmetic. Rows that have stopped feed the pad token, as in generate.

    scores: also return, per row, what 02's score() computes for the response under the same weights, read off
    the decoding forwards instead of a second pass: old_logp and entropy of each response token (from the unscaled
    logits, whatever T), and hidden_mean, the mean last-layer state at the response tokens (the state at y_k comes
    from the forward that reads y_k, so one extra forward reads the last sampled tokens). The same function as the
    scoring pass up to summation order (tests/test_share.py: 1e-8 in float64).
    Returns the responses (token ids, end-of-turn kept), and with scores the list of per-row score dicts."""
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    device = next(model.parameters()).device
    ids, attn = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    B, P = ids.shape
    body, head = body_and_head(model)
    cache = shared_prefill(model, {"input_ids": ids, "attention_mask": attn}, prompts if share else list(range(B)),
                           max_new_tokens + 1)  # + 1: room for the forward that reads the last sampled tokens
    mask = torch.cat([attn, attn.new_zeros(B, max_new_tokens + 1)], 1)
    pos = attn.sum(-1, keepdim=True) - 1  # left padding: a token's position counts the real tokens before it
    stops = torch.tensor(eos_ids(tok), device=device)
    cur, done, out, logps, ents, states = ids[:, -1:], torch.zeros(B, dtype=torch.bool, device=device), [], [], [], []
    for t in range(max_new_tokens + 1):
        h = body(input_ids=cur, attention_mask=mask[:, :P + t], position_ids=pos + t, cache=cache,
                 use_cache=True).last_hidden_state[:, -1]
        if t:
            states.append(h)  # the state at y_t
        if t == max_new_tokens or (t and done.all()):
            break
        z = head(h)
        logits = z.float()  # generate samples from float32 logits, whatever the model's dtype
        nxt = (torch.multinomial(Fn.softmax(logits / temperature, -1), 1).squeeze(1) if temperature > 0
               else logits.argmax(-1))
        nxt = torch.where(done, tok.pad_token_id, nxt)
        if scores:  # as 02's Policy scores: in the model's dtype, half precision upcast
            logp_all = Fn.log_softmax(z.float() if z.dtype in (torch.float16, torch.bfloat16) else z, -1)
            logps.append(logp_all.gather(-1, nxt.unsqueeze(-1)).squeeze(-1))
            ents.append(-(logp_all.exp() * logp_all).sum(-1))
        out.append(nxt)
        mask[:, P + t] = 1
        done = done | torch.isin(nxt, stops)
        cur = nxt.unsqueeze(1)
    responses = cut_at_stop(torch.stack(out, 1).tolist(), stops.tolist())
    if not scores:
        return responses
    logps, ents, states = torch.stack(logps, 1).tolist(), torch.stack(ents, 1).tolist(), torch.stack(states, 1)
    lens = torch.tensor([len(r) for r in responses], device=device)
    keep = (torch.arange(states.shape[1], device=device) < lens.unsqueeze(1)).unsqueeze(-1).to(states.dtype)
    hbar = ((states * keep).sum(1) / keep.sum(1).clamp(min=1)).tolist()
    return responses, [{"old_logp": lp[:n], "entropy": en[:n], "hidden_mean": hb}
                       for lp, en, hb, n in zip(logps, ents, hbar, lens.tolist())]


_POOL = {}
EVAL_SPLIT = {"alfworld": "valid_seen", "webshop": "test"}  # verl-agent's held-out split of the real data


def use_data(env_name, data="", split="train", goals="synthetic", eval_split=None):
    """The scripts' --data/--split/--goals: play the real benchmark (envs/alfworld_data.py, envs/webshop_data.py)
    instead of the synthetic env from here on. A missing or malformed data folder (or split, eval_split included)
    ends the script in one line."""
    if not data:
        configure(env_name)  # the synthetic env, whatever an earlier call set
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
    out = {"success": sum(t["won"] for t in trajs) / max(len(trajs), 1),
           "valid_ratio": sum(s["valid"] for s in steps) / max(len(steps), 1),
           "mean_steps": len(steps) / max(len(trajs), 1), "episodes": len(trajs)}
    types = sorted({t["task_type"] for t in trajs if "task_type" in t})
    if types:  # ALFWorld reports success per task type
        out["success_by_type"] = {k: [sum(t["won"] for t in trajs if t.get("task_type") == k),
                                      sum(t.get("task_type") == k for t in trajs)] for k in types}
    return out


# --------------------------------------------------------------------------------------------- mid-training (SFT)
PLACEHOLDER = "search[<your query>]"  # WebShop's search box: a form to fill in, not an action to take


def expert_demos(env_name, seeds, history_length, max_steps=None, detour=0.0, expert=None, format_noise=0.0):
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
    learn (the paper's Phase 1)."""
    from datasets import Dataset
    rows = []
    env = make_env(env_name, **({"expert": expert} if expert else {}))
    if max_steps:
        env.max_steps = max_steps
    for seed in seeds:
        rng = random.Random(1_000_003 * seed + 17)
        noise = random.Random(7_919 * seed + 3)  # its own stream: format_noise 0 leaves the demos as they were
        obs, info = env.reset(seed)
        history, done, detoured = [], False, False
        while not done and info.get("expert_action"):
            action = info["expert_action"]
            others = [a for a in info["admissible_actions"]
                      if a not in (action, PLACEHOLDER, "click[buy now]")]
            if detour and not detoured and others and rng.random() < detour:
                action, detoured = rng.choice(others), True  # a step off the path; the expert's recovery is recorded
            else:
                detoured = False
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


def micro_batches(samples, size, share=False):
    """Samples sorted by prompt+response length, cut into runs of `size` (0 = one run): padding each run to its own
    longest row wastes far fewer tokens than padding a random batch. Callers add up the runs' gradients.
    share: keep the samples of one prompt in one run (sorted by prompt length), so pack_shared() computes it once; a
    run then holds whole prompt groups, `size` samples or fewer unless one group alone is larger."""
    if not share:
        ordered = sorted(samples, key=lambda s: len(s["prompt_ids"]) + len(s["response_ids"]))
        size = size or len(ordered)
        return [ordered[k:k + size] for k in range(0, len(ordered), size)]
    groups = {}
    for s in samples:
        groups.setdefault(tuple(s["prompt_ids"]), []).append(s)
    runs, run = [], []
    for g in sorted(groups.values(), key=lambda g: (len(g[0]["prompt_ids"]), g[0]["prompt_ids"])):
        if run and size and len(run) + len(g) > size:
            runs.append(run)
            run = []
        run += g
    return runs + [run] if run else runs


def batches(tok, samples, size, device="cpu", share=True):
    """(chunk, packed batch) pairs over micro_batches(): pack_shared() when share, else pack()."""
    for chunk in micro_batches(samples, size, share):
        yield chunk, (pack_shared if share else pack)(tok, chunk, device)


def shifted_masks(b):
    """For next-token targets input_ids[:, 1:] of a pack() batch: (response mask, prompt mask), each [B, T-1]."""
    resp = torch.zeros_like(b["attention_mask"][:, 1:], dtype=torch.float).scatter_(1, b["gather_index"], b["mask"])
    return resp, b["attention_mask"][:, 1:].float() - resp


def sft(model, tok, dataset, steps, lr, batch_size, seed, max_len=1024, progress=True, prompt_weight=0.0,
        micro_batch=4):
    """NLL on expert demos: response tokens, plus `prompt_weight` x the mean NLL of the prompt tokens.

    The prompt term is plain language modelling on env text. Prompts repeat their own strings (product ids, queries,
    objects appear in the observation, the admissible list and the history), so predicting them rewards copying
    from the context; with response-only loss the tiny model memorised training ids and queries instead of copying.
    Each batch runs as length-sorted micro-batches whose gradients add up to the batch's: padding 16 random demos
    to the longest cost 1.8 s a step in the default build, sorted micro-batches of 4 cost 1.1 s.
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
    losses = []
    for step in tqdm(range(steps), desc="mid-training SFT", disable=not progress):
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
    model.eval()
    return losses


# --------------------------------------------------------------------------------------------- the base agent
@dataclass
class Args:
    model: str = "tiny"
    """'tiny' (the embedded default, built and cached here), or a Hugging Face id / local folder"""
    out_dir: str = os.path.join(ROOT, "base")
    """where the mid-trained base (model + tokenizer) is saved; the project ships its build in base/tiny"""
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
    """chance of a random off-path step (then the expert's recovery) before a demo step; see expert_demos()"""
    detour_envs: str = "webshop"
    """envs whose demos get detours (ALFWorld's expert path is already learnable from what the agent sees)"""
    alfworld_expert: str = "oracle"
    """ALFWorld demo expert: oracle (walks straight to the goal object, whose place the agent cannot see) or search
    (sweeps the receptacles in the order the admissible list shows them, using only what the agent is shown, so its
    every step can be read off the prompt; envs/alfworld.py's _search); real ALFWorld data has its own expert"""
    format_noise: float = 0.0
    """share of demo responses that leave out the opening <think> tag (playable, but invalid: -0.1), so the base
    breaks the format now and then and RL has a format to learn (the paper's Phase 1); see expert_demos()"""
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
    """weight of the prompt-token NLL in mid-training (0 = response tokens only); see sft()"""
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
    name = "tiny" if args.model == "tiny" else os.path.basename(args.model.rstrip("/"))
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
    the caller had (an RL script may have configured --data before it loads the base)."""
    saved = {e: dict(ENV_DEFAULTS.get(e, {})) for e in ENVS}
    try:
        for e in build_envs(args):
            use_data(e, real_data(args).get(e, ""), "train", eval_split=EVAL_SPLIT[e])
        yield
    finally:
        for e, kw in saved.items():
            configure(e, **kw)


def demo_kw(args, env_name):
    """expert_demos() settings of one env under the build flags."""
    expert = {"alfworld": args.alfworld_expert, "webshop": args.webshop_expert}.get(env_name)
    return {"detour": args.detour if env_name in args.detour_envs.split(",") else 0.0,
            "expert": None if real_data(args).get(env_name) else expert, "format_noise": args.format_noise}


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
    demos = {e: expert_demos(e, range(args.demo_tasks), args.history_length, **demo_kw(args, e))
             for e in env_names}
    most = max(len(d) for d in demos.values())
    for e, d in demos.items():
        n = min(2 * args.demo_tasks, -(-args.demo_tasks * most // max(len(d), 1)))
        if n > args.demo_tasks:
            demos[e] = expert_demos(e, range(n), args.history_length, **demo_kw(args, e))
    if args.model == "tiny":
        corpus = [CHATML_EXAMPLE.format(prompt=r["prompt"], response=r["response"]) for d in demos.values() for r in d]
        tok = train_tokenizer(corpus, args.vocab_size)
        model = tiny_model(len(tok), args.seed, args.layers, args.hidden)
    else:
        model, tok = load_pretrained(args.model)
    from datasets import concatenate_datasets
    data = concatenate_datasets(list(demos.values())).shuffle(seed=args.seed)
    losses = sft(model, tok, data, args.sft_steps, args.sft_lr, args.sft_batch, args.seed, args.sft_max_len,
                 progress=progress, prompt_weight=args.sft_prompt_weight, micro_batch=args.sft_micro_batch)
    report = {"args": asdict(args), "demo_rows": len(data), "sft_loss_first": losses[:1], "sft_loss_last":
              sum(losses[-20:]) / max(len(losses[-20:]), 1), "build_seconds": round(time.time() - t0, 1),
              "n_params": sum(p.numel() for p in model.parameters()), **fingerprint(args, tok)}
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "base.json"), "w") as f:
        json.dump(report, f, indent=1)
    return model.eval(), tok, report


def fingerprint(args, tok):
    """What the shipped base was trained on, in a form a test can recompute from today's code: a digest of the
    first demos of every env (prompt templates, env text and expert included) and the token ids of one of them."""
    import hashlib
    rows = [r for e in build_envs(args)
            for r in expert_demos(e, range(3), args.history_length, **demo_kw(args, e)).to_list()]
    probe = chat(tok, rows[-1]["prompt"]) + rows[-1]["response"]
    return {"demo_digest": hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest(),
            "probe_text": probe, "probe_ids": tok(probe, add_special_tokens=False)["input_ids"]}


def load_base(model="tiny", out_dir=Args.out_dir, progress=True, dtype=torch.float32, attn_implementation=None):
    """What the RL scripts call: 'tiny' -> the cached mid-trained tiny base (built on first use); any other name is
    a folder or hub id, loaded as it is (mid-train a real model first with `python 01_formats.py --model ...`)."""
    if model == "tiny":
        lm, tok = build_base(Args(out_dir=out_dir), progress)[:2]
        if attn_implementation:
            lm.set_attn_implementation(attn_implementation)
        return lm.to(dtype), tok
    return load_pretrained(model, dtype, attn_implementation)


CHATML_EXAMPLE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n"


def field_help(cls):
    """The string under each dataclass field (CleanRL/tyro style) becomes its --help text; subclasses included."""
    import ast
    import inspect
    helps = {}
    for klass in reversed([k for k in cls.__mro__ if k is not object]):
        body = ast.parse(inspect.getsource(klass)).body[0].body
        helps.update({a.target.id: b.value.value.strip() for a, b in zip(body, body[1:])
                      if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)})
    return helps


def boolean(text):
    """A flag's true/false: a typo such as `flase` is an error, not a silent False."""
    import argparse
    low = text.lower()
    if low not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return low in ("1", "true", "yes")


def parse_args(cls, argv=None):
    """Dataclass -> argparse; a bad flag is argparse's one-line usage error."""
    import argparse
    import dataclasses
    doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n")[0]
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    helps = field_help(cls)
    for f in dataclasses.fields(cls):
        kind = type(f.default)
        if kind is bool:
            p.add_argument(f"--{f.name}", type=boolean, nargs="?", const=True, default=f.default,
                           help=helps.get(f.name, " "))
        else:
            p.add_argument(f"--{f.name}", type=kind, default=f.default, help=helps.get(f.name, " "))
    return cls(**vars(p.parse_args(argv)))


def main(argv=None):
    args = parse_args(Args, argv)
    torch.manual_seed(args.seed)
    model, tok, report = build_base(args)
    for e in build_envs(args):  # the report plays the real data's held-out split where the base trained on it
        use_data(e, real_data(args).get(e, ""), eval_split=EVAL_SPLIT[e])
    print(f"base: {base_dir(args)}  params={sum(p.numel() for p in model.parameters()):,}  "
          f"sft_loss_last={report.get('sft_loss_last')}")
    results = {}
    for e in build_envs(args):
        def score_on(seeds, split):
            return summarize(play(model, tok, e, list(seeds), temperature=args.eval_temperature,
                                  history_length=args.history_length, max_new_tokens=args.max_new_tokens,
                                  progress=True, env_kw={"split": split} if e in real_data(args) else None))
        results[e] = score_on(range(args.eval_seed, args.eval_seed + args.eval_tasks), EVAL_SPLIT[e])
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
