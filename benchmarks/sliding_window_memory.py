"""gpt-oss's sliding-window layers with and without their own KV cache group.

Part 1, accounting at the real gpt-oss-20b shapes (its published config: 24 layers alternating sliding (window 128)
and full attention, 8 KV heads of 64 channels, bfloat16; no weights needed): one 32k-token sequence goes through the
real `Scheduler` and `BlockManager` (chunked prefill of 8192 tokens, then decoding), once with today's layout (one
group: every layer keeps every block) and once with the cache groups (`groups_by_window`). It reports the KV bytes the
sequence holds at 32k (blocks held x bytes per block: a block holds max(layers per group) layers) and how many 32k
sequences one fixed budget (what 16 sequences take today) holds at once.

Part 2, live: the same comparison in the engine on a tiny random gpt-oss checkpoint (written here with transformers'
save_pretrained: 4 layers, window 8, blocks of 4), `today` being the same model with its cache groups replaced by one
full group. Each run gets the same `kv_cache_memory`; the report gives KV bytes held per sequence at full length
and the most sequences of that length decoding together.

    python benchmarks/sliding_window_memory.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python benchmarks/sliding_window_memory.py` from a checkout, without installing

from reasoning_engine.cache_groups import CacheGroup, groups_by_window, single_group
from reasoning_engine.engine.kv_cache import BlockManager
from reasoning_engine.engine.request import Request
from reasoning_engine.engine.scheduler import Scheduler
from reasoning_engine.sampling_params import SamplingParams

GPT_OSS_20B = dict(num_hidden_layers=24, sliding_window=128, num_key_value_heads=8, head_dim=64, dtype_bytes=2,
                   layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)])


def block_bytes(groups: list[CacheGroup], block_size: int, per_layer_token: int) -> int:
    """A block holds the max(layers per group) cache tensors it is shared by."""
    return max(len(g.layers) for g in groups) * block_size * per_layer_token


def run_sequences(groups: list[CacheGroup], num_blocks: int, block_size: int, context: int, count: int,
                  chunk: int, decoded: int) -> tuple[int, int]:
    """`count` sequences of a `context` - 16 token prompt, then `decoded` tokens, through the scheduler: the blocks
    one sequence holds at its last step, and the most sequences holding at least their whole prompt at once."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False, groups=groups)
    prompt = context - 16
    scheduler = Scheduler(bm, max_num_seqs=1024, max_num_batched_tokens=chunk, max_model_len=prompt + decoded)
    requests = [Request(f"r{i}#0", f"r{i}", 0, None, [i % 1000 + 2] * prompt,
                        SamplingParams(max_tokens=decoded), frozenset()) for i in range(count)]
    for request in requests:
        scheduler.add(request)
    held, most = 0, 0
    while scheduler.has_unfinished:
        for item in scheduler.schedule().scheduled:
            request = item.request
            request.num_computed_tokens += item.num_tokens
            if request.num_computed_tokens >= request.num_tokens:
                request.output_token_ids.append(7)
        full = [r for r in scheduler.running if r.num_computed_tokens >= prompt]
        most = max(most, len(full))
        for request in list(scheduler.running):
            if len(request.output_token_ids) >= decoded:
                held = max(held, bm.held_blocks(request))
                scheduler.finish(request)
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return held, most


