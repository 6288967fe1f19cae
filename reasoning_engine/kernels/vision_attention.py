"""Ragged non-causal attention in plain torch: the vision encoder's CPU path and the Triton kernel's reference.

A batch of images (or video chunks) is packed into one token axis; `cu_seqlens` marks where each item starts, and a
token attends to every token of its own item and to no other. Each item is one `scaled_dot_product_attention` call,
so no [T, T] mask is ever built and memory stays that of the largest item.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     max_seqlen: int | None = None) -> torch.Tensor:
    """q, k, v [T, heads, head_dim] (strided views are fine); cu_seqlens [items + 1] int, from 0 to T. Returns the
    attention output [T, heads, head_dim] in q's dtype. `max_seqlen` is unused here (the Triton path takes it)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        per_item = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # [heads, L, head_dim]
        out[start:end] = F.scaled_dot_product_attention(*per_item, scale=scale).transpose(0, 1)
    return out
