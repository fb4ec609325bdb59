"""Batching and the exact speed-ups, which a first reading skips: they change how fast, never what is computed.

- pack / pack_shared: prompt+response batches; pack_shared runs each distinct prompt once and its responses on
  copies of its keys/values (the same numbers; tests/test_share.py);
- micro_batches / batches: length-sorted runs, keeping a prompt's samples together for pack_shared;
- merged_lora: the no-grad passes on W + s B A instead of the LoRA matmuls;
- shared_prefill, generate, sample: batched sampling; sample() is a lean decoding loop with generate's tokens that
  also reads the old log-probs, entropies and hidden means off its forwards.

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
"""
import contextlib

import torch
import torch.nn.functional as Fn

from helpers.model import body_and_head, eos_ids


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



# --------------------------------------------------------------------------------------------- sampling
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
