"""torch.compile for CPU decode steps.

A CPU decode step of a small model spends much of its time outside the matrix products, in dozens of small ops per
layer (norms, rotary, cache write, attention, activation, residual adds) that Inductor fuses into a few generated
loops. Only pure decode steps take this path, a hybrid model's too (its linear-attention state addressed by tensors
alone, layers/linear_attention.DecodeStateMetadata); prefill chunks, draft verification and steps that return intermediate
layers (EAGLE-3) run eagerly.

- Three graphs, compiled when the engine starts, not during the first requests: one sequence (torch always
  specialises sizes 0 and 1), 2 to MAX_SEQS, and more; each whole (fullgraph) with dynamic shapes, for any context
  length, so steps never recompile.
- Weights are frozen into the graphs. The two small graphs use max-autotune: each product's kernel is picked by timing
  Inductor's generated C++ GEMM against the library's, and for one row the generated kernel reads the weights faster,
  which is what such a step is bound by. The large graph, bound by arithmetic, keeps oneDNN's packed products as the
  eager path does (layers/linear.py) and gains the fused ops around them. The graphs multiply the plain weights that
  packed layers keep for them, so compiled decoding holds more memory than eager.
- Attention reads the paged cache in place (`kernels.attention.decode_attention`, the step's metadata says
  `fused_decode`) instead of gathering copies of each sequence's keys and values.
- The mixture-of-experts loop stays one opaque op (`reasoning_engine::fused_moe`): its trip count depends on the routing.
- Dynamo's guards on the model are dropped (`guard_filter_fn`): the model is fixed once the engine is built and its
  weights are graph constants anyway; the guards on the batch, which pick the graph, stay.
- Inductor's pattern rewrites are off: the matmul-softmax-matmul one failed on attention with dynamic shapes
  (torch 2.13); weight freezing's packing does not depend on them.

In float32 the compiled steps give the eager tokens (tests/engine/test_compiled_decode.py); in bfloat16 they round
differently (fused loops keep float32 intermediates), as any compiled forward does. The measurements behind these
choices are in docs/measurements.md.
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
