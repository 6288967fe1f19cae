"""model_type -> implementation, and building a model with its weights loaded."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from reasoning_engine.config import ModelConfig
from reasoning_engine.layers import use_kernel_backend
from reasoning_engine.layers.linear import can_pack, pack_linears
from reasoning_engine.models.base import CausalLM, materialize
from reasoning_engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from reasoning_engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from reasoning_engine.models.glm4_moe import Glm4MoeForCausalLM
from reasoning_engine.models.glm5_next import Glm5NextForCausalLM
from reasoning_engine.models.glm5_vision import build_glm5_vision_encoder
from reasoning_engine.models.gpt_oss import GptOssForCausalLM
from reasoning_engine.models.kimi_linear import KimiLinearForCausalLM
from reasoning_engine.models.kimi_vision import build_vision_encoder as build_kimi_vision_encoder
from reasoning_engine.models.llama import LlamaForCausalLM
from reasoning_engine.models.minimax_m2 import MiniMaxM2ForCausalLM
from reasoning_engine.models.qwen3 import Qwen3ForCausalLM
from reasoning_engine.models.qwen3_next import Qwen3NextForCausalLM
from reasoning_engine.parallel import Parallel

logger = logging.getLogger(__name__)

FAMILIES: dict[str, type[CausalLM]] = {
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v2": DeepseekV3ForCausalLM,
    "deepseek_v32": DeepseekV3ForCausalLM,
    "deepseek_v4": DeepseekV4ForCausalLM,
    "glm_moe_dsa": DeepseekV3ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3ForCausalLM,
    "llama": LlamaForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "minimax_m2": MiniMaxM2ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "kimi_linear": KimiLinearForCausalLM,
    "glm5_next": Glm5NextForCausalLM,
}


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                kernel_backend: str = "torch", load_format: str = "auto", keep_plain_weights: bool = False,
                parallel: Parallel = Parallel()) -> CausalLM:
    """Instantiate the family's module (this rank's share of it, under `parallel`) and fill it: from the checkpoint's
    safetensors (`load_format` "auto"; no random init, every parameter is loaded, each rank reading only its part) or
    with random weights from config.json alone ("dummy"). With `keep_plain_weights` (for compiled decode graphs)
    packed linear layers keep their plain weights as well."""
    from reasoning_engine.models.dummy import init_dummy_weights
    from reasoning_engine.quant_config import parse_quant_config
    from reasoning_engine.models.weights import iter_checkpoint_tensors

    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    cls = FAMILIES[config.family]
    with torch.device("meta"):
        model = cls(config, max_positions, parallel)
    model = materialize(model, dtype, device)
    if config.tie_word_embeddings:  # to_empty gave each module its own tensor: share them again
        model.lm_head.weight = model.embed_tokens.weight
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        quant = parse_quant_config(config.raw)
        model.load_weights(iter_checkpoint_tensors(config.path, quant, dtype, keep_packed=model.packed_weights(),
                                                   progress=parallel.tp.rank == 0 and parallel.dp.rank == 0))
    if can_pack(dtype, device):
        pack_linears(model, keep_plain=keep_plain_weights)
    use_kernel_backend(model, kernel_backend)
    return model.eval()


def build_vision_encoder(model_dir: Path | str, dtype: torch.dtype, device: torch.device | str,
                         kernel_backend: str = "torch", load_format: str = "auto") -> torch.nn.Module | None:
    """The checkpoint's vision tower, weights loaded (Kimi K2.5's MoonViT or GLM-5.3-Flash's), or None for a text
    model."""
    config_file = Path(model_dir) / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("model_type") == "glm5_next":
        return build_glm5_vision_encoder(model_dir, dtype, device, kernel_backend, load_format)
    return build_kimi_vision_encoder(model_dir, dtype, device, kernel_backend, load_format)