def accounting(context: int, block_size: int, chunk: int) -> dict[str, float]:
    cfg = GPT_OSS_20B
    windows = [cfg["sliding_window"] if t == "sliding_attention" else None for t in cfg["layer_types"]]
    per_layer_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * cfg["dtype_bytes"]
    today, now = single_group(cfg["num_hidden_layers"]), groups_by_window(windows)
    today_block, now_block = (block_bytes(g, block_size, per_layer_token) for g in (today, now))
    seq_blocks = -(-context // block_size)
    held_today, _ = run_sequences(today, seq_blocks + 1, block_size, context, 1, chunk, 16)
    held_now, _ = run_sequences(now, 2 * seq_blocks + 1, block_size, context, 1, chunk, 16)
    budget = 16 * held_today * today_block  # what 16 sequences of `context` take today
    # 40 sequences that decode 1024 tokens each: long enough that the budget, not the order, bounds how many hold
    # their whole prompt's context together
    _, fit_today = run_sequences(today, budget // today_block, block_size, context, 40, chunk, 1024)
    _, fit_now = run_sequences(now, budget // now_block, block_size, context, 40, chunk, 1024)
    return dict(held_today=held_today, held_now=held_now, block_today=today_block, block_now=now_block,
                bytes_today=held_today * today_block, bytes_now=held_now * now_block, budget=budget,
                fit_today=fit_today, fit_now=fit_now)


def write_tiny_gpt_oss(folder: Path) -> None:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=1024,
                          layer_types=["sliding_attention", "full_attention"] * 2)
    GptOssForCausalLM(config).save_pretrained(folder)


def live(context: int, sequences: int) -> dict[str, dict[str, float]]:
    """Both layouts in the engine, same kv_cache_memory: KV bytes held per sequence at `context`, most sequences of
    that length decoding at once, and the greedy tokens (which must be equal)."""
    from reasoning_engine import LLM
    from reasoning_engine.models.base import CausalLM
    from reasoning_engine.models.gpt_oss import GptOssForCausalLM

    decoded = context // 4
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_gpt_oss(Path(tmp))
        per_block_today = 4 * 4 * 2 * 2 * 16 * 4  # 4 layers x 4 tokens x K,V x 2 heads x 16 channels x float32
        memory = 6 * -(-context // 4) * per_block_today  # six sequences' worth today
        tokens = {}
        for layout in ("today", "now"):
            original = GptOssForCausalLM.cache_groups
            if layout == "today":
                GptOssForCausalLM.cache_groups = CausalLM.cache_groups
            try:
                llm = LLM(tmp, dtype="float32", device="cpu", block_size=4, kv_cache_memory=memory,
                          max_model_len=context + 4, max_num_seqs=64, max_num_batched_tokens=256,
                          enable_prefix_caching=False)
            finally:
                GptOssForCausalLM.cache_groups = original
            engine, bm = llm.engine, llm.engine.block_manager
            per_block = sum(t.numel() * t.element_size() for caches in engine.runner.worker.kv_caches
                            for t in caches) // (bm.num_blocks + 2)
            params = SamplingParams(temperature=0.0, max_tokens=decoded, ignore_eos=True)
            ids = [engine.add_request(None, {"prompt_token_ids": [(7 * i + j) % 250 + 2 for j in range(context - decoded)]},
                                      params) for i in range(sequences)]
            most, held, out = 0, 0, {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        out[o.request_id] = o.outputs[0].token_ids
                full = [r for r in engine.scheduler.running if r.num_computed_tokens >= context - decoded]
                most = max(most, len(full))
                # at a sequence's last decode step (a prefill chunk's sliding blocks go back at the next step)
                held = max([held] + [bm.held_blocks(r) for r in full if len(r.output_token_ids) == decoded - 1])
            tokens[layout] = [out[i] for i in ids]
            results[layout] = dict(num_blocks=bm.num_blocks, block_bytes=per_block, held_blocks=held,
                                   held_bytes=held * per_block, most_at_full_length=most,
                                   preemptions=engine.num_preemptions)
    results["same_tokens"] = {"value": float(tokens["today"] == tokens["now"])}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--live-context", type=int, default=256)
    parser.add_argument("--live-sequences", type=int, default=16)
    args = parser.parse_args()
    a = accounting(args.context, 16, 8192)
    print(f"gpt-oss-20b shapes, {args.context}-token sequence, blocks of 16 (bfloat16):")
    print(f"  today: {a['held_today']} blocks of {a['block_today']} B = {a['bytes_today'] / 2**20:.1f} MiB held")
    print(f"  now:   {a['held_now']} blocks of {a['block_now']} B = {a['bytes_now'] / 2**20:.1f} MiB held")
    print(f"  KV held per sequence, now / today: {a['bytes_now'] / a['bytes_today']:.3f}x (target <= 0.55x)")
    print(f"  budget {a['budget'] / 2**30:.2f} GiB holds {a['fit_today']} sequences at full length today, "
          f"{a['fit_now']} now: {a['fit_now'] / a['fit_today']:.2f}x (target >= 1.8x)")
    r = live(args.live_context, args.live_sequences)
    print(f"live engine, tiny gpt-oss (4 layers, window 8, blocks of 4, float32), {args.live_context}-token "
          f"sequences, {args.live_sequences} submitted, same kv_cache_memory:")
    for layout in ("today", "now"):
        x = r[layout]
        print(f"  {layout:5}: {x['num_blocks']} blocks of {x['block_bytes']} B; one sequence holds {x['held_blocks']} "
              f"blocks = {x['held_bytes']} B; at most {x['most_at_full_length']} at full length together "
              f"({x['preemptions']} preemptions)")
    print(f"  KV held per sequence, now / today: {r['now']['held_bytes'] / r['today']['held_bytes']:.3f}x; "
          f"sequences together: {r['now']['most_at_full_length'] / r['today']['most_at_full_length']:.2f}x; "
          f"same greedy tokens: {bool(r['same_tokens']['value'])}")


if __name__ == "__main__":
    main()
