"""Cache memory per request against context length, per cache group, for the hybrid families at their released shapes
(transformers 5.25's default configs, which are the released models': Qwen3-Next-80B-A3B, Qwen3.5-9B-like dense,
Qwen3.5-35B-A3B-like MoE, Kimi-Linear-48B-A3B), in bf16.

The figures come from the engine's own accounting: each model is built on the meta device (no weights) from its
config through the model registry, and asked what its layers hold: `cache_shape` of the attention layers (paged K/V
or MLA latent, bytes per token) and `state_shapes` of the linear-attention layers (short-conv state in the model dtype
and the float32 recurrent state, bytes per request, whatever its length). Beside each, the same stack with every
layer full attention (what the cache would hold if the linear layers kept K/V like the attention layers).

    .venv/bin/python benchmarks/hybrid_memory.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

CONTEXTS = (1024, 8192, 32768, 131072)
FAMILIES = {  # model_type -> transformers config class
    "qwen3_next": "Qwen3NextConfig",
    "qwen3_5_text": "Qwen3_5TextConfig",
    "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
    "kimi_linear": "KimiLinearConfig",
}


def measure(model_type: str, config_class: str, folder: Path) -> dict[str, float] | None:
    import transformers

    from reasoning_engine.cache_groups import cache_bytes, state_bytes
    from reasoning_engine.config import load_model_config
    from reasoning_engine.models.registry import FAMILIES as BUILT

    config = getattr(transformers, config_class)()
    path = folder / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "model_type": model_type}))
    try:
        model_config = load_model_config(path)
    except ValueError:
        return None  # a family this tree does not run yet
    if model_config.family not in BUILT:
        return None
    with torch.device("meta"):
        model = BUILT[model_config.family](model_config, 4096)
    dtype = torch.bfloat16
    kv_per_token = cache_bytes(model.attention_layers(), dtype)
    state = state_bytes(model.linear_layers(), dtype, 1)
    attention, linear = len(model.attention_layers()), len(model.linear_layers())
    return {"kv_per_token": kv_per_token, "state": state, "attention_layers": attention, "linear_layers": linear,
            "all_full_per_token": kv_per_token / attention * (attention + linear)}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type, config_class in FAMILIES.items():
            result = measure(model_type, config_class, Path(tmp))
            if result is None:
                print(f"{model_type}: not supported by this tree, skipped")
                continue
            rows.append((model_type, result))
    print("| model | layers (attention + linear) | KV per token | state per request | "
          + " | ".join(f"{c // 1024}k: KV + state (all-full)" for c in CONTEXTS) + " |")
    print("|---|---|---|---|" + "---|" * len(CONTEXTS))
    mib = 2**20
    for model_type, r in rows:
        cells = []
        for context in CONTEXTS:
            kv = r["kv_per_token"] * context
            total, full = kv + r["state"], r["all_full_per_token"] * context
            cells.append(f"{kv / mib:.0f} + {r['state'] / mib:.1f} MiB = {total / mib:.0f} MiB ({total / full:.2f}x of {full / mib:.0f})")
        print(f"| {model_type} | {r['attention_layers']} + {r['linear_layers']} | {r['kv_per_token'] / 1024:.1f} KiB | "
              f"{r['state'] / mib:.1f} MiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
