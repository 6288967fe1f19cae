"""torch.compile for CPU decode steps.

On a CPU, a decode step of a small model spends a good part of its time outside the matrix products: some 35 small
ops per layer (norms, rotary, cache write, attention, activation, residual adds) cost a few microseconds of dispatch
each, for a few hundred values. Inductor fuses them into a handful of generated C++ loops per layer. The torch
mixture-of-experts loop stays one opaque op (`reasoning_engine::fused_moe`), as its trip count depends on the routing.

The matrix products, LM head included, go to Inductor as well: the graphs are compiled with weight freezing and
max-autotune, so every linear weight becomes a constant of the graph, repacked once, and each product's kernel is
chosen by timing Inductor's generated C++ GEMM against the library one at its own shape. For one row the generated
kernel reads the weights ~1.5x faster than oneDNN does here, and a decode step of one sequence is bound by that read.
The graphs multiply the plain weights that packed layers keep for them (layers/linear.py) and hold repacked copies
besides: on the 87M-parameter benchmark model (350 MB of weights) the compiled engine took 1.5 GiB more memory than
the eager one.

Only pure decode steps of at most MAX_SEQS sequences take this path: prefill chunks, draft verification, larger
batches and steps that return intermediate layers (EAGLE-3) run eagerly. Larger batches are bound by arithmetic, not
by reading the weights: on the benchmark model (benchmarks/cpu_decode.py, 2 threads) compiled decoding ran 2.37x and
2.34x eager for one sequence (two runs, benchmarks/results/cpu_decode_guards_cpu_2026-12-02.md); before the guards
below were dropped, ~2x for two and 1.6x for four sequences, where an earlier graph over 2 to 32 sequences was 0.7x
eager at 32 (benchmarks/results/cpu_decode_compiled_cpu_2026-12-02.md).

The step is compiled as one graph (fullgraph) with dynamic shapes: one graph for a single sequence (torch always
specialises sizes 0 and 1) and one for 2 to MAX_SEQS, both for any context length, so steps do not recompile. The
runner compiles both when the engine starts (174 s for the benchmark model on 2 cores with Inductor's cache cold, most
of it timing the GEMM kernels), not during the first requests.
Dynamo guards each call of a compiled function: before it runs a graph it checks that everything the graph read
still holds, some 1,500 checks here, nearly all on the model (module types, attributes such as head counts, hooks,
the ids of the bound caches). The model is fixed once the engine is built, and its weights are constants of the
frozen graphs anyway, so those guards are dropped (`guard_filter_fn`); the ones on the batch, which pick between
the two graphs, stay. On the benchmark model a one-sequence step (~9 ms) through torch.compile took 1.1 ms longer
than the same compiled code called directly with all guards, 0.3 ms with the model's dropped (medians of 12
alternations).
Inductor's pattern rewrites are off: the one that turns matmul-softmax-matmul into fused attention fails on the
small-query attention path with dynamic shapes (torch 2.13).

In float32 the compiled steps give the eager tokens (tests/engine/test_compiled_decode.py). In bfloat16 they round
differently (fused loops keep float32 intermediates), as any compiled forward does.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.models.base import CausalLM

if TYPE_CHECKING:
    from torch._dynamo.types import GuardFilterEntry


class CompiledDecode:
    """The decode step compiled once: `run` replaces `model(batch)` and `model.compute_logits` for a step that
    `can_run`."""

    MAX_SEQS = 4

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.step = torch.compile(_own_code(self._step), dynamic=True, fullgraph=True,
                                  options={"pattern_matcher": False, "guard_filter_fn": self._keep_guard})
        self.num_steps = 0  # steps that ran the compiled graphs
        self.guards_kept = self.guards_dropped = 0  # over both graphs, counted as they compile

    def _keep_guard(self, entries: Sequence[GuardFilterEntry]) -> list[bool]:
        """Keep a guard unless it is on the model (its source is an attribute path under `self.model`). Should dynamo
        name sources otherwise, every guard is kept: slower, never wrong (the tests check that guards are dropped)."""
        keep = [not entry.name.startswith("self.model") for entry in entries]
        self.guards_kept += sum(keep)
        self.guards_dropped += len(keep) - sum(keep)
        return keep

    def _step(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and LM head in one graph: in a decode step every row is a sequence's last token."""
        hidden = self.model(batch)
        return hidden, self.model.compute_logits(hidden)

    def can_run(self, batch: ForwardBatch) -> bool:
        """One query token per sequence, no draft tree, at most MAX_SEQS sequences."""
        return batch.max_query_len == 1 and batch.tree_mask is None and 0 < batch.num_seqs <= self.MAX_SEQS

    def warm_up(self, batch: ForwardBatch) -> None:
        """Compile the graph this decode batch needs (the runner does so for one and three sequences at start).
        Freezing is read from Inductor's global config when a graph compiles, not from torch.compile's options."""
        with torch._inductor.config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"):
            self.step(batch)

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [num_seqs, hidden] and float32 logits [num_seqs, vocab]; `batch.attn_metadata` must be
        prepared, as for the eager forward."""
        self.num_steps += 1
        return self.step(batch)


def _own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The bound method over a copy of its code object. torch.compile keeps its graphs per code object, so without
    the copy every model of one class in the process would share a cache: each step would check the guards of the
    others' graphs, and the fifth model would hit dynamo's limit of eight graphs per function."""
    func = method.__func__
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    return types.MethodType(copy, method.__self__)
