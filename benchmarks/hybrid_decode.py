"""Decode tokens/s of a small hybrid model (Qwen3-Next layout: three Gated DeltaNet layers per gated attention layer,
MoE MLPs) in this engine against the same checkpoint in transformers (its own cache, `generate`, greedy), on this CPU,
at batch 1 and 16, one thread each, measured side by side in one run (alternated, best of `--rounds`).

Both decode the same equal-length random prompts for `--tokens` new tokens; the figure is new tokens / wall seconds
of the whole generate call (prefill included, the same for both), and the ratio is ours / transformers'.

    .venv/bin/python benchmarks/hybrid_decode.py --tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def build(folder: Path, hidden: int, layers: int) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=2048, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=hidden // 8,
        linear_value_head_dim=hidden // 8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    path = folder / "hybrid"
    transformers.Qwen3NextForCausalLM(config).float().eval().save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from reasoning_engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp), args.hidden, args.layers)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        llm = LLM(str(path), dtype="float32", device="cpu", adaptive=False, max_num_seqs=16)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        print(f"Qwen3-Next layout, hidden {args.hidden}, {args.layers} layers; prompt {args.prompt}, {args.tokens} new "
              f"tokens; best of {args.rounds} rounds, alternated; one thread")
        print("| batch | engine tok/s | transformers tok/s | engine / transformers |")
        print("|---|---|---|---|")
        for batch in (1, 16):
            gen = torch.Generator().manual_seed(batch)
            prompts = torch.randint(2, 2048, (batch, args.prompt), generator=gen)
            ours, theirs = [], []
            for _ in range(args.rounds):
                began = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts.tolist()], params)
                ours.append(batch * args.tokens / (time.perf_counter() - began))
                began = time.perf_counter()
                with torch.no_grad():
                    reference.generate(prompts, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                       do_sample=False, attention_mask=torch.ones_like(prompts))
                theirs.append(batch * args.tokens / (time.perf_counter() - began))
            print(f"| {batch} | {max(ours):.1f} | {max(theirs):.1f} | {max(ours) / max(theirs):.2f} |")


if __name__ == "__main__":
    main()
