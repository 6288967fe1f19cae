"""ShardedRMSNorm (MiniMax-M2's q/k norm over all heads, split over tensor-parallel ranks): each rank's output is its
slice of the unsplit norm, because the statistic is all-reduced over the ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reasoning_engine.engine.distributed import free_port
from reasoning_engine.layers.norm import RMSNorm, ShardedRMSNorm
from reasoning_engine.parallel import Group

DIM, RANKS = 48, 2


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(5, DIM, generator=gen) * 3, 1 + 0.2 * torch.randn(DIM, generator=gen)


def _rank(rank: int, port: int, dtype: torch.dtype, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        x, weight = _inputs()
        part = slice(rank * DIM // RANKS, (rank + 1) * DIM // RANKS)
        norm = ShardedRMSNorm(DIM, 1e-6, Group(rank, RANKS, dist.group.WORLD))
        with torch.no_grad():
            norm.weight.copy_(weight[part])
            out[rank] = norm(x[:, part].to(dtype))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_rms_norm_equals_the_unsplit_norm(dtype: torch.dtype) -> None:
    x, weight = _inputs()
    whole = RMSNorm(DIM, 1e-6)
    with torch.no_grad():
        whole.weight.copy_(weight)
        want = whole(x.to(dtype))
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(free_port(), dtype, out), nprocs=RANKS)
        got = torch.cat([out[r] for r in range(RANKS)], dim=1)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_sharded_rms_norm_on_one_rank_is_rms_norm() -> None:
    x, weight = _inputs()
    whole, sharded = RMSNorm(DIM, 1e-6), ShardedRMSNorm(DIM, 1e-6)
    with torch.no_grad():
        whole.weight.copy_(weight)
        sharded.weight.copy_(weight)
        assert torch.equal(sharded(x), whole(x))
