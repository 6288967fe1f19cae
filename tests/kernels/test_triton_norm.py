import pytest
import torch
from kernel_asserts import assert_close

from reasoning_engine.kernels import norm, triton_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(0, 64), (1, 1), (3, 17), (5, 128), (2, 300)])
def test_rms_norm(device, dtype, rows, hidden):
    x = torch.randn(rows, hidden, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    assert_close(triton_norm.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(0, 32), (1, 7), (4, 96), (3, 257)])
def test_fused_add_rms_norm(device, dtype, rows, hidden):
    x = torch.randn(rows, hidden, device=device).to(dtype)
    r = torch.randn(rows, hidden, device=device).to(dtype)
    w = torch.randn(hidden, device=device).to(dtype)
    out, res = triton_norm.fused_add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_res = norm.fused_add_rms_norm(x, r, w, 1e-5)
    assert_close(res, ref_res)  # the interpreter truncates float32 -> bfloat16; GPUs round to nearest
    assert_close(out, ref_out)


def test_rms_norm_strided_rows(device):
    """MLA normalises the latent slice of a wider projection: a row-strided view."""
    wide = torch.randn(5, 40, device=device)
    x = wide[:, :24]
    w = torch.randn(24, device=device)
    assert_close(triton_norm.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))


def test_rms_norm_matches_float64():
    x = torch.randn(4, 33, dtype=torch.float64)
    w = torch.randn(33, dtype=torch.float64)
    expected = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    out = norm.rms_norm(x.float(), w.float(), 1e-6)
    assert_close(out, expected.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 3])
def test_fused_add_rms_norm_with_float_copy(device, dtype, rows):
    """The MoE router's float32 input comes out of the norm's own launch: exactly the normalised rows widened."""
    x = torch.randn(rows, 48, device=device).to(dtype)
    residual = torch.randn(rows, 48, device=device).to(dtype)
    weight = torch.randn(48, device=device).to(dtype)
    out, summed, widened = triton_norm.fused_add_rms_norm_with_float(x, residual, weight, 1e-6)
    ref_out, ref_summed, ref_widened = norm.fused_add_rms_norm_with_float(x, residual, weight, 1e-6)
    assert widened.dtype == torch.float32 and torch.equal(widened, out.float())
    assert_close(out, ref_out)
    assert_close(summed, ref_summed)  # the interpreter truncates float32 -> bfloat16; GPUs round to nearest
    assert torch.equal(ref_widened, ref_out.float())
