"""CPU decode speed, side by side in one run: our engine vs transformers' generate (and llama.cpp when installed).

An ~87M-parameter Llama-shaped random checkpoint in float32, 2 threads, prompt 64 tokens, 128 new tokens:
- batch-1 decode tokens/s: ours, transformers `generate`, llama-cpp-python (optional peer: needs a GGUF of the
  same weights made with llama.cpp's converter outside this repo, passed with --gguf; benchmarks/llama_cpp_peer.sh
  builds llama.cpp, converts and runs this benchmark);
- 32 concurrent requests: aggregate tokens/s over our own batch-1;
- with --compile, the same two for our engine with `compile_decode=True` (torch.compile of the decode steps).
Ratios are what to report: the machine is shared and noisy, absolute numbers are not comparable across runs;
the engines are loaded once and timed in interleaved rounds, and each ratio is the median of its per-round values.

    python benchmarks/cpu_decode.py [--threads 2] [--rounds 3] [--compile] [--gguf model.gguf] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

PROMPT_LEN, NEW_TOKENS = 64, 128
# The benchmark model: ~87.5M parameters, Llama-shaped (benchmarks/cpu_linear.py reads its weight shapes from here).
MODEL = dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=12,
             num_key_value_heads=4)


def build_checkpoint(folder: Path) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, max_position_embeddings=2048)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


Runner = Callable[[list[list[int]]], float]


def load_ours(folder: Path, compile_decode: bool = False) -> Runner:
    from reasoning_engine import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", device="cpu", max_model_len=512, enable_prefix_caching=False,
              compile_decode=compile_decode)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(10, 18))}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                             ignore_eos=True))

    def run(prompts: list[list[int]]) -> float:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    return run


def load_transformers(folder: Path) -> Runner:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        model.generate(torch.arange(10, 18)[None], max_new_tokens=4, do_sample=False)

    def run(prompts: list[list[int]]) -> float:
        ids = torch.tensor(prompts[:1])
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            elapsed = time.perf_counter() - start
        return (out.shape[1] - ids.shape[1]) / elapsed

    return run


def load_llama_cpp(gguf: Path, threads: int) -> Runner:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, verbose=False)

    def run(prompts: list[list[int]]) -> float:
        llm.reset()
        start = time.perf_counter()
        count = 0
        for _ in llm.generate(prompts[0], temp=0.0, top_k=1, reset=True):
            count += 1
            if count == NEW_TOKENS:
                break
        return count / (time.perf_counter() - start)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, default=None, help="llama.cpp GGUF of the same checkpoint (see --keep)")
    parser.add_argument("--keep", type=Path, default=None, help="write the checkpoint here and keep it")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (ratios per round)")
    parser.add_argument("--compile", action="store_true", help="also time our engine with compile_decode=True")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="cpu_decode_"))
    folder.mkdir(parents=True, exist_ok=True)
    params = build_checkpoint(folder) if not (folder / "config.json").exists() else None
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 16000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(args.batch)]
    runners: dict[str, tuple[Runner, list[list[int]]]] = {
        "transformers_b1": (load_transformers(folder), prompts[:1]),
        "ours_b1": (load_ours(folder), prompts[:1]),
    }
    runners[f"ours_b{args.batch}"] = (runners["ours_b1"][0], prompts)
    if args.compile:
        runners["compiled_b1"] = (load_ours(folder, compile_decode=True), prompts[:1])
        runners[f"compiled_b{args.batch}"] = (runners["compiled_b1"][0], prompts)
    if args.gguf:
        runners["llama_cpp_b1"] = (load_llama_cpp(args.gguf, args.threads), prompts[:1])
    # Interleaved rounds: the machine's speed drifts by tens of percent over minutes, so every engine is timed in
    # every round and the ratios are taken round by round (their median is reported), never across minutes.
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        rounds.append({name: run(batch) for name, (run, batch) in runners.items()})
    ratios = {"ours_vs_transformers_b1": ("ours_b1", "transformers_b1"),
              f"ours_b{args.batch}_vs_b1": (f"ours_b{args.batch}", "ours_b1")}
    if args.gguf:
        ratios["ours_vs_llama_cpp_b1"] = ("ours_b1", "llama_cpp_b1")
    if args.compile:
        ratios.update({"compiled_vs_eager_b1": ("compiled_b1", "ours_b1"),
                       f"compiled_vs_eager_b{args.batch}": (f"compiled_b{args.batch}", f"ours_b{args.batch}"),
                       "compiled_vs_transformers_b1": ("compiled_b1", "transformers_b1"),
                       f"compiled_b{args.batch}_vs_b1": (f"compiled_b{args.batch}", "compiled_b1")})
        if args.gguf:
            ratios["compiled_vs_llama_cpp_b1"] = ("compiled_b1", "llama_cpp_b1")
    results: dict[str, object] = {"parameters": params, "threads": args.threads, "rounds": args.rounds}
    for name in runners:
        results[f"{name}_tok_s"] = [round(r[name], 1) for r in rounds]
    for name, (num, den) in ratios.items():
        per_round = [r[num] / r[den] for r in rounds]
        results[name] = {"median": round(statistics.median(per_round), 3), "per_round": [round(x, 3) for x in per_round]}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
