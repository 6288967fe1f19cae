"""Wall-clock speed-up of speculative decoding at batch 1 on the CPU, side by side in one run.

A repetitive agentic-style workload on the bundled tiny reasoning model: a session of chat requests, one at a time,
where later requests revisit problems the model already solved (as agents re-read files and redo steps). Each method
decodes the same requests greedily; the outputs must equal plain decoding token for token, and the figure is the
ratio of wall-clock time (plain / method) for the whole session.

    python benchmarks/spec_speedup.py [--model DIR] [--methods suffix,mtp,ngram] [--k 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from reasoning_engine import LLM, SamplingParams


def session(seed: int, count: int) -> list[list[dict[str, str]]]:
    """Problems drawn once, then revisited in a shuffled second pass: the repetition speculation feeds on."""
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        kind = rng.choice(["add", "sub", "sort", "larger"])
        if kind == "add":
            problems.append(f"What is {rng.randint(100, 999)} + {rng.randint(100, 999)}?")
        elif kind == "sub":
            a, b = sorted(rng.sample(range(100, 1000), 2), reverse=True)
            problems.append(f"What is {a} - {b}?")
        elif kind == "sort":
            problems.append("Sort these numbers: " + ", ".join(str(rng.randint(1, 99)) for _ in range(5)))
        else:
            problems.append(f"Which is larger, {rng.randint(100, 999)} or {rng.randint(100, 999)}?")
    revisit = problems[:]
    rng.shuffle(revisit)
    return [[{"role": "user", "content": text}] for text in problems + revisit]


def run(model: str | None, spec: dict | None, conversations: list, max_tokens: int) -> tuple[float, list[list[int]], dict]:
    llm = LLM(model, dtype="float32", device="cpu", speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(conversations[0], params)  # warm-up (and the suffix tree sees one output, as in a running server)
    start = time.perf_counter()
    outputs = [llm.chat(c, params)[0].outputs[0].token_ids for c in conversations]
    return time.perf_counter() - start, outputs, llm.engine.stats().spec_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled tiny model)")
    parser.add_argument("--methods", default="suffix,mtp,ngram")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--problems", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    conversations = session(0, args.problems)
    plain_time, plain, _ = run(args.model, None, conversations, args.max_tokens)
    tokens = sum(len(o) for o in plain)
    results = {"requests": len(conversations), "output_tokens": tokens, "plain_tok_s": tokens / plain_time}
    for method in args.methods.split(","):
        elapsed, outputs, stats = run(args.model, {"method": method, "num_speculative_tokens": args.k}, conversations,
                                      args.max_tokens)
        results[method] = {"speedup": plain_time / elapsed, "identical_to_plain": outputs == plain,
                           "mean_acceptance_length": stats.get("mean_acceptance_length"),
                           "acceptance_rate": stats.get("acceptance_rate")}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
