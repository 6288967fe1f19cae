"""Small helpers shared by the Triton wrappers and kernels (imported only by `triton_*` modules)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton import knobs

if not torch.cuda.is_available() and not knobs.runtime.interpret and os.environ.get("TRITON_INTERPRET") != "0":
    # TRITON_INTERPRET=0 set on purpose: the kernels are only compiled ahead of time for a GPU target
    # (benchmarks/kernel_report.py), never launched
    raise ImportError(
        "no CUDA GPU, and triton was imported before reasoning_engine.kernels without TRITON_INTERPRET=1: set "
        "TRITON_INTERPRET=1 before importing triton to run the Triton kernels on CPU, or use kernel_backend='torch'"
    )


def pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): Triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(max(int(n), 1)), minimum)


def dot_mode(dtype: torch.dtype) -> str:
    """How `mma` multiplies tiles of `dtype`. float32 runs in full precision ("ieee") so the Triton path matches the
    torch reference; half types use the tensor cores ("tf32" is Triton's default and affects only float32 operands).
    Triton's CPU interpreter multiplies bfloat16 tiles as their raw 16-bit patterns, so there ("widen") bfloat16
    operands are converted to float32 first; compiled kernels never take that branch."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and knobs.runtime.interpret:
        return "widen"
    return "tf32"


@triton.jit
def mma(a, b, MODE: tl.constexpr):
    """a @ b with float32 accumulation, as chosen by `dot_mode`."""
    if MODE == "widen":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=MODE)
    return out


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, MODE: tl.constexpr):
    """Fold a tile of base-2 scores s [M, N] (-inf where masked) and its values v [N, D] into a running softmax
    (m_i: row maxima, l_i: sums of exp2(s - m_i), acc: the weighted values, float32); returns the new triple. A row
    still at m_i = -inf whose tile is all -inf gets NaN: start m_i from a sink, or give each row a score first."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, MODE)
    return m_new, l_i, acc


def num_warps_for(block_elems: int) -> int:
    """Warps for a program whose widest tile has `block_elems` elements: enough threads to cover it in a few passes."""
    return 1 if block_elems <= 256 else 2 if block_elems <= 1024 else 4 if block_elems <= 4096 else 8
