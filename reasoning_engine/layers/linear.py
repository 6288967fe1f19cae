"""Linear layers repacked for CPU inference.

A decode step multiplies one row (or a few) by every weight matrix, so on a CPU its speed is how fast the weights
stream from memory. On our 2-core benchmark machine torch's float32 matrix-vector path reads ~15-20 GB/s; the same
product through oneDNN, with the weight reordered once into its blocked layout, reads ~20-27 GB/s (~1.4x), is also
faster up to a few dozen rows and about even for long prefills (benchmarks/cpu_linear.py,
benchmarks/results/cpu_decode_packed_cpu_2026-11-30.md).
oneDNN ships inside torch's CPU builds; these are the ops Inductor's weight freezing uses for the same purpose.

A compiled graph cannot carry oneDNN's opaque blocked tensor, so under `torch.compile` (engine/compiled_decode.py) a
packed layer calls the custom op `reasoning_engine::packed_linear` with its handle, an int the graph can hold.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

_packed_layers: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_next_handle = itertools.count()


@torch.library.custom_op("reasoning_engine::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """The product of the PackedLinear with this handle: one opaque op in a compiled graph."""
    layer = _packed_layers[handle]
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """A frozen float32 `nn.Linear` whose weight lives in oneDNN's blocked layout: same math, faster on CPU."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.handle = next(_next_handle)
        _packed_layers[self.handle] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.weight.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (for checks; the forward never needs it)."""
        return self.weight.to_dense()

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return f"in_features={in_features}, out_features={out_features}, bias={self.bias is not None}"


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Packing applies to float32 weights on a CPU whose torch build has oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 CPU `nn.Linear` of `model` by a `PackedLinear`, except those whose weight is also used
    elsewhere (an LM head tied to the embedding table, which reads rows of it). Call once the weights are final:
    modules that derive tensors from a linear's weight (MLA's absorbed up-projections) have done so by then.
    Layers are packed one at a time and nothing else keeps the dense ones, so each is freed as soon as it is
    replaced: peak memory grows by one layer, not by the model. Returns how many layers were packed."""
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
        packed = PackedLinear(getattr(parent, name))
        for parent, name in places:
            setattr(parent, name, packed)
    return len(slots)
