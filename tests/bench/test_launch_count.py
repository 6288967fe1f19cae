"""benchmarks/launch_count.py: the launch counter against a hand-written toy step of known launches, and the count of
a tiny dummy deepseek_v3 decode step on the Triton path (interpreted on CPU) holding together."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from .scripts import load_script

pytestmark = pytest.mark.slow  # whole decode steps counted through the interpreter


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


def test_counts_casts_and_copies_under_inference_mode(launch_count: ModuleType) -> None:
    """Under inference mode `to` and `contiguous` reach the dispatch mode whole, with schemas that may alias: a cast
    or a copy (new storage) is a launch, a no-op (the input returned) is none."""
    log: list[tuple[str, str, str]] = []
    with torch.inference_mode():
        x = torch.randn(2, 4, dtype=torch.bfloat16)
        with launch_count.counting_launches(log, lambda: "toy"):
            y = x.float()  # a cast: one kernel
            assert y.float() is y  # already float32: none
            x.t().contiguous()  # a copy: one kernel
            x.contiguous()  # already contiguous: none
    assert [(kind, name) for _, kind, name in log] == [("torch", "to"), ("torch", "contiguous")]


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


# per MoE layer: the input norm (its residual add fused), MLA's fused projection, its rotary / cache / absorbed-query
# kernel, attention (decode: the decode kernel and its merge, 4 heads; verification: the latent split kernel and its
# merge, a copy when every context fits one slice), W_UV, o_proj, the post-attention norm (add fused, and the router's
# float32 input written by it: no cast), the router's matmul, its route-and-sort kernel, the shared expert's gate_up,
# the two expert GEMMs and the combine (shared down inside)
MOE_LAYER_KERNELS = {"_rms_norm_kernel": 2, "_mla_rope_cache_kernel": 1, "_route_and_sort_kernel": 1,
                     "_moe_gemm_kernel": 2, "_combine_kernel": 1}
ATTENTION_KERNELS = {"_decode_partial_kernel", "_decode_reduce_kernel", "_latent_partial_kernel", "_latent_reduce_kernel"}


def test_moe_layer_launches_14_in_decode_and_verification(launch_count: ModuleType) -> None:
    """The bound is 14 per MoE layer for decode and verification steps: a Moonlight-structured MoE layer
    launches 14 kernels in a decode step (the residual adds, routing arithmetic, sort, concatenations, casts and
    shared-expert tail fused; only the matmuls stay torch ops) and as many in a verification step (n-gram draft), whose
    attention is the latent split kernel and its merge (a copy here: the 61-token context fits one slice) and whose
    W_UV product is written straight into o_proj's layout (no copy)."""
    gpu_check = load_script("gpu_check")
    config = dict(gpu_check.TINY_CONFIG, num_hidden_layers=3, vocab_size=64)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for draft_tokens in (0, 3):
        result = launch_count.count_decode_step(config, device, draft_tokens=draft_tokens)
        moe = result["moe_layer"]
        attention = {k: v for k, v in moe["triton_kernels"].items() if k in ATTENTION_KERNELS}
        if draft_tokens:  # one slice: the merge is a copy of the partial outputs
            assert attention == {"_latent_partial_kernel": 1} and moe["torch_ops"].get("copy_") == 1, moe
        else:  # 4 heads: a step of decodes alone takes the decode kernel (`decodes_take_decode_kernel`)
            assert attention == {"_decode_partial_kernel": 1, "_decode_reduce_kernel": 1}, moe
        assert result["launches_per_moe_layer"] == 14, moe
        assert (result["query_tokens"] > 1) == (draft_tokens > 0)
        assert {k: v for k, v in moe["triton_kernels"].items() if k in MOE_LAYER_KERNELS} == MOE_LAYER_KERNELS, moe
        # W_UV's product lands in o_proj's rows: no reshape copy
        assert moe["torch_ops"] == {"linear": 4, "bmm": 1, **({"copy_": 1} if draft_tokens else {})}, moe
