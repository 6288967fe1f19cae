"""Comparison helpers for the kernel tests (imported by file name: pytest puts this folder on sys.path)."""

import torch

# rounding of the output dtype, plus float32 accumulation-order differences
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, scale: float = 1.0) -> None:
    """Element-wise closeness at the tolerance of `expected`'s dtype (times `scale` for longer reductions)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * scale, rtol=rtol * scale)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))
