"""A tiny random checkpoint for benchmark tests when the bundled model is not built: a 2-layer llama behind a
byte-level tokenizer (every text encodes, one token per byte, so the real workloads replay too) with a thinking chat
template (the prompt ends with `<think>`, the reasoning parser splits at `</think>`), so the benchmark sees both
thinking and answer tokens."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "<think>{{ message.reasoning_content or '' }}</think>{{ message.content or '' }}<|im_end|>"
    "{%- else -%}<|im_user|>{{ message.role }}<|im_middle|>{{ message.content }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>{%- endif -%}"
)


def build_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Byte-level BPE without merges (256 byte tokens), Kimi-style chat tokens, random llama weights."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    fast.add_tokens(["<think>", "</think>"])
    fast.chat_template = TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"))
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
