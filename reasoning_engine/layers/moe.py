"""Mixture-of-Experts: routers of the supported families and stacked experts.

Routing follows each family's published definition:
- DeepSeek-V3 / Kimi K2 `noaux_tc` (arXiv:2412.19437): sigmoid scores; a per-expert correction bias is added for the
  choice only; experts are chosen inside the `topk_group` best groups (group score = sum of its top-2 biased scores);
  weights are the unbiased scores, optionally renormalised, times `routed_scaling_factor`.
- DeepSeek-V2 (arXiv:2405.04434): softmax scores, greedy or group-limited greedy top-k, times the scaling factor.
- Qwen3-MoE: softmax top-k, optionally renormalised.
- DeepSeek-V4: `sqrtsoftplus` scores (sqrt(softplus(logit))) chosen like noaux_tc with one group; its first layers
  route by a frozen token-id table instead (`HashRouter`: experts tid2eid[token], weighted by their scores).

Under tensor parallelism the experts are split like dense MLPs (each rank holds 1 / size of every expert's
intermediate channels); with expert parallelism each rank holds E / size whole experts, and the router's choices of
other ranks' experts contribute nothing here. Either way each rank's output is a partial sum, and the MoE block ends in
one all-reduce (shared experts included). With data-parallel attention the block first gathers every replica's tokens,
and each rank keeps its own rows of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels import kernel_module
from reasoning_engine.kernels.fused_moe import MoEQuant, fused_moe_op, shared_expert
from reasoning_engine.layers.activation import limited_silu_and_mul, silu_and_mul
from reasoning_engine.layers.linear import row_parallel
from reasoning_engine.parallel import Group, Parallel


class GatedMLP(nn.Module):
    """Dense SwiGLU MLP with gate and up fused into one projection, its intermediate channels split over `tp`. With
    `reduce` False (shared experts) the output is this rank's partial sum, which the MoE block reduces."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, tp: Group = Group(),
                 reduce: bool = True, silu_limit: float | None = None) -> None:
        """`silu_limit`: DeepSeek-V4's clamped SwiGLU (`limited_silu_and_mul`)."""
        super().__init__()
        self.silu_limit = silu_limit
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size // tp.size, bias=bias)
        if reduce:
            self.down_proj = row_parallel(intermediate_size, hidden_size, bias, tp)
        else:
            self.down_proj = nn.Linear(intermediate_size // tp.size, hidden_size, bias=bias and tp.size == 1)

    @property
    def fusable(self) -> bool:
        """Whether its down projection is a plain linear without bias (a shared expert the MoE kernels can finish:
        `fused_moe.shared_expert`)."""
        return type(self.down_proj) is nn.Linear and self.down_proj.bias is None

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """`batch`: unused; every MLP of a decoder layer takes it, the MoE reads its data-parallel token counts."""
        gate_up = self.gate_up_proj(x)
        if self.silu_limit is not None:
            return self.down_proj(limited_silu_and_mul(gate_up, self.silu_limit))
        return self.down_proj(silu_and_mul(gate_up))


class Router(nn.Module):
    """Expert choice for each token; returns (weights [T, k] float32, expert ids [T, k]). DeepSeek-V3's noaux_tc
    (sigmoid scores with a correction bias) runs as the kernel family's `noaux_tc_router`: one Triton kernel from the
    logits to the scaled weights."""

    kernel_family = "moe"

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring: str, *, norm_topk_prob: bool,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
                 topk_method: str = "greedy", correction_bias: bool = False, bias: bool = False) -> None:
        """`bias`: the router is a linear layer with a bias (gpt-oss)."""
        super().__init__()
        if scoring not in ("sigmoid", "softmax", "sqrtsoftplus"):
            raise ValueError(f"scoring_func must be 'sigmoid', 'softmax' or 'sqrtsoftplus', got {scoring!r}")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if correction_bias else None
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        self.num_experts, self.top_k, self.scoring = num_experts, top_k, scoring
        self.norm_topk_prob, self.scaling = norm_topk_prob, routed_scaling_factor
        self.n_group, self.topk_group, self.topk_method = n_group or 1, topk_group or 1, topk_method
        self.ops = kernel_module(self.kernel_family, "torch")

    def route_and_sort(self, x: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """`forward`, and for noaux_tc on the Triton path the (token, choice) pairs already sorted for the grouped
        GEMMs over `num_experts` stacked experts (`fused_moe`'s `sorted_pairs`; None when not made here)."""
        if self.scoring == "sigmoid" and self.e_score_correction_bias is not None:
            return self.ops.noaux_tc_route_and_sort(self._logits(x), self.e_score_correction_bias, self.top_k,
                                                    self.n_group, self.topk_group, self.norm_topk_prob, self.scaling,
                                                    num_experts)
        return (*self(x), None)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(x)
        if self.scoring == "sigmoid" and self.e_score_correction_bias is not None:
            return self.ops.noaux_tc_router(logits, self.e_score_correction_bias, self.top_k, self.n_group,
                                            self.topk_group, self.norm_topk_prob, self.scaling)
        if self.scoring == "sigmoid":
            return self._noaux_tc(logits.sigmoid())
        if self.scoring == "sqrtsoftplus":
            return self._noaux_tc(F.softplus(logits).sqrt())
        scores = logits.softmax(dim=-1)
        if self.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, self.n_group, self.num_experts // self.n_group).amax(dim=-1)
            scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scaling, ids

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        chosen = torch.topk(group_scores, self.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        return mask.repeat_interleave(self.num_experts // self.n_group, dim=1)

    def _noaux_tc(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """noaux_tc choice over `scores`: sigmoid without a correction bias (with one: `noaux_tc_router`), and
        DeepSeek-V4's sqrtsoftplus scores with or without one."""
        biased = scores + self.e_score_correction_bias.float() if self.e_score_correction_bias is not None else scores
        if self.n_group > 1:
            group_scores = biased.view(-1, self.n_group, self.num_experts // self.n_group).topk(2, dim=-1).values.sum(-1)
            biased = biased.masked_fill(~self._group_mask(group_scores), float("-inf"))
        ids = torch.topk(biased, self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class HashRouter(nn.Module):
    """DeepSeek-V4's hash routing (its first `hash_moe` layers): token t goes to the experts tid2eid[t], a frozen
    table of the checkpoint; their weights are the sqrtsoftplus scores of the learned gate, renormalised, times
    `routed_scaling_factor`. Returns (weights [T, k] float32, expert ids [T, k]) like `Router`."""

    uses_token_ids = True

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, vocab_size: int,
                 routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # a parameter, so loading checks it is filled; int64 (an integer parameter keeps its dtype through
        # `models.base.materialize`), filled from the release's int32 or transformers' int64 exactly
        self.tid2eid = nn.Parameter(torch.zeros(vocab_size, top_k, dtype=torch.long), requires_grad=False)
        self.num_experts = num_experts
        self.scaling = routed_scaling_factor

    def process_weights_after_loading(self) -> None:
        """A table naming an expert the layer does not have would index past the experts: refused at load."""
        table = self.tid2eid
        if table.numel() and not (table.min() >= 0 and table.max() < self.num_experts):
            raise ValueError(f"tid2eid: expert ids must lie in [0, {self.num_experts}), got {int(table.min())} to "
                             f"{int(table.max())}")

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()
        ids = self.tid2eid[token_ids.clamp(0, self.tid2eid.shape[0] - 1)]
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, ids


@dataclass(frozen=True)
class ExpertQuant:
    """The quantized format routed-expert weights are kept in (a `MoEQuant` without its tensors): "w4a16" (INT4
    packed eight per int32, one scale per `group_size` input channels), "fp8_block" (float8_e4m3fn, one float32
    scale per `block_shape` tile) or "mxfp4" (gpt-oss: e2m1 codes two per byte, one e8m0 scale per 32 inputs)."""

    method: str
    group_size: int = 32
    block_shape: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.method not in ("w4a16", "fp8_block", "mxfp4"):
            raise ValueError(f"ExpertQuant.method must be 'w4a16', 'fp8_block' or 'mxfp4', got {self.method!r}")


class Experts(nn.Module):
    """Routed experts stacked as w13 [E, 2I, H] (gate then up) and w2 [E, H, I].

    With `quant` the weights stay in the checkpoint's quantized format and the fused-MoE kernel dequantizes them on
    the fly (the torch reference per expert, Triton in registers), so INT4 experts take about a quarter of their bf16
    bytes. Layouts are those of `kernels.fused_moe`, the checkpoint's per-expert tensors stacked:
    - w4a16: w13 int32 [E, 2I, H/8], w2 int32 [E, H, I/8]; w13_scale [E, 2I, H/g], w2_scale [E, H, I/g] in bf16, the
      published scale dtype (H and I must be multiples of 8).
    - fp8_block (bn, bk): w13 float8_e4m3fn [E, 2I, H], w2 [E, H, I]; float32 w13_scale [E, 2 ceil(I/bn), ceil(H/bk)]
      (the gate's block rows, then the up's) and w2_scale [E, ceil(H/bn), ceil(I/bk)].
    `fixed_dtypes` names the parameters whose storage dtype `models.base.materialize` must keep.
    """

    kernel_family = "moe"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, quant: ExpertQuant | None = None,
                 parallel: Parallel = Parallel()) -> None:
        """Sizes are the model's. With `parallel.ep` this rank keeps the experts `expert_range` whole; otherwise all
        experts, with 1 / tp.size of their intermediate channels."""
        super().__init__()
        self.quant = quant
        self.silu_limit: float | None = None  # DeepSeek-V4's clamped SwiGLU (kernels.fused_moe.limited_swiglu)
        self.ops = kernel_module(self.kernel_family, "torch")
        if parallel.ep is not None:
            self.expert_range = parallel.ep.part(num_experts, "n_routed_experts")
        else:
            self.expert_range = range(num_experts)
            intermediate_size //= parallel.tp.size
        self.num_experts = num_experts
        num_experts = len(self.expert_range)
        w13_shape, w2_shape = (num_experts, 2 * intermediate_size, hidden_size), (num_experts, hidden_size, intermediate_size)
        if quant is None:
            self.w13 = nn.Parameter(torch.empty(w13_shape))
            self.w2 = nn.Parameter(torch.empty(w2_shape))
            self.fixed_dtypes: frozenset[str] = frozenset()
            return
        if quant.method == "w4a16":
            if hidden_size % 8 or intermediate_size % 8:
                raise ValueError(f"INT4 experts need hidden_size and moe_intermediate_size divisible by 8 (eight values "
                                 f"per int32), got {hidden_size} and {intermediate_size}")
            weights = {"w13": (w13_shape, 8, torch.int32), "w2": (w2_shape, 8, torch.int32)}
            scales = {name: (*shape[:2], -(-shape[2] // quant.group_size)) for name, (shape, _, _) in weights.items()}
            scale_dtype = torch.bfloat16
        elif quant.method == "mxfp4":  # w13 uint8 [E, 2I, H/2], w13_scale uint8 [E, 2I, H/32]; w2 likewise over I
            if hidden_size % 32 or intermediate_size % 32:
                raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size (this rank's) divisible by 32 "
                                 f"(one scale per 32 values), got {hidden_size} and {intermediate_size}")
            weights = {"w13": (w13_shape, 2, torch.uint8), "w2": (w2_shape, 2, torch.uint8)}
            scales = {name: (*shape[:2], shape[2] // 32) for name, (shape, _, _) in weights.items()}
            scale_dtype = torch.uint8
        else:
            bn, bk = quant.block_shape
            weights = {"w13": (w13_shape, 1, torch.float8_e4m3fn), "w2": (w2_shape, 1, torch.float8_e4m3fn)}
            scales = {"w13": (num_experts, 2 * -(-intermediate_size // bn), -(-hidden_size // bk)),
                      "w2": (num_experts, -(-hidden_size // bn), -(-intermediate_size // bk))}
            scale_dtype = torch.float32
        for name, (shape, pack, dtype) in weights.items():
            setattr(self, name, nn.Parameter(torch.empty(*shape[:2], shape[2] // pack, dtype=dtype), requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(torch.empty(scales[name], dtype=scale_dtype), requires_grad=False))
        self.fixed_dtypes = frozenset(("w13", "w2", "w13_scale", "w2_scale"))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None, sorted_pairs: tuple | None = None) -> torch.Tensor:
        """The routed experts' sum for each token, plus the shared experts' output when `shared` gives their gate_up
        output and down weight (`fused_moe.shared_expert`): on the Triton path one kernel sums a token's k expert
        rows and runs the shared expert's activation and down projection beside them. `sorted_pairs`: the pairs
        already sorted by the router's kernel (`Router.route_and_sort`)."""
        partial = len(self.expert_range) < self.num_experts
        if partial:
            ids = self.local_ids(ids)
        if torch.compiler.is_compiling():  # compiled decode runs on the torch path only (config.compile_decode)
            q = self.quant
            if q is None:
                out = fused_moe_op(x, self.w13, self.w2, weights, ids, None, None, None, 0, [0, 0])
            else:
                out = fused_moe_op(x, self.w13, self.w2, weights, ids, q.method, self.w13_scale, self.w2_scale,
                                   q.group_size, list(q.block_shape))
            return out if shared is None else out + shared_expert(*shared)
        quant = None
        if self.quant is not None:
            quant = MoEQuant(self.quant.method, self.w13_scale, self.w2_scale, self.quant.group_size, self.quant.block_shape)
        extra = {} if self.silu_limit is None else {"silu_limit": self.silu_limit}
        return self.ops.fused_moe(x, self.w13, self.w2, weights, ids, quant, other_experts=partial, shared=shared,
                                  sorted_pairs=None if partial else sorted_pairs, **extra)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's; another rank's expert becomes the local count, which the fused-MoE
        kernels skip (an id past the stacked experts contributes nothing)."""
        local = ids - self.expert_range.start
        return local.masked_fill((local < 0) | (local >= len(self.expert_range)), len(self.expert_range))


class SparseMoE(nn.Module):
    """Router + routed experts + optional always-on shared experts, ending in the block's one all-reduce."""

    def __init__(self, router: Router, experts: Experts, shared: GatedMLP | None, parallel: Parallel = Parallel()) -> None:
        super().__init__()
        self.gate = router
        self.experts = experts
        self.shared_experts = shared
        self.parallel = parallel

    # the decoder layer hands the router its input already in float32 (`router_input`), made by the norm's kernel
    float_router_input = True

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None,
                router_input: torch.Tensor | None = None) -> torch.Tensor:
        """`router_input`: x in float32 (the router computes in float32), or None to cast here."""
        own = x
        if self.parallel.gathers_tokens:
            counts = batch.dp_num_tokens
            x = self.parallel.dp.all_gather_rows(x, counts)
            rows = range(sum(counts[: self.parallel.dp.rank]), sum(counts[: self.parallel.dp.rank + 1]))
        gate_in = x if router_input is None or self.parallel.gathers_tokens else router_input
        whole = len(self.experts.expert_range) == self.experts.num_experts  # no expert parallelism: global ids are local
        if getattr(self.gate, "uses_token_ids", False):  # hash routing: each token's own id
            token_ids = batch.input_ids
            if self.parallel.gathers_tokens:
                token_ids = self.parallel.dp.all_gather_rows(token_ids.unsqueeze(1), counts).squeeze(1)
            (weights, ids), sorted_pairs = self.gate(x, token_ids), None
        elif whole and type(self.experts) is Experts and not torch.compiler.is_compiling():
            weights, ids, sorted_pairs = self.gate.route_and_sort(gate_in, self.experts.num_experts)
        else:
            (weights, ids), sorted_pairs = self.gate(gate_in), None
        extra = {} if sorted_pairs is None else {"sorted_pairs": sorted_pairs}
        shared = self.shared_experts
        if (isinstance(shared, GatedMLP) and shared.fusable and shared.silu_limit is None
                and not self.parallel.gathers_tokens):
            # the shared expert's down projection and the sum with the routed experts: one kernel on the Triton path
            out = self.experts(x, weights, ids, shared=(shared.gate_up_proj(own), shared.down_proj.weight), **extra)
        else:
            out = self.experts(x, weights, ids, **extra)
            if shared is not None and self.parallel.gathers_tokens:
                out[rows.start : rows.stop] += shared(own)
            elif shared is not None:
                out = out + shared(own)
        out = (self.parallel.ep or self.parallel.tp).all_reduce(out)
        return out[rows.start : rows.stop] if self.parallel.gathers_tokens else out
