"""A tiny multimodal Kimi K2.5 checkpoint, whole, as transformers writes it: `Kimi_K25ForConditionalGeneration`
(DeepSeek-V3-shaped text model, MoonViT tower, projector) and `Kimi_K25Processor` (tokenizer with Kimi's chat and
media tokens and a Kimi-style chat template, small image and video processors) both saved with `save_pretrained`.

Images use 4-pixel patches and a 6 x 6 position table, so images of a few dozen pixels cover every path (table
resized up and down, several items per step) while the model stays small enough for a 2-core machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

try:
    from .. import reference_torchvision
except ImportError:  # tests/ itself is on sys.path
    import reference_torchvision

SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|media_begin|>",
            "<|media_content|>", "<|media_end|>", "<|media_pad|>", "<|kimi_k25_video_placeholder|>"]
# Kimi's pre-tokenizer split, simplified: digits never take a leading space (timestamps tokenize alone as in context)
SPLIT = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
CORPUS = ["00:00:00.000 00:00:02.000 00:00:04.000 video image describe what you see in the picture and the clip",
          "user assistant system what colour is it? the answer is red green blue"] * 4
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>system<|im_middle|>{%- endif -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for c in m['content'] -%}"
    "{%- if c['type'] == 'image' or c['type'] == 'image_url' -%}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{%- elif c['type'] == 'video' or c['type'] == 'video_url' -%}<|kimi_k25_video_placeholder|>"
    "{%- else -%}{{ c['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=4,
              pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, merge_kernel_size=[2, 2])
TEXT = dict(model_type="deepseek_v3", vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=2048)


@dataclass
class MultimodalCheckpoint:
    path: Path
    model: Any  # the transformers model the folder holds (Kimi_K25ForConditionalGeneration here)
    processor: Any  # its transformers processor, loaded from the folder

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer


KimiK25Checkpoint = MultimodalCheckpoint


def train_tokenizer(specials: list[str], chat_template: str, vocab_size: int) -> Any:
    """A byte-level BPE trained on `CORPUS`, `specials[0]` its EOS and the rest special tokens after the vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=specials[0])
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    tokenizer.chat_template = chat_template
    return tokenizer


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far enough from their init that every term reaches the logits: norms away from 1, unit-scale linears
    in the tower and projector, a non-zero routing bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.2 * noise)
            elif not name.startswith(("model.vision_tower.", "model.mm_projector.")):
                continue
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif param.dim() >= 2 and "position_embeddings" not in name:
                param.copy_(noise / param[0].numel() ** 0.5)
            else:
                param.copy_(0.5 * noise)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))


def build_kimi_k25(folder: Path, seed: int = 0) -> KimiK25Checkpoint:
    reference_torchvision.require()
    from transformers import (Kimi_K25Config, Kimi_K25ForConditionalGeneration, Kimi_K25ImageProcessor,
                              Kimi_K25Processor, Kimi_K25VideoProcessor)

    tokenizer = train_tokenizer(SPECIALS, CHAT_TEMPLATE, 340)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIALS}
    assert max(ids.values()) < TEXT["vocab_size"], "the text model's vocabulary must cover the tokenizer"
    text = {**TEXT, "bos_token_id": ids["<|im_user|>"], "eos_token_id": ids["<|im_end|>"]}
    torch.manual_seed(seed)
    config = Kimi_K25Config(text_config=text, vision_config=VISION, projection_hidden_size=VISION["hidden_size"],
                            tie_word_embeddings=False, image_token_id=ids["<|media_pad|>"],
                            video_token_id=ids["<|kimi_k25_video_placeholder|>"],
                            vision_start_token_id=ids["<|media_begin|>"], vision_end_token_id=ids["<|media_end|>"])
    model = Kimi_K25ForConditionalGeneration(config).float().eval()
    _randomize(model, seed + 1)
    model.save_pretrained(folder)
    small = {"size": {"max_height": 48, "max_width": 48}, "patch_size": 4}
    processor = Kimi_K25Processor(image_processor=Kimi_K25ImageProcessor(max_patches=144, **small),
                                  video_processor=Kimi_K25VideoProcessor(max_patches=64, **small),
                                  tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return KimiK25Checkpoint(folder, model, Kimi_K25Processor.from_pretrained(str(folder)))


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def noise_frames(count: int, width: int, height: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
