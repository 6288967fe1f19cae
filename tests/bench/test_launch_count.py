"""benchmarks/launch_count.py: the launch counter against a hand-written toy step of known launches, and the count of
a tiny dummy deepseek_v3 decode step on the Triton path (interpreted on CPU) holding together."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from .scripts import load_script


@pytest.fixture(scope="module")
def launch_count() -> ModuleType:
    return load_script("launch_count")


def test_counts_a_hand_written_three_kernel_step(launch_count: ModuleType) -> None:
    """Two Triton launches and one torch kernel (the add); views, bare allocations and warm-ups are no launches, nor
    are the torch ops Triton's interpreter runs inside a launch."""
    from reasoning_engine.kernels import triton_norm  # noqa: F401  (first: selects the interpreter without a GPU)

    import triton
    import triton.language as tl

    @triton.jit
    def double(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.ones(8, device=device)
    log: list[tuple[str, str, str]] = []
    with launch_count.counting_launches(log, lambda: "toy"):
        double[(1,)](x, 8, BLOCK=8)
        y = x.view(2, 4).t()  # views: no kernel
        z = torch.empty(4, device=device)  # allocation alone: no kernel
        double[(1,)](x, 8, BLOCK=8)
        w = y + 1
    assert [(kind, name) for _, kind, name in log] == [("triton", "double"), ("triton", "double"), ("torch", "add")]
    assert torch.equal(x, torch.full((8,), 4.0, device=device)) and w.shape == (4, 2) and z.numel() == 4
    summary = launch_count.summarize(log)
    assert summary == {"total": 3, "triton": 2, "torch": 1, "triton_kernels": {"double": 2}, "torch_ops": {"add": 1}}


def test_tiny_deepseek_v3_decode_step_counts(launch_count: ModuleType) -> None:
    """A 3-layer (1 dense + 2 MoE) deepseek_v3 of Moonlight's structure at tiny widths: one prefill then one decode
    forward; every MoE layer launches the same kernels, Triton's MoE GEMMs (gate_up, down) and MLA decode among them;
    the per-layer summaries add up to the step."""
    gpu_check = load_script("gpu_check")
    result = launch_count.count_decode_step(dict(gpu_check.TINY_CONFIG, num_hidden_layers=3),
                                            "cuda" if torch.cuda.is_available() else "cpu")
    assert result["forward_passes"] == 2
    moe, dense, other = result["moe_layer"], result["dense_layer"], result["outside_layers"]
    assert result["launches_per_moe_layer"] == moe["total"] == moe["triton"] + moe["torch"]
    assert moe["triton"] == sum(moe["triton_kernels"].values()) and moe["torch"] == sum(moe["torch_ops"].values())
    assert moe["triton_kernels"].get("_moe_gemm_kernel") == 2 or "_moe_gemm_kernel" not in moe["triton_kernels"]
    assert any("moe" in name or "expert" in name for name in moe["triton_kernels"]), moe
    assert moe["total"] > dense["total"] > 0
    assert result["step_total"] == 2 * moe["total"] + dense["total"] + other["total"]
