"""Triton RMSNorm and fused residual-add + RMSNorm: one program per row reads x (and the residual) once and writes the
normalised row (and the new residual), instead of the three passes eager torch makes. Same signatures as `norm.py`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reasoning_engine.kernels._triton_utils import num_warps_for, pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, float_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, FLOAT_OUT: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(x.dtype)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    if FLOAT_OUT:  # the same values widened (a float32 consumer, the MoE router, then needs no cast of its own)
        tl.store(float_out_ptr + row * hidden + cols, y.to(tl.float32), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            float_copy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        res_out = torch.empty_like(out)
    float_out = torch.empty(rows, hidden, dtype=torch.float32, device=x.device) if float_copy else None
    if rows:
        block = pow2(hidden)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
            float_out if float_out is not None else out,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0) if res_out is not None else 0,
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, FLOAT_OUT=float_copy, num_warps=num_warps_for(block),
        )
    return out, res_out, float_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (rows may be strided), weight [H] -> [T, H] in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) from one read of x and residual."""
    out, res_out, _ = _launch(x, residual, weight, eps)
    return out, res_out


def fused_add_rms_norm_with_float(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm` plus the normalised rows widened to float32, from the same launch."""
    return _launch(x, residual, weight, eps, float_copy=True)
