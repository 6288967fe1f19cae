"""Linear layers repacked for CPU inference.

A decode step multiplies one row (or a few) by every weight matrix, so on a CPU its speed is how fast the weights
stream from memory. On our 2-core benchmark machine torch's float32 matrix-vector path reads ~15-20 GB/s; the same
product through oneDNN, with the weight reordered once into its blocked layout, reads ~20-27 GB/s (~1.4x), is also
faster up to a few dozen rows and about even for long prefills (benchmarks/cpu_linear.py,
benchmarks/results/cpu_decode_packed_cpu_2026-11-30.md).
oneDNN ships inside torch's CPU builds; these are the ops Inductor's weight freezing uses for the same purpose.

A compiled graph cannot carry oneDNN's opaque blocked tensor. For `compile_decode` (engine/compiled_decode.py) a
packed layer therefore also keeps its plain weight, which the graph multiplies with `F.linear`; Inductor freezes it
into its own packed constant and picks its generated C++ kernel for one-row products where that is faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinear(nn.Module):
    """A frozen float32 `nn.Linear` whose weight lives in oneDNN's blocked layout: same math, faster on CPU."""

    def __init__(self, linear: nn.Linear, keep_plain: bool = False) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.register_buffer("plain_weight", linear.weight.detach() if keep_plain else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self.plain_weight is None:
                raise RuntimeError("a PackedLinear under torch.compile needs its plain weight: pack with keep_plain=True")
            return F.linear(x, self.plain_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

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
