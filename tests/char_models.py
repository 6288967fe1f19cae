"""Tiny random checkpoints with a character tokenizer, for the engine, speculative and server tests."""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIALS = ["<unk>", "<s>", "</s>", "<think>", "</think>"]
VOCAB_SIZE = 100  # = the character tokenizer's size, so every id decodes


def save_char_tokenizer(folder: Path) -> None:
    """One token per printable character, plus <think>/</think> as single tokens: every stop string spans tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(string.printable[:95]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("<think>|</think>|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.add_tokens(["<think>", "</think>"])
    fast.save_pretrained(folder)


def build_llama(folder: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties, distinct greedy paths
        model.lm_head.weight.mul_(8)
    model.save_pretrained(folder)
    save_char_tokenizer(folder)
    return folder


def build_deepseek(folder: Path, seed: int) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                              n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16,
                              q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                              first_k_dense_replace=1, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    model.save_pretrained(folder)
    save_char_tokenizer(folder)
    return folder


def mixed_prompts(count: int, seed: int = 0, low: int = 3, high: int = 60) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=gen).tolist()
    return [torch.randint(5, VOCAB_SIZE, (n,), generator=gen).tolist() for n in lengths]
