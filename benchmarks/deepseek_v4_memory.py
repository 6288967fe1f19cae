"""DeepSeek-V4-Flash's memory per rank, from config.json alone (no GPU, nothing allocated: the model is built on the
meta device as `load_format="dummy"` builds it): weight bytes of tensor-parallel rank 0 at each TP size, and the KV
cache bytes per token of each cache group, against DeepSeek-V3.2's latent + index-key cache.

    python benchmarks/deepseek_v4_memory.py [--tp 8] [--dtype bfloat16] [--block-size 64]

The config is transformers 5.25's DeepseekV4Config defaults, which its docs give as deepseek-ai/DeepSeek-V4-Flash-Base
(43 layers, hidden 4096, 64 heads of 512, 256 routed experts of 2048, 6 per token, one shared, window 128, rates 4 and
128). Routed experts are counted in `--dtype` (the release ships them in FP4, which the engine does not load yet).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def flash_config() -> dict:
    from transformers import DeepseekV4Config

    return DeepseekV4Config().to_dict()


def report(tp: int, dtype: torch.dtype, block_size: int) -> dict:
    from reasoning_engine.config import load_model_config
    from reasoning_engine.cache_groups import cache_bytes, pool_block_bytes
    from reasoning_engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from reasoning_engine.parallel import Group, Parallel

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(flash_config()))
        config = load_model_config(folder)
    size = torch.tensor([], dtype=dtype).element_size()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, 16, Parallel(tp=Group(0, tp)))
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * (p.element_size() if not p.is_floating_point() else size) for p in params)
    experts = sum(p.numel() * size for name, p in model.named_parameters() if ".experts." in name)
    layers = model.attention_layers()
    groups = model.cache_groups()
    per_group = {}
    for group in groups:
        per_group[f"{group.kind}" + (f" (window {group.window})" if group.window else "")] = cache_bytes(
            [layers[i] for i in group.layers], dtype, block_size) / block_size
    block = pool_block_bytes(layers, groups, dtype, block_size)
    raw = config.raw
    v32_layers, v32_width = 61, 512 + 64 + 128  # DeepSeek-V3.2: latent + rope key + index key per layer
    return {
        "tp": tp, "dtype": str(dtype), "weight_bytes_rank0": weights, "routed_expert_bytes_rank0": experts,
        "kv_bytes_per_token_by_group": per_group,
        "kv_bytes_per_block_allocated": block, "block_size": block_size,
        "sliding_group_bytes_per_sequence": per_group[next(k for k in per_group if k.startswith("sliding"))]
        * groups[-1].window,
        "deepseek_v32_kv_bytes_per_token": v32_layers * v32_width * size,
        "layers": raw["num_hidden_layers"], "layer_types": {t: raw["layer_types"].count(t) for t in set(raw["layer_types"])},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args()
    from reasoning_engine.config import parse_dtype

    print(json.dumps(report(args.tp, parse_dtype(args.dtype), args.block_size), indent=2))


if __name__ == "__main__":
    main()
