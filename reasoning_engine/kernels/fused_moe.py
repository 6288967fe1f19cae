"""Mixture-of-experts in plain torch: the DeepSeek-V3 noaux_tc router, the expert MLPs (bf16/fp16/fp32, W4A16 INT4
pack-quantized, block FP8) and the token-to-expert sort the grouped GEMM consumes. The CPU path and the reference for
`triton_moe`.

An expert id of E or more (past the stacked experts) names an expert this rank does not hold (expert parallelism):
its (token, choice) pair contributes nothing here; the rank that holds the expert adds it.

Weight layouts (per expert e, rows are output channels, as in the checkpoints):
- w13 [E, 2I, H]: gate_proj rows then up_proj rows; w2 [E, H, I]. Expert output = w2 @ (silu(gate) * up).
- "w4a16" (Kimi K2/K2.5 compressed-tensors pack-quantized, symmetric): w13 int32 [E, 2I, H/8], w2 int32 [E, H, I/8],
  eight 4-bit values per int32, lowest nibble first, each stored as q + 8; scales [E, out, in/group_size]
  (group_size 32); weight = (nibble - 8) * scale. H and I must be multiples of 8 and of group_size.
- "fp8_block" (DeepSeek-V3): float8_e4m3fn weights [E, out, in] with float32 scales [E, ceil(out/bn), ceil(in/bk)]
  for block_shape (bn, bk) = (128, 128); weight = w_fp8 * scale of its block, edge blocks partial. w13's scales are
  the gate's rows of blocks followed by the up's ([E, 2 * ceil(I/bn), ceil(H/bk)]), so I need not divide bn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoEQuant:
    """Quantized expert weights' scales and format; `fused_moe(..., quant=None)` means w13/w2 are plain floats."""

    method: str  # "w4a16", "fp8_block" or "mxfp4"
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    group_size: int = 32  # w4a16: input channels sharing one scale
    block_shape: tuple[int, int] = (128, 128)  # fp8_block: (output, input) channels sharing one scale

    def __post_init__(self) -> None:
        if self.method not in ("w4a16", "fp8_block", "mxfp4"):
            raise ValueError(f"MoEQuant.method must be 'w4a16', 'fp8_block' or 'mxfp4', got {self.method!r}")


