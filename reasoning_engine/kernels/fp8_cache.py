"""The FP8 KV cache's row format (`kv_cache_dtype="fp8"`), in plain torch: how a cache row is quantised when written
and dequantised when read, shared by the attention, rotary and sparse-attention torch paths.

A cache row (a GQA head's key or value of one token; MLA's latent and rotary key of one token) is stored as bytes in a
uint8 tensor:

    [ n float8_e4m3fn values | its scale as 2 bfloat16 bytes | an optional tail of bfloat16 channels (2 bytes each) ]

The n quantised channels share one scale, amax / 448 (448: e4m3's largest finite value), so a row's largest value
lands on e4m3's largest and every row uses the format's whole range: a scale per token and head for GQA, per token for
MLA's latent (whose rotary key, the tail, stays bfloat16). A row's scale is fixed when the token is written, so no
earlier token is ever requantised (a scale per block or tensor would have to grow as tokens arrive, or be calibrated
ahead). A row of D channels takes D + 2 bytes against bfloat16's 2 D: a GQA cache of head_dim 64 holds 1.94x the
tokens of bfloat16 in the same memory, of head_dim 128 1.97x; MLA's 512 + 64 row (642 bytes against 1152) 1.79x.

The bfloat16 bits are taken apart and put together with integer shifts on same-size views (float32 <-> int32), so
the same code runs eagerly and inside compiled graphs (engine/compiled_decode.py), and on either byte order of torch's
CPU and CUDA tensors (little-endian: low byte first).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
SCALE_BYTES = 2
_SMALLEST_SCALE = 2.0**-120  # a row of zeros keeps a positive scale (within bfloat16's normal range)


def row_bytes(quantized: int, tail: int = 0) -> int:
    """Bytes of one cache row holding `quantized` e4m3 channels, their scale and `tail` bfloat16 channels."""
    return quantized + SCALE_BYTES + 2 * tail


def _bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., k] float -> [..., 2k] uint8: each value rounded to bfloat16, low byte first."""
    bits = x.to(torch.bfloat16).float().view(torch.int32) >> 16
    return torch.stack([bits & 0xFF, (bits >> 8) & 0xFF], dim=-1).flatten(-2).to(torch.uint8)


def _from_bf16_bytes(b: torch.Tensor) -> torch.Tensor:
    """[..., 2k] uint8 (bfloat16, low byte first) -> [..., k] float32."""
    pairs = b.unflatten(-1, (-1, 2)).to(torch.int32)
    return ((pairs[..., 1] << 24) | (pairs[..., 0] << 16)).view(torch.float32)


def quantize_rows(values: torch.Tensor, tail: int = 0) -> torch.Tensor:
    """[..., W] -> [..., row_bytes(W - tail, tail)] uint8: the first W - tail channels in e4m3 with one scale per
    row, the last `tail` channels in bfloat16."""
    head = values[..., : values.shape[-1] - tail].float()
    scale = (head.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=_SMALLEST_SCALE)
    scale = scale.to(torch.bfloat16).float()  # the scale as stored, so the values are divided by what is read back
    quantized = (head / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    parts = [quantized, _bf16_bytes(scale)]
    if tail:
        parts.append(_bf16_bytes(values[..., values.shape[-1] - tail :]))
    return torch.cat(parts, dim=-1)


def dequantize_rows(rows: torch.Tensor, quantized: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., row_bytes(quantized, tail)] uint8 -> [..., quantized + tail] in `dtype`."""
    values = rows[..., :quantized].view(FP8_DTYPE).float() * _from_bf16_bytes(rows[..., quantized : quantized + SCALE_BYTES])
    if rows.shape[-1] > quantized + SCALE_BYTES:
        values = torch.cat([values, _from_bf16_bytes(rows[..., quantized + SCALE_BYTES :])], dim=-1)
    return values.to(dtype)


def key_rotation(head_dim: int) -> torch.Tensor:
    """An orthonormal [head_dim, head_dim] Walsh-Hadamard matrix (block-diagonal where head_dim is not a power of
    two: blocks of the largest power of two dividing it). GQA's queries and keys are both multiplied by it before the
    keys are cached in FP8: q.k is unchanged, and a few large channels (RoPE's slow pairs carry most of a key's
    magnitude) are spread over the row, so e4m3's rounding error in q.k no longer follows them (the rotation idea
    of QuaRot, Ashkboos et al., 2024)."""
    block = head_dim & -head_dim
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < block:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    return torch.block_diag(*[hadamard / block**0.5] * (head_dim // block))


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8
