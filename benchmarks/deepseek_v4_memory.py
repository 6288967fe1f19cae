"""DeepSeek-V4-Flash's memory per rank, from config.json alone (no GPU, nothing allocated: the model is built on the
meta device as `load_format="dummy"` builds it): weight bytes of tensor-parallel rank 0 at each TP size; per KV
cache group the bytes of one block of its pool and the bytes per token it holds; and the KV bytes per token of
context of one sequence at 32k and 128k tokens (every compressed row, the sliding window's blocks), against
DeepSeek-V3.2's latent + index-key cache.

    python benchmarks/deepseek_v4_memory.py [--tp 8] [--dtype bfloat16] [--block-size 64]

The config is transformers 5.25's DeepseekV4Config defaults, which its docs give as deepseek-ai/DeepSeek-V4-Flash-Base
(43 layers, hidden 4096, 64 heads of 512, 256 routed experts of 2048, 6 per token, one shared, window 128, rates 4 and
128), with the release's quantization (block FP8, FP4 routed experts): the engine keeps the routed experts in FP4
(codes and a scale per 32) and holds every other weight in `--dtype` (dequantized at load); `--dense-experts` counts
the routed experts in `--dtype` too.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


RELEASE_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                        "weight_block_size": [128, 128]}


def flash_config(released: bool = True) -> dict:
    from transformers import DeepseekV4Config

    config = DeepseekV4Config().to_dict()
    if released:
        config.update(quantization_config=RELEASE_QUANTIZATION, expert_dtype="fp4")
    return config


def context_bytes_per_token(groups, block_bytes: list[int], block_size: int, context: int) -> float:
    """KV bytes per token of one sequence whose next query sits at `context`: the blocks each group holds there
    (a full group every block up to the query's, a sliding group those from its window's first), at its pool's
    block bytes."""
    blocks = -(-(context + 1) // block_size)
    held = [0] * len(block_bytes)
    for group in groups:
        held[group.pool] += blocks - group.first_needed_block(context, block_size)
    return sum(n * b for n, b in zip(held, block_bytes)) / context


def report(tp: int, dtype: torch.dtype, block_size: int, contexts: tuple[int, ...] = (32768, 131072),
           released: bool = True) -> dict:
    from reasoning_engine.cache_groups import cache_bytes, group_names, pool_block_bytes
    from reasoning_engine.config import load_model_config
    from reasoning_engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from reasoning_engine.parallel import Group, Parallel

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(flash_config(released)))
        config = load_model_config(folder)
    size = torch.tensor([], dtype=dtype).element_size()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, 16, Parallel(tp=Group(0, tp)))
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * (p.element_size() if not p.is_floating_point() else size) for p in params)
    experts = sum(p.numel() * (p.element_size() if not p.is_floating_point() else size)
                  for name, p in model.named_parameters() if ".experts." in name)
    layers = model.attention_layers()
    groups = model.cache_groups()
    block_bytes = pool_block_bytes(layers, groups, dtype, block_size)
    names = group_names(groups)
    per_group = {}
    for name, group in zip(names, groups):
        per_group[name] = {"window": group.window, "pool": group.pool, "bytes_per_block": block_bytes[group.pool],
                           "bytes_per_token_held": cache_bytes([layers[i] for i in group.layers], dtype, block_size)
                           / block_size}
    raw = config.raw
    v32_layers, v32_width = 61, 512 + 64 + 128  # DeepSeek-V3.2: latent + rope key + index key per layer
    v32 = v32_layers * v32_width * size
    per_context = {str(n): round(context_bytes_per_token(groups, block_bytes, block_size, n)) for n in contexts}
    return {
        "tp": tp, "dtype": str(dtype), "routed_experts": "fp4" if released else str(dtype), "weight_bytes_rank0": weights, "routed_expert_bytes_rank0": experts,
        "block_size": block_size, "kv_groups": per_group,
        "kv_bytes_per_token_of_context": per_context,
        "deepseek_v32_kv_bytes_per_token": v32,
        "ratio_to_deepseek_v32": {n: round(v / v32, 4) for n, v in per_context.items()},
        "layers": raw["num_hidden_layers"], "layer_types": {t: raw["layer_types"].count(t) for t in set(raw["layer_types"])},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dense-experts", action="store_true", help="routed experts in --dtype, not the release's FP4")
    args = parser.parse_args()
    from reasoning_engine.config import parse_dtype

    print(json.dumps(report(args.tp, parse_dtype(args.dtype), args.block_size, released=not args.dense_experts),
                     indent=2))


if __name__ == "__main__":
    main()
