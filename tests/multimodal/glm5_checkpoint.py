"""A tiny multimodal GLM-5.3-Flash checkpoint, whole, as transformers writes it: `Glm5NextForConditionalGeneration`
(the text model of tests/models/checkpoints.py's glm5_next variant, a vision tower of 4-pixel patches, two blocks) and
`Glm5NextProcessor` (a tokenizer with GLM's chat and image tokens and a GLM-style chat template, a small image
processor: 4 to 24 tokens an image) both saved with `save_pretrained`; weights far from their init."""

from __future__ import annotations

from pathlib import Path

import torch

from .kimi_checkpoint import MultimodalCheckpoint, train_tokenizer

try:
    from .. import reference_torchvision
    from ..models.checkpoints import _BASES
except ImportError:  # tests/ itself is on sys.path
    import reference_torchvision
    from models.checkpoints import _BASES

SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|begin_of_image|>", "<|end_of_image|>",
            "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"]
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m['role'] }}|>"
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for c in m['content'] -%}"
    "{%- if c['type'] == 'image' or c['type'] == 'image_url' -%}<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif c['type'] == 'video' or c['type'] == 'video_url' -%}<|begin_of_video|><|video|><|end_of_video|>"
    "{%- else -%}{{ c['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, projection_intermediate_size=48, swiglu_limit=3.0)
IMAGES = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_image_tokens=4, max_image_tokens=24)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale weights in the vision tower (norms away from 1, biases and LayerNorms non-zero), and the text
    model's parameters its init leaves constant (as tests/models/checkpoints.py perturbs them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")):
                param.copy_(1 + 0.2 * noise)
            elif name.startswith("model.visual."):
                param.copy_(noise / param[0].numel() ** 0.5 if param.dim() >= 2 else 0.3 * noise)
            elif name.endswith(("_hc.base", "index_kpool_compress_ape", "index_kpool_compress_gate", "k_norm.bias",
                                "forget_gate.A_log", "forget_gate.dt_bias")):
                param.copy_(0.5 * noise)
            elif name.endswith("_hc.scale"):
                param.copy_(1.0 + 0.3 * noise)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))


def build_glm5(folder: Path, seed: int = 0) -> MultimodalCheckpoint:
    reference_torchvision.require()
    from transformers import (Glm5NextConfig, Glm5NextForConditionalGeneration, Glm5NextImageProcessor,
                              Glm5NextProcessor, Glm5NextVideoProcessor)

    tokenizer = train_tokenizer(SPECIALS, CHAT_TEMPLATE, 290)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIALS}
    text = {**_BASES["glm5_next"], "vocab_size": 320, "bos_token_id": None, "eos_token_id": ids["<|endoftext|>"]}
    assert max(ids.values()) < text["vocab_size"], "the text model's vocabulary must cover the tokenizer"
    torch.manual_seed(seed)
    config = Glm5NextConfig(text_config=text, vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
                            image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                            image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
                            video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"])
    model = Glm5NextForConditionalGeneration(config).float().eval()
    _randomize(model, seed + 1)
    model.save_pretrained(folder)
    processor = Glm5NextProcessor(image_processor=Glm5NextImageProcessor(**IMAGES), tokenizer=tokenizer,
                                  video_processor=Glm5NextVideoProcessor(), chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return MultimodalCheckpoint(folder, model, Glm5NextProcessor.from_pretrained(str(folder)))
