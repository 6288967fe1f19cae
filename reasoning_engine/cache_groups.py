"""KV cache groups: the attention layers of a model sorted by the paged memory they need (the hybrid KV cache
manager idea: vLLM's, written anew here).

A "full" group's layers read every earlier position, so a request keeps all its blocks. A "sliding" group's layers read
only the last `window` positions up to each query, so the blocks wholly before the window of the step's first query
are given back as the sequence advances.

Groups draw their blocks from pools (`pool`: usually every group pool 0). Layer caches are shared between the groups
of one pool by position: the j-th layer of every group in the pool uses cache tensor j, so a block id, allocated to
one group, holds that group's layers and a block costs the memory of max(layers per group) layers (gpt-oss: its full
and sliding layers are alike, and one budget serves both). A group whose per-block footprint differs from the others'
gets its own pool, with its own block ids, block count and block bytes: DeepSeek-V4's compressed rows (a few rows per
block) and its per-token window (every layer's rows and compressor inputs per token), models/deepseek_v4.py. Sits
beside batch.py, below the layers: models say which group each of their attention layers is in, the engine keeps the
tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("full", "sliding")


@dataclass(frozen=True)
class CacheGroup:
    kind: str  # "full" or "sliding"
    layers: tuple[int, ...]  # indices into the model's attention_layers()
    window: int | None = None  # sliding: a query at position p reads the keys at positions above p - window
    pool: int = 0  # the block pool it draws from (pools are numbered from 0 without gaps)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"cache group kind: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == "sliding") != (self.window is not None and self.window > 0):
            raise ValueError(f"cache group window: a sliding group needs a positive window, a {self.kind} group none")
        if self.pool < 0:
            raise ValueError(f"cache group pool: must be >= 0, got {self.pool}")

    def first_needed_block(self, position: int, block_size: int) -> int:
        """The first block any query at `position` or later reads: the blocks before it can be given back. Counted
        conservatively (whole blocks below position - window), so a kernel tile that starts a position early never
        reaches a freed block."""
        if self.kind == "full":
            return 0
        return max(0, position - self.window) // block_size


def single_group(num_layers: int) -> list[CacheGroup]:
    """The groups of a model whose every attention layer reads its whole context."""
    return [CacheGroup("full", tuple(range(num_layers)))]


def groups_by_window(windows: list[int | None]) -> list[CacheGroup]:
    """Groups for layers given by their sliding window (None: full attention): the full layers first, so group 0
    keeps every block (draft models mirror its block ids), then one sliding group per window size."""
    full = tuple(i for i, w in enumerate(windows) if w is None)
    groups = [CacheGroup("full", full)] if full else []
    for window in sorted({w for w in windows if w is not None}):
        groups.append(CacheGroup("sliding", tuple(i for i, w in enumerate(windows) if w == window), window))
    return groups


def cache_dtypes(layer: Any, dtype: Any) -> list[Any]:
    """The dtype of each of a layer's cache tensors: its `cache_dtypes` (an FP8 cache's uint8 rows, scales
    included), or the model's `dtype` for all."""
    if hasattr(layer, "cache_dtypes"):
        return layer.cache_dtypes(dtype)
    return [dtype] * len(layer.cache_shape(1, 1))


def cache_bytes(layers: Sequence[Any], dtype: Any, block_size: int = 1) -> int:
    """Bytes one block of `block_size` tokens takes in the caches of these attention layers (their `cache_shape`
    in their `cache_dtypes`); with block_size 1, the bytes per token (a layer keeping one row per several tokens
    still takes its row)."""
    return sum(math.prod(shape) * kind.itemsize for layer in layers
               for shape, kind in zip(layer.cache_shape(1, block_size), cache_dtypes(layer, dtype)))


def state_bytes(layers: Sequence[Any], dtype: Any, slots: int) -> int:
    """Bytes `slots` slots take in the states of these linear-attention layers (their `state_shapes`: each state in
    its own dtype, or `dtype`): the memory of hybrid models' fixed-size group (engine/state_cache.py)."""
    return sum(math.prod(shape) * (kind or dtype).itemsize for layer in layers for shape, kind in layer.state_shapes(slots))


def shared_cache_layers(layers: Sequence[Any], groups: Sequence[CacheGroup], pool: int = 0) -> list[list[Any]]:
    """Per cache tensor j of block pool `pool`, the layers that share it: the j-th layer of every group in the pool."""
    shared: list[list[Any]] = []
    for group in groups:
        if group.pool != pool:
            continue
        for j, index in enumerate(group.layers):
            if j == len(shared):
                shared.append([])
            shared[j].append(layers[index])
    return shared


def pool_block_bytes(layers: Sequence[Any], groups: Sequence[CacheGroup], dtype: Any, block_size: int) -> list[int]:
    """Bytes one block id takes in each pool: per cache tensor of the pool, the block of the largest layer sharing
    it."""
    return [sum(max(cache_bytes([member], dtype, block_size) for member in members)
                for members in shared_cache_layers(layers, groups, pool)) for pool in range(num_pools(list(groups)))]


def group_names(groups: list[CacheGroup]) -> list[str]:
    """A label per group for metrics: its kind, with its index where two groups share a kind."""
    kinds = [g.kind for g in groups]
    return [g.kind if kinds.count(g.kind) == 1 else f"{g.kind}{i}" for i, g in enumerate(groups)]


def num_pools(groups: list[CacheGroup]) -> int:
    """How many block pools the groups draw from (checked to be numbered 0, 1, ... without gaps)."""
    pools = {g.pool for g in groups}
    if pools != set(range(len(pools))):
        raise ValueError(f"cache group pools must be numbered 0 to {len(pools) - 1}, got {sorted(pools)}")
    return len(pools)
