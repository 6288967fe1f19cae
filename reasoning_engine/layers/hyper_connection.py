"""Manifold-constrained hyper-connections (mHC; Xie et al., 2026; DeepSeek-V4, "DeepSeek-V4" section 2.2): the
residual stream is `hc_mult` parallel streams [T, n, D]. Before each block a small projection of the (RMS-normalised,
flattened) streams gives three mixings: `pre` [T, n] collapses the streams into the block's input, `post` [T, n]
spreads the block's output back over the streams, and `comb` [T, n, n] mixes the old streams into the new ones,
projected onto the doubly-stochastic matrices by Sinkhorn-Knopp iterations so the residual map stays non-expansive.

    new_streams[k] = post[k] * block(sum_j pre[j] * streams[j]) + sum_j comb[j, k] * streams[j]

`HyperHead` folds the streams into one hidden state before the final norm and the LM head. Everything here runs in
float32, as the published models keep these modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, without a weight."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternately normalise the columns and rows of [..., n, n] positive matrices (columns first and last): `iters`
    column passes in all."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """The mixings around one block: `fn` [(2 + n) n, n D] projects the flattened streams to pre, post and comb
    logits, each with its `base` bias and one `scale`."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + hc_mult) * hc_mult, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.empty((2 + hc_mult) * hc_mult))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (post [T, n], comb [T, n, n], the block's input [T, D]); post and comb float32."""
        n = self.hc_mult
        mixes = F.linear(rms_normalise(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        scale = self.scale.float()
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = sinkhorn(comb, self.sinkhorn_iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The new streams: post spreads the block's output [T, D], comb (applied transposed: column k sums into
        stream k) mixes the old ones [T, n, D]."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(1, 2), streams)


class HyperHead(nn.Module):
    """The streams folded into one hidden state: sigmoid-weighted sum, weights from the flattened streams."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.empty(hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(rms_normalise(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