def noaux_tc_router(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's auxiliary-loss-free routing (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report", sec. 2.1.2),
    with the semantics of transformers' DeepseekV3TopkRouter: sigmoid scores; the correction bias only steers the
    choice; each group is scored by the sum of its two best biased scores and only the best `topk_group` groups stay
    eligible; the chosen experts are weighted by their unbiased scores, optionally renormalised, then scaled.
    router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32), best first."""
    scores = router_logits.float().sigmoid()
    biased = scores + e_score_correction_bias.float()
    tokens, num_experts = biased.shape
    grouped = biased.view(tokens, n_group, num_experts // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    keep_groups = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
    eligible = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
    topk_ids = biased.masked_fill(~eligible, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, topk_ids.to(torch.int32)


def noaux_tc_route_and_sort(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """`noaux_tc_router` and no sort: these experts loop over their tokens and need none (the Triton module also
    sorts the pairs for its grouped GEMMs, in the same launch)."""
    return (*noaux_tc_router(router_logits, e_score_correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                             routed_scaling_factor), None)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*k (token, choice) pairs by expert so a grouped GEMM can take each expert's rows in tiles of
    block_m. Pair p = t * k + j. Each expert's pairs keep their order and its segment is padded to a multiple of
    block_m with the sentinel T*k. Sizes are bounds known without reading the ids (no device sync):
    returns sorted_ids [P] int32 with P = T*k + min(E, T*k) * (block_m - 1), expert_ids [P / block_m] int32
    (-1 for tiles past the end), num_tokens_post_pad [1] int32 (rows actually used)."""
    flat = topk_ids.flatten().long().clamp(max=num_experts)  # other ranks' experts share the spare bin E
    pairs = flat.numel()
    capacity = pairs + min(num_experts, pairs) * (block_m - 1)
    capacity = -(-capacity // block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    starts = padded.cumsum(0) - padded
    order = torch.sort(flat, stable=True).indices
    order = order[flat[order] < num_experts]
    rank = torch.arange(order.numel(), device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[flat[order]] + rank] = order.to(torch.int32)
    padded = padded[:num_experts]
    expert_ids = torch.full((capacity // block_m,), -1, dtype=torch.int32, device=flat.device)
    used = torch.repeat_interleave(torch.arange(num_experts, device=flat.device, dtype=torch.int32), padded // block_m)
    expert_ids[: used.numel()] = used
    return sorted_ids, expert_ids, padded.sum().to(torch.int32).view(1)


def dequantize_int4_packed(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., out, in/8] int32 + [..., out, in/group] -> [..., out, in] float32 (compressed-tensors pack-quantized:
    lowest nibble first, stored offset by +8)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    q = (nibbles - 8).flatten(-2)
    return q.float() * scale.float().repeat_interleave(group_size, dim=-1)[..., : q.shape[-1]]


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """[..., out, in] float8 + [..., ceil(out/bn), ceil(in/bk)] float32 -> [..., out, in] float32."""
    out_ch, in_ch = weight.shape[-2:]
    bn, bk = block_shape
    full = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :out_ch, :].repeat_interleave(bk, dim=-1)[..., :in_ch]
    return weight.float() * full


FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values sharing one e8m0 scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4 as gpt-oss ships its experts: [..., out, in/2] uint8, two e2m1 codes per byte (low nibble first), and
    [..., out, in/32] uint8 e8m0 scales (2^(s - 127)) -> [..., out, in] float32 (exact: every product is a float32)."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()
    values = lut[codes].unflatten(-1, (-1, MXFP4_GROUP))
    return (values * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)


def _dense_expert_weights(w13: torch.Tensor, w2: torch.Tensor, quant: MoEQuant | None, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if quant is None:
        return w13[expert].to(dtype), w2[expert].to(dtype)
    if quant.method == "mxfp4":
        return (dequantize_mxfp4(w13[expert], quant.w13_scale[expert]).to(dtype),
                dequantize_mxfp4(w2[expert], quant.w2_scale[expert]).to(dtype))
    if quant.method == "w4a16":
        return (
            dequantize_int4_packed(w13[expert], quant.w13_scale[expert], quant.group_size).to(dtype),
            dequantize_int4_packed(w2[expert], quant.w2_scale[expert], quant.group_size).to(dtype),
        )
    inter = w13.shape[1] // 2
    gate_blocks = -(-inter // quant.block_shape[0])
    s13 = quant.w13_scale[expert]
    gate = dequantize_fp8_block(w13[expert, :inter], s13[:gate_blocks], quant.block_shape)
    up = dequantize_fp8_block(w13[expert, inter:], s13[gate_blocks:], quant.block_shape)
    return torch.cat([gate, up]).to(dtype), dequantize_fp8_block(w2[expert], quant.w2_scale[expert], quant.block_shape).to(dtype)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    quant: MoEQuant | None = None,
    other_experts: bool = False,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    silu_limit: float | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    sorted_pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed experts: sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]). hidden [T, H] -> [T, H].
    Loops over the experts that received tokens, one dense GEMM pair each (weights dequantized per expert); ids of
    other ranks' experts (>= E, `other_experts`) are skipped. gpt-oss: biases w13_bias [E, 2I] and w2_bias [E, H],
    and with `swiglu_limit` its clamped SwiGLU (`clamped_swiglu`) instead of silu(gate) * up; DeepSeek-V4: with
    `silu_limit` silu(gate) * up with both clamped first (`limited_swiglu`). `shared`: the shared
    experts' (gate_up output [T, 2I'], down weight [H, I']), whose `shared_expert` output is added to the sum once
    that is rounded to hidden's dtype. `sorted_pairs` (the Triton GEMMs' sort of the pairs) is not needed here."""
    tokens, top_k = topk_ids.shape
    out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat = topk_ids.flatten().long()
    for expert in flat.unique().tolist():
        if expert >= w13.shape[0]:
            continue  # another rank's expert
        pairs = (flat == expert).nonzero().squeeze(1)
        rows = pairs // top_k
        g13, g2 = _dense_expert_weights(w13, w2, quant, expert, hidden.dtype)
        b13 = None if w13_bias is None else w13_bias[expert].to(hidden.dtype)
        b2 = None if w2_bias is None else w2_bias[expert].to(hidden.dtype)
        gate, up = F.linear(hidden[rows], g13, b13).chunk(2, dim=-1)
        if swiglu_limit is not None:
            act = clamped_swiglu(gate, up, swiglu_limit)
        else:
            act = F.silu(gate) * up if silu_limit is None else limited_swiglu(gate, up, silu_limit)
        y = F.linear(act, g2, b2).float() * topk_weights.flatten()[pairs].float().unsqueeze(1)
        out.index_add_(0, rows, y)
    out = out.to(hidden.dtype)
    return out if shared is None else out + shared_expert(*shared)


def shared_expert(gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """A shared expert's second half (no bias): down(silu(gate) * up) from its gate_up projection's output [T, 2I]
    and its down weight [H, I], as `layers.moe.GatedMLP` computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's expert activation: gate clamped above at `limit`, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1) (the +1 and alpha as OpenAI trained it)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def limited_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's expert activation: silu(gate clamped above at `limit`) * (up clamped to [-limit, limit])."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@torch.library.custom_op("reasoning_engine::fused_moe", mutates_args=())
def fused_moe_op(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, method: str | None, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                 group_size: int, block_shape: list[int], w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None, swiglu_limit: float = 0.0) -> torch.Tensor:
    """`fused_moe` as one opaque op: a compiled forward (engine/compiled_decode.py) runs its expert loop, whose trip
    count depends on the routing, eagerly instead of breaking the graph at every layer. A `swiglu_limit` of 0 means
    silu(gate) * up."""
    quant = None if method is None else MoEQuant(method, w13_scale, w2_scale, group_size, (block_shape[0], block_shape[1]))
    return fused_moe(hidden, w13, w2, topk_weights, topk_ids, quant, w13_bias=w13_bias, w2_bias=w2_bias,
                     swiglu_limit=swiglu_limit or None)


@fused_moe_op.register_fake
def _fused_moe_shape(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, method: str | None, w13_scale: torch.Tensor | None,
                     w2_scale: torch.Tensor | None, group_size: int, block_shape: list[int],
                     w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                     swiglu_limit: float = 0.0) -> torch.Tensor:
    return torch.empty_like(hidden)
