"""What verifying drafts costs a decode step: steps of N decoding sequences where some of them verify a draft, timed
side by side with the plain decode step of the same N, on this machine's engine (torch path unless --kernels).

The adaptive engine's cost model needs this shape of cost (a step that verifies anything leaves the decode fast path
as a whole, then each draft adds its tokens), and the torch attention must not pad every decode to the longest
draft's length. Each step's tokens are written to the padding block, which no request owns.

    python benchmarks/verify_step.py [--model DIR] [--context 300] [--repeats 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reasoning_engine.adaptive.cost_model import StepShape  # noqa: E402
from reasoning_engine.engine.tuning import synthetic_step  # noqa: E402
from reasoning_engine.engine.worker import StepInput  # noqa: E402
from reasoning_engine.llm import LLM  # noqa: E402

# (sequences, of which drafting, draft tokens each)
CASES = [(8, 0, 0), (8, 1, 2), (16, 0, 0), (16, 1, 2), (32, 0, 0), (32, 1, 2), (32, 1, 8), (32, 3, 2), (32, 3, 8),
         (32, 32, 2)]


def step(padding_block: int, block_size: int, context: int, sequences: int, drafting: int, draft: int) -> StepInput:
    """`sequences` decoding sequences of `context` tokens, the first `drafting` verifying a chain of `draft` tokens."""
    shape = StepShape(sequences + drafting * draft, sequences, sequences * context, drafting * draft,
                      draft_sequences=drafting)
    return synthetic_step(shape, padding_block, block_size, context + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled tiny reasoner)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--kernels", default="torch", help="kernel backend (torch | triton)")
    args = parser.parse_args()
    llm = LLM(args.model, dtype="float32", kernel_backend=args.kernels,
              speculative_config={"method": "suffix", "num_speculative_tokens": 8})
    runner = llm.engine.runner
    block_size = llm.engine.config.block_size
    steps = {case: step(runner.num_blocks, block_size, args.context, *case) for case in CASES}
    times: dict[tuple[int, int, int], list[float]] = {case: [] for case in CASES}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every case alike
        for case, s in steps.items():
            begin = time.perf_counter()
            runner.executor.execute_model([s])
            times[case].append(time.perf_counter() - begin)
    median = {case: statistics.median(ts[len(ts) // 5:]) for case, ts in times.items()}
    print("| sequences | verifying | draft tokens each | step (ms) | / plain decode of the same batch |")
    print("|---|---|---|---|---|")
    for (sequences, drafting, draft), seconds in median.items():
        ratio = seconds / median[(sequences, 0, 0)]
        print(f"| {sequences} | {drafting} | {draft} | {1e3 * seconds:.1f} | {ratio:.2f}x |")
    llm.shutdown()


if __name__ == "__main__":
    main()
