"""The Triton modules are drop-in replacements: same function names and parameters as their torch references."""

import inspect

import pytest

from reasoning_engine.kernels import kernel_module

SHARED = {
    "attention": ["write_kv_cache", "paged_attention", "paged_latent_attention"],
    "compressed_attention": ["compressed_attention"],
    "moe": ["noaux_tc_router", "moe_align_block_size", "fused_moe"],
    "norm": ["rms_norm", "fused_add_rms_norm"],
    "rotary": ["apply_rotary"],
    "sampling": ["sample", "rejection_sample"],
}


@pytest.mark.parametrize("family", sorted(SHARED))
def test_same_signatures(family):
    ref, fast = kernel_module(family, "torch"), kernel_module(family, "triton")
    for name in SHARED[family]:
        a = inspect.signature(getattr(ref, name)).parameters
        b = inspect.signature(getattr(fast, name)).parameters
        assert [(p.name, p.kind, p.default) for p in a.values()] == [(p.name, p.kind, p.default) for p in b.values()], name


def test_prepare_attention_takes_the_reference_arguments():
    ref = inspect.signature(kernel_module("attention", "torch").prepare_attention).parameters
    fast = inspect.signature(kernel_module("attention", "triton").prepare_attention).parameters
    assert list(ref) == list(fast)[: len(ref)]


def test_unknown_family_or_backend():
    with pytest.raises(ValueError, match="family"):
        kernel_module("conv", "torch")
    with pytest.raises(ValueError, match="backend"):
        kernel_module("norm", "cuda")
