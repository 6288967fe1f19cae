"""Prefix-cache hit rate of a hybrid model (Qwen3.5-MoE shape: three Gated DeltaNet layers per attention layer) against
a full-attention model of the same shape (Qwen3-MoE), on the shared agentic traces replayed as multi-turn chats.

Each trajectory of ../shared/workloads/agentic/*.jsonl becomes a sequence of prompts: turn k's prompt is every earlier
prompt and output of the trajectory, then its own prompt (the README's definition), as token ids = the text's UTF-8
bytes (a byte-level vocabulary; the tiny random models need no tokenizer). Trajectories are replayed interleaved, one
turn of each in turn (`--concurrent` of them at a time), so prefixes compete for the cache as an agent server's do;
each turn generates one token (the next turn's prompt carries the recorded output). The full-attention model can hit
every block of the shared prefix; the hybrid one only up to the last block boundary where a state snapshot is kept
(engine/state_cache.py), within the same memory budget for KV blocks.

    .venv/bin/python benchmarks/hybrid_prefix_hits.py --trajectories 8 --max-context 6000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT.parent / "shared" / "workloads" / "agentic"
SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=65536,
             bos_token_id=0, eos_token_id=1)


def build(kind: str, folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    if kind == "hybrid":
        config = transformers.Qwen3_5MoeTextConfig(
            **SHAPE, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=32)
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SHAPE))
    path = folder / kind
    model.float().save_pretrained(path)
    return path


def trajectories(files: list[Path], count: int, max_context: int) -> list[list[list[int]]]:
    """Per trajectory, its turns' prompts as byte ids, stopping before a turn whose context exceeds max_context."""
    convs: dict[str, list[dict]] = {}
    for file in files:
        for line in file.read_text().splitlines():
            record = json.loads(line)
            convs.setdefault(f"{file.name}:{record['traj_id']}", []).append(record)
    out = []
    for key in sorted(convs)[:count]:
        turns, context = [], b""
        for record in sorted(convs[key], key=lambda r: r["step"]):
            prompt = context + record["prompt"].encode()
            if len(prompt) > max_context:
                break
            turns.append(list(prompt))
            context = prompt + record["output"].encode()
        if turns:
            out.append(turns)
    return out


def replay(path: Path, convs: list[list[list[int]]], concurrent: int, kv_blocks: int) -> dict[str, float]:
    from reasoning_engine import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu", block_size=16, kv_cache_blocks=kv_blocks,
              max_model_len=max(len(t) for c in convs for t in c) + 8, max_num_seqs=concurrent, adaptive=False)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    began = time.perf_counter()
    for start in range(0, len(convs), concurrent):
        group = convs[start : start + concurrent]
        for turn in range(max(len(c) for c in group)):
            prompts = [{"prompt_token_ids": c[turn]} for c in group if turn < len(c)]
            llm.generate(prompts, params)
    blocks = llm.engine.block_manager
    return {"prompt_tokens": blocks.prefix_queries, "hit_tokens": blocks.prefix_hits,
            "hit_rate": blocks.prefix_hits / max(blocks.prefix_queries, 1), "seconds": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--max-context", type=int, default=6000, help="bytes (= tokens) per prompt at most")
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--files", nargs="*", default=["tau_bench_airline_gpt4o.jsonl", "mini_swe_agent_deepseek_chat_dev.jsonl"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    files = [WORKLOADS / f for f in args.files]
    convs = []
    for file in files:  # the same number from each file
        convs += trajectories([file], args.trajectories // len(files), args.max_context)
    turns = sum(len(c) for c in convs)
    with tempfile.TemporaryDirectory() as tmp:
        results = {kind: replay(build(kind, Path(tmp)), convs, args.concurrent, args.kv_blocks)
                   for kind in ("full", "hybrid")}
    print(f"{len(convs)} trajectories, {turns} turns, files {', '.join(args.files)}; {args.concurrent} at a time, "
          f"{args.kv_blocks} KV blocks of 16 tokens")
    print("| model | prompt tokens | hit tokens | hit rate |")
    print("|---|---|---|---|")
    for kind, r in results.items():
        print(f"| {kind} | {r['prompt_tokens']} | {r['hit_tokens']} | {r['hit_rate']:.4f} |")
    print(f"hybrid / full hit rate: {results['hybrid']['hit_rate'] / results['full']['hit_rate']:.3f}")


if __name__ == "__main__":
    main()
