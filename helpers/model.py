"""The model side a first reading skips: the tiny Qwen2 and its BPE, loading a real checkpoint, LoRA.

The embedded default agent is a Qwen2ForCausalLM shrunk to CPU size with a byte-level BPE trained on env text
(base/build.py mid-trains it on 01_formats.py's expert demos; the project ships the builds in base/);
`--model PATH` loads a real checkpoint through the same functions.
"""
import os

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_EXAMPLE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n"
BASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "base")  # the shipped builds


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


def load_base(model="tiny", dtype=torch.float32, attn_implementation=None):
    """What the scripts load: a shipped base by its name in base/ ('tiny' = base/tiny, the default build), or any
    folder or hub id as it is (mid-train a real model first with `python base/build.py --model ...`)."""
    shipped = os.path.join(BASES, model)
    if os.sep not in model and "/" not in model and not os.path.exists(model):
        if not os.path.exists(os.path.join(shipped, "base.json")):
            raise SystemExit(f"error: no base {model!r} in {BASES}; build it with `python base/build.py --name "
                             f"{model}` or pass a model folder")
        model = shipped
    return load_pretrained(model, dtype, attn_implementation)


def add_lora(model, r=16, alpha=32, dropout=0.0):
    """LoRA on every linear map of the blocks; disabling the adapter gives back the reference policy."""
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, cfg)


def eos_ids(tok):
    ids = {tok.eos_token_id}
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tok.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tok.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


def body_and_head(lm):
    """(transformer body, unembedding) of a plain or LoRA-wrapped causal LM."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return base.model, base.lm_head
