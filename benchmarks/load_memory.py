"""Peak memory while loading a checkpoint: builds a random Llama-shaped checkpoint of at least 300 MB (sharded, with
its index, as published checkpoints are), loads it with `LLM(path, dtype="float32", device="cpu")` in a fresh
process and reports how far peak RSS rose above the process's RSS before loading, relative to the weights' size.

    python benchmarks/load_memory.py [--size-mb 400] [--shard-mb 100] [--max-model-len 256]

Exits 1 when the ratio reaches the limit (1.3). The baseline (Python + torch, before `LLM(...)`) is subtracted
because it does not scale with the model; the absolute numbers are printed too.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

LIMIT = 1.3
VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 8192, 1024, 2816, 16, 8
HEAD_DIM = HIDDEN // HEADS

CHILD = """
import json, sys, time
import torch
from reasoning_engine import LLM, SamplingParams

def status(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field)) * 1024

before_imports = baseline = status("VmRSS:")
start = time.perf_counter()
llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=int(sys.argv[2]), kv_cache_blocks=int(sys.argv[2]) // 16)
seconds = time.perf_counter() - start
peak = status("VmHWM:")
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
print(json.dumps({"before_imports": before_imports, "baseline": baseline, "peak": peak, "seconds": seconds, "tokens": list(out[0].outputs[0].token_ids)}))
"""


def layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
    }


def write_checkpoint(folder: Path, size_mb: int, shard_mb: int) -> int:
    """Write config.json and float32 shards totalling at least `size_mb`; returns the weights' size in bytes.
    Tensors are generated shard by shard so this process never holds more than one shard."""
    per_layer = sum(math.prod(s) for s in layer_shapes(0).values()) * 4
    outer = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    layers = max(1, math.ceil((size_mb * 2**20 - sum(math.prod(s) for s in outer.values()) * 4) / per_layer))
    shapes = dict(outer)
    for i in range(layers):
        shapes.update(layer_shapes(i))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shards: list[list[str]] = [[]]
    size = 0
    for name in shapes:
        nbytes = math.prod(shapes[name]) * 4
        if shards[-1] and size + nbytes > shard_mb * 2**20:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.ones(shapes[n]) if n.endswith("norm.weight") else 0.02 * torch.randn(shapes[n], generator=gen))
                   for n in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    total = sum(math.prod(s) for s in shapes.values()) * 4
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=400, help="weights size to build (at least 300)")
    parser.add_argument("--shard-mb", type=int, default=100, help="safetensors shard size")
    parser.add_argument("--max-model-len", type=int, default=256,
                        help="context the engine sizes its KV cache for (kept small: the KV cache is not weights)")
    args = parser.parse_args()
    if args.size_mb < 300:
        parser.error("--size-mb must be at least 300")
    with tempfile.TemporaryDirectory(prefix="load_memory_") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        weights = write_checkpoint(folder, args.size_mb, args.shard_mb)
        print(f"checkpoint: {weights / 2**20:.0f} MiB of float32 weights in {len(list(folder.glob('*.safetensors')))} shards, "
              f"written in {time.perf_counter() - start:.1f}s")
        run = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(args.max_model_len)],
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if run.returncode != 0:
            print(run.stderr, file=sys.stderr)
            return run.returncode
        result = json.loads(run.stdout.strip().splitlines()[-1])
    ratio = (result["peak"] - result["baseline"]) / weights
    mib = 2**20
    print(f"RSS before loading: {result['baseline'] / mib:.0f} MiB (Python + torch, of which "
          f"{(result['baseline'] - result['before_imports']) / mib:.0f} MiB torch's lazily imported compiler stack)")
    print(f"peak RSS:           {result['peak'] / mib:.0f} MiB (loaded in {result['seconds']:.1f}s)")
    print(f"peak - before:      {(result['peak'] - result['baseline']) / mib:.0f} MiB = {ratio:.3f}x the weights "
          f"(limit {LIMIT}x): {'OK' if ratio < LIMIT else 'OVER'}")
    print(f"peak / weights:     {(result['peak'] - result['before_imports']) / weights:.3f}x counting torch's lazy imports, "
          f"{result['peak'] / weights:.3f}x counting all of Python + torch")
    return 0 if ratio < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
