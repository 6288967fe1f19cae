"""torch.compile for CPU decode steps.

On a CPU, a decode step of a small model spends a good part of its time outside the matrix products: some 35 small
ops per layer (norms, rotary, cache write, attention, activation, residual adds) cost a few microseconds of dispatch
each, for a few hundred values. Inductor fuses them into a handful of generated C++ loops per layer. The torch
mixture-of-experts loop stays one opaque op (`reasoning_engine::fused_moe`), as its trip count depends on the routing.

The matrix products, LM head included, go to Inductor as well: the graphs are compiled with weight freezing, so
every linear weight becomes a constant of the graph, repacked once, and those for up to MAX_SEQS sequences with
max-autotune, so each product's kernel is chosen by timing Inductor's generated C++ GEMM against the library one at
its own shape. For one row the generated kernel reads the weights ~1.5x faster than oneDNN does here, and a decode
step of one sequence is bound by that read. The graphs multiply the plain weights that packed layers keep for them
(layers/linear.py) and hold repacked copies besides: on the 87M-parameter benchmark model (350 MB of weights) the
compiled engine took 1.5 GiB more memory than the eager one.

Pure decode steps take this path, a hybrid model's too (its linear-attention state addressed by tensors alone,
layers/linear_attention.DecodeStateMetadata); prefill chunks, draft verification and steps that return intermediate
layers (EAGLE-3) run eagerly.
Steps of up to MAX_SEQS sequences are bound by reading the weights, and run the max-autotune graphs: on the benchmark model (benchmarks/cpu_decode.py, 2 threads) compiled decoding ran 2.37x and 2.34x eager for
one sequence (two runs, benchmarks/results/cpu_decode_guards_cpu_2026-12-02.md). Larger steps are bound by arithmetic
and run a third graph, compiled without max-autotune: there Inductor's weight freezing packs each linear weight for
oneDNN, as the eager path does (layers/linear.py), where the generated GEMM kernels were slower (an earlier
max-autotune graph over 2 to 32 sequences was 0.7x eager at 32,
benchmarks/results/cpu_decode_compiled_cpu_2026-12-02.md).
What the third graph gains is everything around the products: norms, rotary, activations and the attention.

Every graph attends through `decode_attention` (kernels/attention.py; the step's metadata says `fused_decode`): loops
that read the paged cache in place, where the eager path gathers copies of each sequence's keys and values and lays
the keys out for a matrix product. At 32 sequences that attention took a third of an eager step.

The step is compiled as one graph (fullgraph) with dynamic shapes: one graph for a single sequence (torch always
specialises sizes 0 and 1), one for 2 to MAX_SEQS and one for more, all for any context length, so steps do not
recompile. The runner compiles the three (those max_num_seqs lets a step use) when the engine starts (226 s for the
benchmark model on 2 cores with Inductor's cache cold, most of it timing the GEMM kernels), not during the first
requests.
Dynamo guards each call of a compiled function: before it runs a graph it checks that everything the graph read
still holds, some 1,500 checks here, nearly all on the model (module types, attributes such as head counts, hooks,
the ids of the bound caches). The model is fixed once the engine is built, and its weights are constants of the
frozen graphs anyway, so those guards are dropped (`guard_filter_fn`); the ones on the batch, which pick between
the one-sequence graph and the 2-to-MAX_SEQS one, stay. On the benchmark model a one-sequence step (~9 ms) through
torch.compile took 1.1 ms longer than the same compiled code called directly with all guards, 0.3 ms with the
model's dropped (medians of 12 alternations).
Inductor's pattern rewrites are off: the one that turns matmul-softmax-matmul into fused attention failed on the
gather path's attention with dynamic shapes (torch 2.13), when the graphs still attended that way. Weight freezing's
packing of the linear layers does not depend on them.

In float32 the compiled steps give the eager tokens (tests/engine/test_compiled_decode.py). In bfloat16 they round
differently (fused loops keep float32 intermediates), as any compiled forward does.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels.attention import MixedAttentionMetadata
from reasoning_engine.layers.linear_attention import DecodeStateMetadata
from reasoning_engine.models.base import CausalLM

if TYPE_CHECKING:
    from torch._dynamo.types import GuardFilterEntry


class CompiledDecode:
    """The decode step compiled once: `run` replaces `model(batch)` and `model.compute_logits` for a step that
    `can_run`."""

    MAX_SEQS = 4  # the largest step of the max-autotune graphs; larger ones take the third graph

    def __init__(self, model: CausalLM) -> None:
        """`model`: its caches bound. A hybrid model's linear-attention state tensors are marked static: with
        dynamic shapes dynamo would give a batch size equal to one of their sizes (the conv state's K-1 = 3) the
        same symbol and specialise the graph to it."""
        self.model = model
        self.hybrid = bool(model.linear_layers())
        for layer in model.linear_layers():
            for tensor in (layer.conv_state, layer.recurrent_state):
                torch._dynamo.mark_static(tensor)
        options = {"pattern_matcher": False, "guard_filter_fn": self._keep_guard}
        # two code objects, so that dynamo keeps the graphs for up to MAX_SEQS sequences apart from the larger one
        self.step = torch.compile(_own_code(self._step), dynamic=True, fullgraph=True, options=options)
        self.large_step = torch.compile(_own_code(self._step), dynamic=True, fullgraph=True, options=options)
        self.num_steps = 0  # steps of up to MAX_SEQS sequences
        self.num_large_steps = 0  # steps of more
        self.guards_kept = self.guards_dropped = 0  # over all graphs, counted as they compile

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
        """One query token per sequence, no draft tree, and contexts even enough to attend as one batch (a step
        the attention splits by length runs eager: a graph traced over one split would not fit the next); a hybrid
        model's linear-attention state addressed by tensors alone (`DecodeStateMetadata`)."""
        return (batch.max_query_len == 1 and batch.tree_mask is None and batch.num_seqs > 0
                and not any(isinstance(view.attn_metadata, MixedAttentionMetadata) for view in batch.with_groups())
                and (not self.hybrid or isinstance(batch.state_metadata, DecodeStateMetadata)))

    def warm_up(self, batch: ForwardBatch) -> None:
        """Compile the graph this decode batch needs (the runner does so for one, three and MAX_SEQS + 1 sequences
        at start). Freezing and max-autotune are read from Inductor's global config when a graph compiles, not from
        torch.compile's options; the large graph is compiled without max-autotune."""
        small = batch.num_seqs <= self.MAX_SEQS
        autotune = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"} if small else {}
        with torch._inductor.config.patch(freezing=True, **autotune):
            self._forward(batch)

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [num_seqs, hidden] and float32 logits [num_seqs, vocab]; `batch.attn_metadata` must be
        prepared, as for the eager forward."""
        if batch.num_seqs <= self.MAX_SEQS:
            self.num_steps += 1
        else:
            self.num_large_steps += 1
        return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        for view in batch.with_groups():  # a hybrid model's other KV cache groups have their own metadata
            view.attn_metadata.fused_decode = True
        return (self.step if batch.num_seqs <= self.MAX_SEQS else self.large_step)(batch)


def _own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The bound method over a copy of its code object. torch.compile keeps its graphs per code object, so without
    the copy every model of one class in the process would share a cache: each step would check the guards of the
    others' graphs, and the fifth model would hit dynamo's limit of eight graphs per function."""
    func = method.__func__
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    return types.MethodType(copy, method.__self__)
