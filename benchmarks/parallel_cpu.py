"""Tensor and expert parallelism on the CPU, side by side in one run: what splitting a model over two processes costs.

Two float32 checkpoints: the ~87.5M-parameter Llama of cpu_decode.py and a ~185M-parameter DeepSeek-V3-shaped MoE
(MLA, 16 routed experts of which 4 per token, a shared expert; ~86M parameters active per token, embedding and LM head included). Configurations, on the same 2-core machine:
- TP=1: one process, 2 threads (the baseline);
- TP=2: two ranks of 1 thread each (attention heads, MLPs and vocabulary split, one all-reduce per block);
- EP=2 (MoE only): the same two ranks, attention split, the 16 routed experts partitioned (8 per rank).
Each is timed at batch 1 and batch 32 (prompt 64 tokens, 64 new tokens); reported: tokens/s relative to TP=1 at the
same batch (medians over interleaved rounds: every round starts each configuration afresh, warms it up, times it,
stops it) and the share of rank 0's step time spent inside collectives. Two CPU cores are no target for
tensor parallelism: this shows its overhead honestly (a GPU's NVLink all-reduce is ~100x faster than gloo on loopback).

    python benchmarks/parallel_cpu.py [--rounds 3] [--out benchmarks/results/parallel_cpu_cpu_DATE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cpu_decode import MODEL as LLAMA

PROMPT_LEN, NEW_TOKENS = 64, 64
MOE = dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=8,
           num_attention_heads=12, num_key_value_heads=12, n_routed_experts=16, num_experts_per_tok=4,
           n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32,
           qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=1, max_position_embeddings=2048)
CONFIGS = {"llama": {"TP=1": {}, "TP=2": {"tensor_parallel_size": 2}},
           "moe": {"TP=1": {}, "TP=2": {"tensor_parallel_size": 2},
                   "EP=2": {"tensor_parallel_size": 2, "enable_expert_parallel": True}}}


def build(folder: Path, kind: str) -> int:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**LLAMA, max_position_embeddings=2048))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**MOE))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def measure(folder: Path, parallel: dict, batches: tuple[int, ...]) -> dict[str, float]:
    """tok/s per batch size and the share of rank 0's generate time inside collectives, for one configuration."""
    from reasoning_engine import LLM, SamplingParams
    from reasoning_engine.parallel import COLLECTIVES

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 15000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(max(batches))]
    out: dict[str, float] = {}
    with LLM(folder, dtype="float32", device="cpu", max_model_len=512, enable_prefix_caching=False,
             max_num_seqs=max(batches), **parallel) as llm:
        llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        for batch in batches:
            COLLECTIVES.reset()
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            out[f"tok_s_b{batch}"] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
            out[f"collective_share_b{batch}"] = COLLECTIVES.seconds / elapsed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--out", default=f"benchmarks/results/parallel_cpu_cpu_{datetime.date.today()}")
    args = parser.parse_args()
    batches = tuple(args.batches)
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in CONFIGS:
            sizes[kind] = build(Path(tmp) / kind, kind)
        for round_ in range(args.rounds):
            for kind, configs in CONFIGS.items():
                for name, parallel in configs.items():
                    runs = results.setdefault(kind, {}).setdefault(name, [])
                    runs.append(measure(Path(tmp) / kind, parallel, batches))
                    print(f"round {round_ + 1} {kind} {name}: {runs[-1]}", flush=True)
    rows = []
    for kind, configs in results.items():
        base = configs["TP=1"]
        for name, runs in configs.items():
            row = {"model": kind, "params_m": round(sizes[kind] / 1e6, 1), "config": name}
            for batch in batches:
                key = f"tok_s_b{batch}"
                row[f"vs_tp1_b{batch}"] = statistics.median(r[key] / b[key] for r, b in zip(runs, base))
                row[f"collectives_b{batch}"] = statistics.median(r[f"collective_share_b{batch}"] for r in runs)
            rows.append(row)
    Path(args.out + ".json").write_text(json.dumps({"rows": rows, "raw": results, "rounds": args.rounds,
                                                    "torch_threads": torch.get_num_threads()}, indent=1))
    lines = ["| model | config | " + " | ".join(f"tok/s vs TP=1, batch {b} | in collectives, batch {b}" for b in batches)
             + " |", "|---|---|" + "---|---|" * len(batches)]
    for row in rows:
        cells = " | ".join(f"{row[f'vs_tp1_b{b}']:.2f}x | {100 * row[f'collectives_b{b}']:.0f}%" for b in batches)
        lines.append(f"| {row['model']} ({row['params_m']}M) | {row['config']} | {cells} |")
    header = [f"# Tensor and expert parallelism on the CPU ({datetime.date.today()}, this machine: "
              f"{os.cpu_count()} cores, gloo on loopback)", "",
              f"`python benchmarks/parallel_cpu.py --rounds {args.rounds}`: medians of {args.rounds} interleaved rounds; "
              f"prompt {PROMPT_LEN} tokens, {NEW_TOKENS} new tokens, float32. TP=1 runs 2 threads, each rank of "
              "TP=2 / EP=2 one. \"In collectives\" is the share of rank 0's generate time spent inside all-reduces and "
              "all-gathers, waiting for the other rank included.", ""]
    Path(args.out + ".md").write_text("\n".join(header + lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
