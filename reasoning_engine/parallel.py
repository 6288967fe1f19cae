"""Which ranks a layer shares its work with, and the collectives it calls.

Defined below the layers (like `batch.py`) so that a layer never imports the engine, which is what starts the
processes and builds these groups (`engine/distributed.py`). A model built without them (`Parallel()`) is the plain
single-process model: every group has size 1 and no collective is ever called.

- `tp`: tensor parallelism (Megatron-LM, Shoeybi et al., 2019, arXiv:1909.08053): attention heads, dense MLPs, the
  embedding and the LM head are split over these ranks; each block ends in one all-reduce.
- `ep`: expert parallelism (GShard, Lepikhin et al., 2020, arXiv:2006.16668): the routed experts are partitioned over
  these ranks, each keeping E / size of them whole. None when expert parallelism is off: the experts are then split
  like dense MLPs over `tp`.
- `dp`: the ranks that hold the same tensor-parallel shard in different data-parallel replicas. With expert
  parallelism their attention runs data-parallel (each has its own requests and KV cache) and the MoE layers gather
  every replica's tokens over this group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CollectiveTimer:
    """Wall time spent inside collectives, for the parallel benchmark's breakdown of a step."""

    seconds: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


COLLECTIVES = CollectiveTimer()


@dataclass(frozen=True)
class Group:
    """A set of ranks sharing one layer's work. Size 1 (the default) means no communication."""

    rank: int = 0
    size: int = 1
    handle: dist.ProcessGroup | None = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group, in place."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        dist.all_reduce(x, group=self.handle)
        _count(start)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (equal shapes), stacked along dim 0 in rank order: [size, *x.shape]."""
        if self.size == 1:
            return x.unsqueeze(0)
        start = time.perf_counter()
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x, group=self.handle)
        _count(start)
        return out.view(self.size, *x.shape)

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows of `x`, concatenated in rank order, where rank i has counts[i] rows (every rank passes
        the same counts): each pads to the largest count for one all-gather."""
        if self.size == 1:
            return x
        padded = x.new_zeros((max(counts), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = self.all_gather(padded)
        return torch.cat([parts[i, :n] for i, n in enumerate(counts)])

    def part(self, total: int, what: str) -> range:
        """This rank's contiguous share of `total` items (heads, experts, channels) that must split evenly; the
        error names what was split, so a user sees which size their rank count must divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the {self.size} ranks it is split over")
        share = total // self.size
        return range(self.rank * share, (self.rank + 1) * share)

    def padded_part(self, total: int) -> range:
        """This rank's share when `total` is padded up to a multiple of the size (vocabulary rows): the last ranks'
        ranges may reach past `total`."""
        share = -(-total // self.size)
        return range(self.rank * share, (self.rank + 1) * share)


def _count(start: float) -> None:
    COLLECTIVES.seconds += time.perf_counter() - start
    COLLECTIVES.calls += 1


@dataclass(frozen=True)
class Parallel:
    """The groups this process's model shard belongs to (see the module docstring)."""

    tp: Group = Group()
    ep: Group | None = None
    dp: Group = Group()

    @property
    def gathers_tokens(self) -> bool:
        """MoE layers gather tokens from the other data-parallel replicas (DP attention with expert parallelism)."""
        return self.ep is not None and self.dp.size > 1
