"""CPU decode speed, side by side in one run: our engine vs transformers' generate (and llama.cpp when installed).

An ~87M-parameter Llama-shaped random checkpoint in float32, 2 threads, prompt 64 tokens, 128 new tokens:
- batch-1 decode tokens/s: ours, transformers `generate`, llama-cpp-python (optional peer: needs a GGUF of the
  same weights made with llama.cpp's converter outside this repo, passed with --gguf; benchmarks/llama_cpp_peer.sh
  builds llama.cpp, converts and runs this benchmark);
- 32 concurrent requests: aggregate tokens/s over our own batch-1.
Ratios are what to report: the machine is shared and noisy, absolute numbers are not comparable across runs.

    python benchmarks/cpu_decode.py [--threads 2] [--gguf model.gguf] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

PROMPT_LEN, NEW_TOKENS = 64, 128


def build_checkpoint(folder: Path) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def bench_ours(folder: Path, prompts: list[list[int]]) -> float:
    from reasoning_engine import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", device="cpu", max_model_len=512, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def bench_transformers(folder: Path, prompt: list[int]) -> float:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) / elapsed


def bench_llama_cpp(gguf: Path, prompt: list[int], threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, verbose=False)
    start = time.perf_counter()
    count = 0
    for token in llm.generate(prompt, temp=0.0, top_k=1):
        count += 1
        if count == NEW_TOKENS:
            break
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, default=None, help="llama.cpp GGUF of the same checkpoint (see --keep)")
    parser.add_argument("--keep", type=Path, default=None, help="write the checkpoint here and keep it")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="cpu_decode_"))
    folder.mkdir(parents=True, exist_ok=True)
    params = build_checkpoint(folder) if not (folder / "config.json").exists() else None
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 16000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(args.batch)]
    results = {"parameters": params, "threads": args.threads}
    results["transformers_b1_tok_s"] = bench_transformers(folder, prompts[0])
    results["ours_b1_tok_s"] = bench_ours(folder, prompts[:1])
    results[f"ours_b{args.batch}_tok_s"] = bench_ours(folder, prompts)
    if args.gguf:
        results["llama_cpp_b1_tok_s"] = bench_llama_cpp(args.gguf, prompts[0], args.threads)
        results["ours_vs_llama_cpp_b1"] = results["ours_b1_tok_s"] / results["llama_cpp_b1_tok_s"]
    results["ours_vs_transformers_b1"] = results["ours_b1_tok_s"] / results["transformers_b1_tok_s"]
    results[f"ours_b{args.batch}_vs_b1"] = results[f"ours_b{args.batch}_tok_s"] / results["ours_b1_tok_s"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
