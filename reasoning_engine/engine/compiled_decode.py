"""torch.compile for CPU decode steps.

On a CPU, a decode step of a small model spends a good part of its time outside the matrix products: some 35 small
ops per layer (norms, rotary, cache write, attention, activation, residual adds) cost a few microseconds of dispatch
each, for a few hundred values. Inductor fuses them into a handful of generated C++ loops per layer. Two pieces stay
opaque ops inside the graph: the packed linear layers (`reasoning_engine::packed_linear`, layers/linear.py), whose
oneDNN weight a graph cannot hold, and the torch mixture-of-experts loop (`reasoning_engine::fused_moe`), whose trip
count depends on the routing.

Only pure decode steps of at most MAX_SEQS sequences take this path: prefill chunks, draft verification, larger
batches and steps that return intermediate layers (EAGLE-3) run eagerly. Larger batches are bound by their matrix
products, not by dispatch: on the 87M-parameter benchmark model (benchmarks/cpu_decode.py, 2 threads) the compiled
step was 1.15x and 1.23x eager for one sequence (two runs), ~1.2x for two, ~1.0x for 4 to 16 and 0.95x for 32.

The forward is compiled as one graph (fullgraph) with dynamic shapes: one graph for a single sequence (torch always
specialises sizes 0 and 1) and one for 2 to MAX_SEQS, both for any context length, so steps do not recompile. The
runner compiles both when the engine starts (76 s for the 87M benchmark model on 2 cores, Inductor's cache cold), not
during the first requests.
Inductor's pattern rewrites are off: the one that turns matmul-softmax-matmul into fused attention fails on the
small-query attention path with dynamic shapes (torch 2.13), and the others target training graphs or linears, which
here are the opaque op.

In float32 the compiled steps give the eager tokens (tests/engine/test_compiled_decode.py). In bfloat16 they round
differently (fused loops keep float32 intermediates), as any compiled forward does.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.models.base import CausalLM


class CompiledDecode:
    """The model forward compiled once for decode batches; `run` replaces `model(batch)` for a step that `can_run`."""

    MAX_SEQS = 4

    def __init__(self, model: CausalLM) -> None:
        self.forward = torch.compile(_own_code(model.forward), dynamic=True, fullgraph=True,
                                     options={"pattern_matcher": False})
        self.num_steps = 0  # steps that ran the compiled forward

    def can_run(self, batch: ForwardBatch) -> bool:
        """One query token per sequence, no draft tree, at most MAX_SEQS sequences."""
        return batch.max_query_len == 1 and batch.tree_mask is None and 0 < batch.num_seqs <= self.MAX_SEQS

    def warm_up(self, batch: ForwardBatch) -> None:
        """Compile the graph this decode batch needs (the runner does so for one and three sequences at start)."""
        self.forward(batch)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [num_seqs, hidden]; `batch.attn_metadata` must be prepared, as for the eager forward."""
        self.num_steps += 1
        return self.forward(batch)


def _own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The bound method over a copy of its code object. torch.compile keeps its graphs per code object, so without
    the copy every model of one class in the process would share a cache: each step would check the guards of the
    others' graphs, and the fifth model would hit dynamo's limit of eight graphs per function."""
    func = method.__func__
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    return types.MethodType(copy, method.__self__)
