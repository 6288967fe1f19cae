"""One-row float32 products on CPU, the whole of a decode step's weight traffic: torch's F.linear on the weight as
stored ([out, in] row-major), on the same weight stored column-major, and our PackedLinear (oneDNN's blocked layout).

The shapes are those of benchmarks/cpu_decode.py's 87.5M Llama (10 layers of fused QKV, output, gate-up and down
projections, then the LM head: 332 MB, ten times the L3 cache, so every pass streams from memory). Reports GB/s of
weights read per second per layout, timed in interleaved rounds; compare the layouts within one run.

    python benchmarks/cpu_linear.py [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cpu_decode import MODEL

from reasoning_engine.layers.linear import PackedLinear


def weights() -> list[torch.Tensor]:
    """Random weights of cpu_decode.py's model: per layer fused QKV, output, fused gate-up, down; then the LM head."""
    hidden, heads, kv_heads = MODEL["hidden_size"], MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
    head_dim = hidden // heads
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
              (2 * MODEL["intermediate_size"], hidden), (hidden, MODEL["intermediate_size"])]
    torch.manual_seed(0)
    return ([torch.randn(o, i) * 0.02 for _ in range(MODEL["num_hidden_layers"]) for o, i in shapes]
            + [torch.randn(MODEL["vocab_size"], hidden) * 0.02])


def layouts(ws: list[torch.Tensor]) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    def linear(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: F.linear(x, w)

    def packed(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight = nn.Parameter(w, requires_grad=False)
        return PackedLinear(layer)

    return {"row-major F.linear": [linear(w) for w in ws],
            "column-major F.linear": [linear(w.t().contiguous().t()) for w in ws],
            "PackedLinear (oneDNN)": [packed(w) for w in ws]}


def one_pass(fns: list[Callable[[torch.Tensor], torch.Tensor]], inputs: list[torch.Tensor], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        for fn, x in zip(fns, inputs):
            fn(x)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10, help="passes over all weights per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ws = weights()
    inputs = [torch.randn(1, w.shape[1]) for w in ws]
    total = sum(w.numel() * w.element_size() for w in ws)
    fns = layouts(ws)
    reference = [F.linear(x, w) for x, w in zip(inputs, ws)]
    for name, layer_fns in fns.items():
        for fn, x, ref in zip(layer_fns, inputs, reference):
            torch.testing.assert_close(fn(x), ref, rtol=1e-4, atol=1e-5)
        one_pass(layer_fns, inputs, 2)
    rates: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, layer_fns in fns.items():
            rates[name].append(total / one_pass(layer_fns, inputs, args.reps) / 1e9)
    base = "row-major F.linear"
    print(f"{total / 1e6:.0f} MB of float32 weights per pass, {args.threads} threads, {args.rounds} rounds")
    print("| layout | GB/s per round | median GB/s | vs row-major (median of per-round ratios) |")
    print("|---|---|---:|---:|")
    for name, values in rates.items():
        ratio = statistics.median(v / b for v, b in zip(values, rates[base]))
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
