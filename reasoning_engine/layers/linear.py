"""Linear layers: split over tensor-parallel ranks, and repacked for CPU inference.

Tensor parallelism (Megatron-LM, Shoeybi et al., 2019, arXiv:1909.08053) needs only two kinds of layer here. A
column-parallel layer (QKV, gate-up, MLA's up-projections) is a plain `nn.Linear` holding its rank's output rows: its
output stays split, one head or channel slice per rank. A `RowParallelLinear` (attention output, MLP down) holds its
rank's input columns and sums the partial products with one all-reduce. The vocabulary is split into row blocks
(`VocabParallelEmbedding`, `ParallelLMHead`), padded to a multiple of the rank count.

A decode step multiplies one row (or a few) by every weight matrix, so on a CPU its speed is how fast the weights
stream from memory. The same product through oneDNN, with the weight reordered once into its blocked layout, reads
them faster than torch's float32 matrix-vector path, is also faster up to a few dozen rows and about even for long
prefills (benchmarks/cpu_linear.py, benchmarks/results/cpu_decode_packed_cpu_2026-11-30.md).
oneDNN ships inside torch's CPU builds; these are the ops Inductor's weight freezing uses for the same purpose.

A compiled graph cannot carry oneDNN's opaque blocked tensor. For `compile_decode` (engine/compiled_decode.py) a
packed layer therefore also keeps its plain weight, which the graph multiplies with `F.linear`; Inductor freezes it
into its own packed constant and picks its generated C++ kernel for one-row products where that is faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reasoning_engine.parallel import Group


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over `group`: each rank multiplies its slice (`weight` is
    [out, in / size]), one all-reduce sums the partial products, and the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group) -> None:
        super().__init__(in_features // group.size, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def row_parallel(in_features: int, out_features: int, bias: bool, group: Group) -> nn.Linear:
    """The layer an input-split projection needs: plain when there is nothing to split."""
    if group.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, group)


class VocabParallelEmbedding(nn.Module):
    """The embedding table split into row blocks of ceil(vocab / size): a rank looks up the ids in its block, zeros
    the others, and an all-reduce puts every row together. Padding rows past the vocabulary are zero."""

    def __init__(self, vocab_size: int, hidden_size: int, group: Group) -> None:
        super().__init__()
        self.group = group
        self.rows = group.padded_part(vocab_size)
        self.padding_rows = max(0, self.rows.stop - vocab_size)
        self.weight = nn.Parameter(torch.empty(len(self.rows), hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.rows.start
        outside = (local < 0) | (local >= len(self.rows))
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)

    def process_weights_after_loading(self) -> None:
        if self.padding_rows:
            self.weight.data[-self.padding_rows :] = 0.0


class ParallelLMHead(nn.Module):
    """The LM head split like `VocabParallelEmbedding` (so a tied head shares its table): each rank computes the
    logits of its block, an all-gather joins them and the padding columns are cut off."""

    def __init__(self, hidden_size: int, vocab_size: int, group: Group) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.rows = group.padded_part(vocab_size)
        self.padding_rows = max(0, self.rows.stop - vocab_size)
        self.weight = nn.Parameter(torch.empty(len(self.rows), hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.group.all_gather(F.linear(hidden, self.weight))  # [size, T, rows]
        return parts.permute(1, 0, 2).reshape(hidden.shape[0], self.group.size * len(self.rows))[:, : self.vocab_size]


def vocab_embedding(vocab_size: int, hidden_size: int, group: Group) -> nn.Module:
    if group.size == 1:  # explicit storage: skips nn.Embedding's random init, wasted work when every weight is loaded
        return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))
    return VocabParallelEmbedding(vocab_size, hidden_size, group)


def lm_head(hidden_size: int, vocab_size: int, group: Group) -> nn.Module:
    if group.size == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(hidden_size, vocab_size, group)


class PackedLinear(nn.Module):
    """A frozen float32 `nn.Linear` whose weight lives in oneDNN's blocked layout: same math, faster on CPU. A packed
    `RowParallelLinear` keeps its all-reduce and adds its bias after it."""

    def __init__(self, linear: nn.Linear, keep_plain: bool = False) -> None:
        super().__init__()
        self.group = linear.group if isinstance(linear, RowParallelLinear) else None
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.register_buffer("plain_weight", linear.weight.detach() if keep_plain else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.group is None else None
        if torch.compiler.is_compiling():
            if self.plain_weight is None:
                raise RuntimeError("a PackedLinear under torch.compile needs its plain weight: pack with keep_plain=True")
            out = F.linear(x, self.plain_weight, bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        if self.group is None:
            return out
        out = self.group.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (for checks; the eager forward never needs it)."""
        return self.weight.to_dense()

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return f"in_features={in_features}, out_features={out_features}, bias={self.bias is not None}"


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Packing applies to float32 weights on a CPU whose torch build has oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module, keep_plain: bool = False) -> int:
    """Replace every float32 CPU `nn.Linear` of `model` by a `PackedLinear`, except those whose weight is also used
    elsewhere (an LM head tied to the embedding table, which reads rows of it). Call once the weights are final:
    modules that derive tensors from a linear's weight (MLA's absorbed up-projections) have done so by then.
    Layers are packed one at a time and nothing else keeps the dense ones, so each is freed as soon as it is
    replaced: peak memory grows by one layer, not by the model. With `keep_plain` (for compiled decode graphs) every
    packed layer keeps its plain weight too, doubling the memory of these layers. Returns how many were packed."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(id(module))
    slots: dict[int, list[tuple[nn.Module, str]]] = {}  # a linear shared by several parents is packed once
    for parent in model.modules():
        for name, child in parent.named_children():
            if (isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32 and len(owners[id(child.weight)]) == 1):
                slots.setdefault(id(child), []).append((parent, name))
    for places in slots.values():
        parent, name = places[0]
        packed = PackedLinear(getattr(parent, name), keep_plain)
        for parent, name in places:
            setattr(parent, name, packed)
    return len(slots)
