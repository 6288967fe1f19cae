"""GPU readiness without a GPU: compile every Triton kernel the engine launches, ahead of time, for Hopper (sm_90:
H100/H200) and Blackwell (sm_100: B200), at the shapes Kimi K2.5 / K2.6 and the Moonlight-shaped check model use,
and report what the GPU would see: registers, spills and shared memory per kernel (from the ptxas bundled with
Triton), the occupancy they allow, and, for the decode kernels, the bytes they move against the memory roofline.

    python benchmarks/kernel_report.py [--targets sm_90,sm_100] [--only REGEX] [--json] [--out DIR | --no-write]
                                       [--date D] [--tag T] [--jobs N] [--cache-dir DIR] [--measure] [--budget-s S]

How: each case calls a kernel module's public function (the same one the layers call) on `meta` tensors of the real
shapes while `JITFunction.run` is replaced by a recorder, so the launches (grid, arguments, constexprs, num_warps)
are exactly the engine's; Triton's own binder then specialises them for the target as a real launch would (16-byte
alignment, integers equal to 1 or divisible by 16), and `triton.compile` builds PTX and cubin for
`GPUTarget("cuda", 90 | 100, 32)`. ptxas's `-v` log gives registers and spill bytes; the compiled metadata gives shared
memory. Compiles are cached on disk by kernel source, specialisation, options, target and Triton version, and run in
parallel processes. On a machine without a GPU the script imports Triton with TRITON_INTERPRET=0 (compile only).

Shapes: decode batches 1, 8, 64 at contexts 1k, 32k and 128k, eager (launch sized by the longest sequence) and as a
CUDA graph replays it (sized by max_model_len = 128k); prefill chunks of 2048 and 8192 tokens; speculative
verification (8 sequences x 4 tokens, and a mixed step: 8 decodes, 2 draft trees and a 2k chunk; contexts 32k and 128k); Kimi under TP=8 (8 heads, experts' intermediate 256) and EP=8 with
data-parallel attention (64 heads, 48 whole experts), and Moonlight-16B-A3B (16 heads, 64 experts, bf16 and INT4).
Kimi's MLA decode and verification steps also over an FP8 latent cache (`--kv-cache-dtype fp8`; ops `mla decode fp8`,
`mla verify fp8`), whose rows weigh 642 bytes: 512 e4m3 values, their bf16 scale, the 64-channel rotary key in bf16.
K2.6's text model has K2.5's shapes. DeepSeek-V4-Flash (its published config, transformers' DeepseekV4Config
defaults): each attention layer kind (sliding window 128, CSA 4:1 with top-512, HCA 128:1) through the compressed
attention kernel on 64 heads (one GPU) and 8 (TP 8), and the DSA indexer kernel at its index shapes (64 x 128). `decode_path` marks kernels launched on every decode step (speculative
verification included); `launched` is False for kernels the engine does not call yet (the Triton sampling:
layers/sampler.py uses torch there).

Occupancy (per SM): CTAs limited by registers (65,536 per SM, allocated per warp in units of 256), shared memory
(228 KB per SM, 1 KB reserved per CTA, at most 227 KB per CTA), threads (2048) and 32 CTAs; the same on sm_90 and
sm_100. Roofline of a decode op = the bytes it must move (every sequence's cache once, each touched expert's weights
once, the logits once) over HBM bandwidth (4.8 TB/s H200, 8 TB/s B200); the modelled bytes are what its kernels
request as written (a cache tile once per program that reads it, partial results written and read back), and the
modelled time divides them by the bandwidth share of the SMs the grid occupies (one program per SM at most counts).

`--measure` (needs a GPU) also times each decode op with `triton.testing.do_bench` on real tensors and reports
achieved bandwidth, and lists the registers and spills of the kernels the driver actually loaded. Without a GPU,
`--measure` runs the same cases through Triton's interpreter instead of compiling (a check of the script: the
timings mean nothing), so use it with a narrow `--only`.

The markdown report goes to DIR/kernel_report_<device>_<date>[_<tag>].md (default benchmarks/results; <device>: cpu_aot for
compiles alone, the GPU's name with --measure on one, cpu_interpreted without), written once the compiles are done and
rewritten after every shape --measure times, so a run stopped at its time limit keeps every number it took. With
`--json` the last line of stdout is a JSON list, one record per kernel, target and shape: kernel, target, shape, model,
registers, spill_bytes (spill stores per thread), spill_load_bytes, shared_bytes, shared_limit, num_warps, num_stages,
programs, ctas_per_sm, occupancy, decode_path, launched, config (constexprs, warps, stages) and error (a kernel that
failed to compile).
Records of decode-path kernels that spill or exceed the shared-memory limit are also listed on stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import hashlib
import io
import json
import math
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python benchmarks/kernel_report.py` from a checkout, without installing

SHARED_PER_SM = 233_472  # 228 KB on sm_90 and sm_100
SHARED_PER_CTA = 232_448  # 227 KB: the opt-in limit of one CTA
SHARED_RESERVED = 1_024  # per CTA, reserved by the driver
REGISTERS_PER_SM = 65_536
MAX_THREADS_PER_SM = 2_048
MAX_CTAS_PER_SM = 32


@dataclass(frozen=True)
class Target:
    name: str
    arch: int
    gpu: str
    sms: int
    bandwidth: float  # bytes/s, HBM peak
    clock_hz: float  # boost clock of the SMs

    def issue_bound_fraction(self, bytes_per_iteration: float, warp_instructions_per_iteration: float) -> float:
        """The share of HBM bandwidth a loop could draw were instruction issue its only limit: every SM issuing
        ISSUE_PER_SM_CYCLE warp-instructions a cycle, each iteration moving `bytes_per_iteration` for the
        `warp_instructions_per_iteration` its CTA issues (instructions per warp x warps); capped at 1."""
        if bytes_per_iteration <= 0 or warp_instructions_per_iteration <= 0:
            return 0.0
        rate = bytes_per_iteration / warp_instructions_per_iteration * ISSUE_PER_SM_CYCLE * self.sms * self.clock_hz
        return min(1.0, rate / self.bandwidth)


# The issue model: 4 warp schedulers per SM, each issuing one warp-instruction per cycle (NVIDIA H100 Tensor Core GPU
# Architecture whitepaper, "H100 SM architecture"; CUDA C++ Programming Guide, compute capabilities 9.0 and 10.0).
# Clocks: H200 SXM boosts to 1.98 GHz like the H100 SXM (NVIDIA H100 datasheet/whitepaper); B200: 148 SMs at 1.98 GHz
# boost (public spec sheets, e.g. hmc-tech.com/gpus/nvidia-b200-vs-nvidia-b100, consistent with its 75 TFLOP/s FP32).
ISSUE_PER_SM_CYCLE = 4
TARGETS = {
    "sm_90": Target("sm_90", 90, "H200", 132, 4.8e12, 1.98e9),
    "sm_100": Target("sm_100", 100, "B200", 148, 8.0e12, 1.98e9),
}


@dataclass(frozen=True)
class Model:
    """One rank's share of a model: what its kernels see."""

    name: str
    heads: int  # query heads of the rank's attention
    hidden: int
    experts: int  # experts the rank holds
    global_experts: int  # routed experts of the model (router width)
    top_k: int
    inter: int  # each held expert's intermediate channels
    quant: str | None  # routed experts: None (bf16) or "w4a16"
    q_lora: int | None
    vocab: int = 163_840
    latent: int = 512
    rope: int = 64


KIMI_TP8 = Model("kimi-tp8", heads=8, hidden=7168, experts=384, global_experts=384, top_k=8, inter=256, quant="w4a16", q_lora=1536)
KIMI_EP8 = Model("kimi-ep8", heads=64, hidden=7168, experts=48, global_experts=384, top_k=8, inter=2048, quant="w4a16", q_lora=1536)
MOONLIGHT = Model("moonlight", heads=16, hidden=2048, experts=64, global_experts=64, top_k=6, inter=1408, quant=None, q_lora=None)
MOONLIGHT_INT4 = Model("moonlight-int4", heads=16, hidden=2048, experts=64, global_experts=64, top_k=6, inter=1408, quant="w4a16", q_lora=None)
ATTENTION_MODELS = (KIMI_TP8, KIMI_EP8, MOONLIGHT)
MOE_MODELS = (KIMI_TP8, KIMI_EP8, MOONLIGHT, MOONLIGHT_INT4)

DECODE_BATCHES = (1, 8, 64)
CONTEXTS = (1024, 32768, 131072)
MAX_MODEL_LEN = 131072  # the CUDA-graph bound
PREFILL_CHUNKS = (2048, 8192)
BLOCK_SIZE = 16
BF16 = 2
MEASURE_FIRST = ("mla decode", "moe w4a16", "moe bf16", "mla verify")


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass
class Case:
    """One shape of one op: `build(device)` makes its inputs and returns a closure that runs the op (through the
    kernel modules' public functions) and, for decode ops, its traffic model as a function of the recorded launches."""

    model: str
    op: str
    shape: str
    decode_path: bool
    build: Callable[[str], tuple[Callable[[], Any], Callable[[list[Launch]], Traffic] | None]]
    launched: bool = True

    @property
    def label(self) -> str:
        return f"{self.model} {self.op} {self.shape}"


@dataclass(frozen=True)
class Traffic:
    """Bytes a decode op must move (`minimum`) and, per kernel launch, the bytes it requests as written and its grid."""

    minimum: float
    kernels: dict[str, tuple[float, int]]  # launch -> (modelled bytes, programs)

    @property
    def modelled(self) -> float:
        return sum(b for b, _ in self.kernels.values())

    @property
    def programs(self) -> int:
        return max((p for _, p in self.kernels.values()), default=0)

    def modelled_seconds(self, target: Target) -> float:
        """Each launch's bytes at the bandwidth share of the SMs its grid occupies (at most one program per SM
        counted: a first-order model of a grid too small to fill the GPU)."""
        return sum(b / (target.bandwidth * min(1.0, p / target.sms)) for b, p in self.kernels.values())


# ------------------------------------------------------------------------------------------------------------- cases


def _decode_batch(batch: int, ctx: int, graph: bool, device: str) -> tuple[Any, int]:
    """A decode step of `batch` sequences of `ctx` tokens over randomly placed cache blocks; with `graph`, as the CUDA
    graph runner builds it (host lengths and block tables at the max_model_len bound, static_shapes)."""
    import torch

    from reasoning_engine.batch import ForwardBatch

    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    width = -(-MAX_MODEL_LEN // BLOCK_SIZE) if graph else per_seq
    tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
    tables[:, :per_seq] = torch.randperm(num_blocks - 1, device=device)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int64, device=device)
    bound = MAX_MODEL_LEN if graph else ctx
    fb = ForwardBatch(
        input_ids=torch.zeros(batch, dtype=torch.int64, device=device),
        positions=seq_lens - 1,
        slot_mapping=tables[:, (ctx - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int64, device=device),
        seq_lens=seq_lens,
        block_tables=tables,
        logits_indices=torch.arange(batch, dtype=torch.int64, device=device),
        max_query_len=1,
        max_seq_len=bound,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[bound] * batch,
        static_shapes=graph,
    )
    return fb, num_blocks


def _ragged_batch(context: int, queries: list[int], tree: bool, device: str) -> tuple[Any, int]:
    """Sequences that each have `context` cached tokens and queries[b] new ones (prefill chunks, verification)."""
    import torch

    from reasoning_engine.batch import ForwardBatch

    seq_lens = [context + q for q in queries]
    per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    batch = len(queries)
    num_blocks = batch * per_seq + 1
    tables = torch.randperm(num_blocks - 1, device=device)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    qsl = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int64).to(device)
    tokens = sum(queries)
    pos = torch.cat([torch.arange(context, context + q) for q in queries]).to(device)
    rows = torch.cat([torch.full((q,), b) for b, q in enumerate(queries)]).to(device)
    slots = tables[rows, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    tree_mask = None
    if tree:  # a chain: each draft token sees the ones before it (the densest tree the kernel meets)
        step = max(queries)
        tree_mask = torch.tril(torch.ones(step, step, dtype=torch.bool)).repeat(batch, 1)[:tokens].to(device)
    fb = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device), positions=pos, slot_mapping=slots,
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device), block_tables=tables,
        logits_indices=qsl[1:] - 1, max_query_len=max(queries), max_seq_len=max(seq_lens), query_lens_cpu=list(queries),
        seq_lens_cpu=seq_lens, tree_mask=tree_mask,
    )
    return fb, num_blocks


def mla_row_bytes(model: Model, fp8: bool) -> int:
    """Bytes of one token's latent cache row: bf16 [latent | rope], or FP8's e4m3 latent, its scale and the rotary
    key in bf16 (kernels/fp8_cache.py)."""
    from reasoning_engine.kernels.fp8_cache import row_bytes

    return row_bytes(model.latent, model.rope) if fp8 else (model.latent + model.rope) * BF16


def _mla_cache(model: Model, num_blocks: int, fp8: bool, device: str) -> Any:
    """A latent cache of `num_blocks` blocks: bf16 rows, or FP8 rows as bytes (random bytes: only shapes matter here)."""
    import torch

    if fp8:
        return torch.randint(0, 0x70, (num_blocks, BLOCK_SIZE, mla_row_bytes(model, True)), dtype=torch.uint8, device=device)
    return torch.randn(num_blocks, BLOCK_SIZE, model.latent + model.rope, dtype=torch.bfloat16, device=device)


def _mla_decode_traffic(model: Model, batch: int, ctx: int, fp8: bool = False) -> Traffic:
    """Minimum: every sequence's latent cache rows once, the absorbed queries in, the latent outputs out. Modelled:
    the kernels' own `decode_traffic` (few heads: the decode kernel, `decodes_take_decode_kernel`) or
    `latent_traffic` (cache tiles per program, partial results written and merged). `fp8`: cache rows of
    `mla_row_bytes` (queries and outputs stay bf16)."""
    from reasoning_engine.kernels import triton_attention as ta

    row = mla_row_bytes(model, fp8)
    query = (model.latent + model.rope) * BF16
    minimum = batch * ctx * row + batch * model.heads * (query + model.latent * BF16)
    if ta.decodes_take_decode_kernel(model.heads):
        return Traffic(minimum, ta.decode_traffic([ctx] * batch, model.heads, 1, (model.latent, model.rope), model.latent,
                                                  BF16, v_from_k=True, row_bytes=row))
    return Traffic(minimum, ta.latent_traffic([ctx] * batch, [1] * batch, model.heads, model.latent, model.rope, BF16,
                                              row_bytes=row))


def _fp8_op(op: str, fp8: bool) -> str:
    return f"{op} fp8" if fp8 else op


def attention_decode_case(model: Model, batch: int, ctx: int, graph: bool, fp8: bool = False) -> Case:
    """MLA decode over a bf16 cache, or (`fp8`, op `mla decode fp8`) over an FP8 one (`--kv-cache-dtype fp8`)."""
    def build(device: str) -> tuple[Callable[[], Any], Callable[[list[Launch]], Traffic]]:
        import torch

        from reasoning_engine.kernels import triton_attention as ta

        fb, num_blocks = _decode_batch(batch, ctx, graph, device)
        kv = _mla_cache(model, num_blocks, fp8, device)
        q = torch.randn(batch, model.heads, model.latent + model.rope, dtype=torch.bfloat16, device=device)
        meta = ta.prepare_attention(fb, BLOCK_SIZE)
        scale = 192**-0.5
        return ((lambda: ta.paged_latent_attention(q, kv, model.latent, fb, meta, scale)),
                lambda _: _mla_decode_traffic(model, batch, ctx, fp8))

    return Case(model.name, _fp8_op("mla decode", fp8), f"b{batch} ctx{_k(ctx)} {'graph' if graph else 'eager'}", True, build)


def _mla_ragged_traffic(model: Model, context: int, queries: list[int], launches: list[Launch], fp8: bool = False) -> Traffic:
    """Minimum as for decode; modelled: sequences of at most SHORT_QUERY query tokens as the latent split kernel
    reads them (`latent_traffic`), and every program of the varlen kernel (one block of BLOCK_M queries of one long
    sequence and one head) reading its sequence's whole cache up to its last query."""
    from reasoning_engine.kernels import triton_attention as ta

    row = mla_row_bytes(model, fp8)
    query = (model.latent + model.rope) * BF16
    tokens = sum(queries)
    minimum = sum(context + q for q in queries) * row + tokens * model.heads * (query + model.latent * BF16)
    kernels = ta.latent_traffic([context + q for q in queries], queries, model.heads, model.latent, model.rope, BF16,
                                row_bytes=row)
    long = [q for q in queries if q > ta.SHORT_QUERY]
    prefill = [launch for launch in launches if launch.kernel == "_prefill_kernel"]
    if prefill:
        block_m = prefill[-1].kwargs["BLOCK_M"]
        reads = sum(-(-q // block_m) * model.heads * ((context + q) * row + q * (query + model.latent * BF16)) for q in long)
        kernels["_prefill_kernel"] = (reads, sum(-(-q // block_m) for q in long) * model.heads)
    return Traffic(minimum, {k: v for k, v in kernels.items() if v[1]})


def attention_ragged_case(model: Model, context: int, queries: list[int], tree: bool, decode_path: bool, name: str,
                          fp8: bool = False) -> Case:
    def build(device: str) -> tuple[Callable[[], Any], Callable[[list[Launch]], Traffic] | None]:
        import torch

        from reasoning_engine.kernels import triton_attention as ta

        fb, num_blocks = _ragged_batch(context, queries, tree, device)
        kv = _mla_cache(model, num_blocks, fp8, device)
        q = torch.randn(fb.num_tokens, model.heads, model.latent + model.rope, dtype=torch.bfloat16, device=device)
        meta = ta.prepare_attention(fb, BLOCK_SIZE)
        run = lambda: ta.paged_latent_attention(q, kv, model.latent, fb, meta, 192**-0.5)  # noqa: E731
        return run, (lambda launches: _mla_ragged_traffic(model, context, queries, launches, fp8)) if decode_path else None

    return Case(model.name, _fp8_op("mla prefill" if not decode_path else "mla verify", fp8), name, decode_path, build)


def cache_write_case(model: Model, tokens: int, decode_path: bool) -> Case:
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_attention as ta

        width = model.latent + model.rope
        cache = torch.empty(tokens // BLOCK_SIZE + 2, BLOCK_SIZE, width, dtype=torch.bfloat16, device=device)
        values = torch.randn(tokens, width, dtype=torch.bfloat16, device=device)
        slots = torch.randperm(cache.shape[0] * BLOCK_SIZE, device=device)[:tokens]
        return (lambda: ta.write_kv_cache(cache, values, slots)), None

    return Case(model.name, "cache write", f"t{tokens}", decode_path, build)


def _expert_weights(model: Model, device: str) -> tuple[Any, Any, Any]:
    import torch

    from reasoning_engine.kernels.fused_moe import MoEQuant

    e, h, i = model.experts, model.hidden, model.inter
    if model.quant is None:
        return (torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device=device) * 0.02,
                torch.randn(e, h, i, dtype=torch.bfloat16, device=device) * 0.02, None)
    w13 = torch.randint(-2**31, 2**31 - 1, (e, 2 * i, h // 8), dtype=torch.int32, device=device)
    w2 = torch.randint(-2**31, 2**31 - 1, (e, h, i // 8), dtype=torch.int32, device=device)
    s13 = torch.rand(e, 2 * i, h // 32, device=device).to(torch.bfloat16) * 0.01
    s2 = torch.rand(e, h, i // 32, device=device).to(torch.bfloat16) * 0.01
    return w13, w2, MoEQuant("w4a16", s13, s2, group_size=32)


def _moe_traffic(model: Model, tokens: int, launches: list[Launch]) -> Traffic:
    """Minimum: the expected number of distinct experts `tokens` uniformly routed tokens touch on this rank, each
    expert's weights once (INT4: a nibble plus its bf16 scale's share), activations in and out. Modelled: decode row
    tiles hold one expert each, so each GEMM reads a touched expert's share of the weights once; every column tile
    reads its row tile's inputs; the gate_up GEMM writes the intermediate, the down GEMM per-pair float32 rows; a GEMM
    split over K also writes its float32 partial sums and reads them back (the reduction). Programs: the row tiles
    that hold pairs (the rest of the grid returns at once) times the column tiles times the K spans."""
    weight_bytes = 0.5 + 2 / 32 if model.quant else BF16
    h, i = model.hidden, model.inter
    touched = model.experts * (1 - (1 - model.top_k / model.global_experts) ** tokens)
    pairs = tokens * model.top_k * model.experts / model.global_experts
    minimum = touched * 3 * h * i * weight_bytes + 2 * tokens * h * BF16
    gated, down = [launch for launch in launches if launch.kernel == "_moe_gemm_kernel"]
    block_m = gated.kwargs["BLOCK_M"]
    row_tiles = min(gated.grid[0], max(1, round(touched * math.ceil(pairs / max(touched, 1.0) / block_m))))  # with work
    def partials(launch: Launch, width: int) -> float:
        spans = launch.grid[2]
        return 2 * spans * pairs * width * 4 if spans > 1 else 0.0

    return Traffic(minimum, {
        "gate_up GEMM": (touched * 2 * h * i * weight_bytes + pairs * (gated.grid[1] * h + i) * BF16 + partials(gated, 2 * i),
                         row_tiles * gated.grid[1] * gated.grid[2]),
        "down GEMM": (touched * h * i * weight_bytes + pairs * (down.grid[1] * i * BF16 + h * 4) + partials(down, h),
                      row_tiles * down.grid[1] * down.grid[2]),
    })


def moe_case(model: Model, tokens: int, decode_path: bool) -> Case:
    def build(device: str) -> tuple[Callable[[], Any], Callable[[list[Launch]], Traffic] | None]:
        import torch

        from reasoning_engine.kernels import triton_moe

        w13, w2, quant = _expert_weights(model, device)
        hidden = torch.randn(tokens, model.hidden, dtype=torch.bfloat16, device=device)
        weights = torch.rand(tokens, model.top_k, device=device)
        ids = torch.rand(tokens, model.global_experts, device=device).topk(model.top_k, dim=-1).indices.to(torch.int32)
        partial = model.experts < model.global_experts
        if partial:  # this rank holds experts [0, E); the others' ids become E (layers/moe.py local_ids)
            ids = torch.where(ids < model.experts, ids, torch.full_like(ids, model.experts))
        run = lambda: triton_moe.fused_moe(hidden, w13, w2, weights, ids, quant, other_experts=partial)  # noqa: E731
        return run, (lambda launches: _moe_traffic(model, tokens, launches)) if decode_path else None

    kind = "w4a16" if model.quant else "bf16"
    return Case(model.name, f"moe {kind}", f"t{tokens}", decode_path, build)


def align_case(model: Model, tokens: int) -> Case:
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_moe

        ids = torch.randint(0, model.experts, (tokens, model.top_k), dtype=torch.int32, device=device)
        return (lambda: triton_moe.moe_align_block_size(ids, model.experts, 64)), None

    return Case(model.name, "moe align", f"t{tokens}", False, build)


def router_case(model: Model, tokens: int) -> Case:
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_moe

        logits = torch.randn(tokens, model.global_experts, device=device)
        bias = torch.randn(model.global_experts, device=device) * 0.01
        return (lambda: triton_moe.noaux_tc_router(logits, bias, model.top_k, 1, 1, True, 2.827)), None

    return Case(model.name, "router", f"t{tokens}", True, build)


def route_sort_case(model: Model, tokens: int) -> Case:
    """noaux_tc routing and the expert sort of a small step in one launch (layers/moe.py `Router.route_and_sort`)."""
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_moe

        logits = torch.randn(tokens, model.global_experts, device=device)
        bias = torch.randn(model.global_experts, device=device) * 0.01
        return (lambda: triton_moe.noaux_tc_route_and_sort(logits, bias, model.top_k, 1, 1, True, 2.827,
                                                           model.global_experts)), None

    return Case(model.name, "route+sort", f"t{tokens}", True, build)


def mla_rope_cache_case(model: Model, tokens: int) -> Case:
    """MLA's latent norm, rotations, cache write and absorbed query in one launch (nope 128)."""
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_rotary

        nope, width = 128, model.latent + model.rope
        q = torch.randn(tokens, model.heads, nope + model.rope, dtype=torch.bfloat16, device=device)
        kv_a = torch.randn(tokens, width, dtype=torch.bfloat16, device=device)
        w_uk = torch.randn(model.heads, nope, model.latent, dtype=torch.bfloat16, device=device) * 0.05
        norm = torch.ones(model.latent, dtype=torch.bfloat16, device=device)
        cache = torch.empty(tokens // BLOCK_SIZE + 2, BLOCK_SIZE, width, dtype=torch.bfloat16, device=device)
        slots = torch.randperm(cache.shape[0] * BLOCK_SIZE, device=device)[:tokens]
        cos = torch.randn(MAX_MODEL_LEN, model.rope // 2, device=device)
        positions = torch.randint(0, MAX_MODEL_LEN, (tokens,), device=device)
        return (lambda: triton_rotary.mla_rope_and_cache(positions, q, kv_a, w_uk, norm, 1e-6, cos, cos, True, cache,
                                                         slots)), None

    return Case(model.name, "mla rope+cache", f"t{tokens}", True, build)


def combine_case(model: Model, tokens: int) -> Case:
    """The routed rows' sum plus the shared expert (one expert's width) computed in the combine kernel."""
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_moe

        per_pair = torch.randn(tokens, model.top_k, model.hidden, device=device)
        gate_up = torch.randn(tokens, 2 * model.inter, dtype=torch.bfloat16, device=device)
        w_down = torch.randn(model.hidden, model.inter, dtype=torch.bfloat16, device=device) * 0.02
        return (lambda: triton_moe.moe_combine(per_pair, torch.bfloat16, (gate_up, w_down))), None

    return Case(model.name, "moe combine+shared", f"t{tokens}", True, build)


def norm_case(model: Model, tokens: int, width: int, residual: bool) -> Case:
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_norm

        x = torch.randn(tokens, width, dtype=torch.bfloat16, device=device)
        w = torch.ones(width, dtype=torch.bfloat16, device=device)
        if residual:
            return (lambda: triton_norm.fused_add_rms_norm(x, x.clone(), w, 1e-6)), None
        return (lambda: triton_norm.rms_norm(x, w, 1e-6)), None

    return Case(model.name, "add+rmsnorm" if residual else "rmsnorm", f"t{tokens} w{width}", True, build)


def rotary_case(model: Model, tokens: int) -> Case:
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_rotary

        q = torch.randn(tokens, model.heads, model.rope, dtype=torch.bfloat16, device=device)
        k = torch.randn(tokens, 1, model.rope, dtype=torch.bfloat16, device=device)
        cos = torch.randn(MAX_MODEL_LEN, model.rope // 2, device=device)
        positions = torch.randint(0, MAX_MODEL_LEN, (tokens,), device=device)
        return (lambda: triton_rotary.apply_rotary(positions, q, k, cos, cos, True)), None

    return Case(model.name, "rotary", f"t{tokens}", True, build)


def sampling_case(model: Model, rows: int, filtered: bool) -> Case:
    def build(device: str) -> tuple[Callable[[], Any], Callable[[list[Launch]], Traffic]]:
        import torch

        from reasoning_engine.kernels import triton_sampling

        logits = torch.randn(rows, model.vocab, device=device)
        temperature = torch.full((rows,), 0.7 if filtered else 0.0, device=device)
        top_k = torch.full((rows,), 50 if filtered else 0, dtype=torch.int64, device=device)
        top_p = torch.full((rows,), 0.95 if filtered else 1.0, device=device)
        min_p = torch.zeros(rows, device=device)
        seeds = torch.arange(rows, dtype=torch.int64, device=device)
        run = lambda: triton_sampling.sample(logits, temperature, top_k, top_p, min_p, seeds, seeds)  # noqa: E731
        passes = triton_sampling.logit_passes(filtered, filtered)
        return run, lambda _: Traffic(rows * model.vocab * 4, {"_sample_kernel": (passes * rows * model.vocab * 4, rows)})

    return Case(model.name, "sample", f"b{rows} {'top-k+top-p' if filtered else 'greedy'}", True, build, launched=False)


def verify_sampling_case(model: Model, rows: int, drafts: int) -> Case:
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_sampling

        ids = torch.randint(0, model.vocab, (rows, drafts), device=device)
        counts = torch.full((rows,), drafts, dtype=torch.int64, device=device)
        p = torch.rand(rows, drafts + 1, model.vocab, device=device)
        seeds = torch.arange(rows, dtype=torch.int64, device=device)
        return (lambda: triton_sampling.rejection_sample(ids, counts, None, p, seeds, seeds)), None

    return Case(model.name, "rejection sample", f"b{rows} k{drafts}", True, build, launched=False)


def vision_attention_case(lengths: list[int], shape: str) -> Case:
    """Kimi K2.5's MoonViT (16 heads of 72, width 1152): bidirectional attention within each image or video chunk
    of a step's encoder batch."""
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_vision_attention

        total = sum(lengths)
        q, k, v = (torch.randn(total, 16, 72, dtype=torch.bfloat16, device=device) for _ in range(3))
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        cu = torch.tensor(starts, dtype=torch.int32, device=device)
        return (lambda: triton_vision_attention.varlen_attention(q, k, v, cu, 72 ** -0.5, max(lengths))), None

    return Case("MoonViT", "vision attention", shape, False, build)


DSV32_TP8 = Model("dsv32-tp8", heads=16, hidden=7168, experts=256, global_experts=256, top_k=8, inter=256, quant=None,
                  q_lora=1536, vocab=129280)
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 64, 128, 2048  # DeepSeek-V3.2's lightning indexer (GLM-5: 32 heads)


def dsa_indexer_case(model: Model, tokens: int, context: int, decode_path: bool) -> Case:
    """The indexer's scores for `tokens` queries (decode: one per sequence) over `context` cached tokens each."""
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_sparse_attention as tsa

        fb, num_blocks = (_decode_batch(tokens, context, False, device) if decode_path
                          else _ragged_batch(context, [tokens], False, device))
        keys = torch.randn(num_blocks, BLOCK_SIZE, INDEX_DIM, dtype=torch.bfloat16, device=device)
        q = torch.randn(fb.num_tokens, INDEX_HEADS, INDEX_DIM, dtype=torch.bfloat16, device=device)
        weights = torch.randn(fb.num_tokens, INDEX_HEADS, dtype=torch.float32, device=device)
        return (lambda: tsa.indexer_scores(q, weights, keys, fb, 0, fb.num_tokens)), None

    shape = f"b{tokens} ctx{_k(context)}" if decode_path else f"chunk{_k(tokens)} after {_k(context)}"
    return Case(model.name, "dsa indexer", shape, decode_path, build)


def dsa_sparse_mla_case(model: Model, tokens: int, context: int, decode_path: bool) -> Case:
    """MLA over each query's INDEX_TOPK selected positions of a `context`-token cache."""
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_attention as ta
        from reasoning_engine.kernels import triton_sparse_attention as tsa

        fb, num_blocks = (_decode_batch(tokens, context, False, device) if decode_path
                          else _ragged_batch(context, [tokens], False, device))
        width = model.latent + model.rope
        kv = torch.randn(num_blocks, BLOCK_SIZE, width, dtype=torch.bfloat16, device=device)
        q = torch.randn(fb.num_tokens, model.heads, width, dtype=torch.bfloat16, device=device)
        selected = torch.randint(0, context, (fb.num_tokens, INDEX_TOPK), device=device)
        meta = ta.prepare_attention(fb, BLOCK_SIZE)
        return (lambda: tsa.sparse_latent_attention(q, kv, model.latent, fb, meta, 192**-0.5, selected)), None

    shape = f"b{tokens} ctx{_k(context)}" if decode_path else f"chunk{_k(tokens)} after {_k(context)}"
    return Case(model.name, "dsa sparse mla", shape, decode_path, build)


def dsa_cases() -> list[Case]:
    """DeepSeek-V3.2 / GLM-5 sparse attention at DeepSeek-V3.2's shapes under TP=8."""
    cases: list[Case] = []
    for make in (dsa_indexer_case, dsa_sparse_mla_case):
        cases += [make(DSV32_TP8, b, ctx, True) for b in DECODE_BATCHES for ctx in (32768, 131072)]
        cases.append(make(DSV32_TP8, 2048, 30720, False))
    return cases


@dataclass(frozen=True)
class V4Shapes:
    """DeepSeek-V4-Flash's attention (transformers' DeepseekV4Config defaults, the published V4-Flash config): one
    K = V row of `head_dim` per token, a sliding `window`, compressed rows at `csa_rate` (the indexer keeps
    `index_topk`, scoring with `index_heads` x `index_dim`) and `hca_rate` (all attended)."""

    name: str
    heads: int  # query heads on one rank (64 on one GPU or with data-parallel attention, 8 under TP 8)
    head_dim: int = 512
    window: int = 128
    csa_rate: int = 4
    hca_rate: int = 128
    index_heads: int = 64
    index_dim: int = 128
    index_topk: int = 512


V4_FLASH = V4Shapes("v4-flash", heads=64)
V4_FLASH_TP8 = V4Shapes("v4-flash-tp8", heads=8)
V4_KINDS = ("sliding", "csa", "hca")


def _v4_keys(v4: V4Shapes, kind: str, position: int) -> tuple[int, int]:
    """(window rows, compressed rows) a query at `position` attends to in a layer of `kind`."""
    window = min(v4.window, position + 1)
    finished = (position + 1) // (v4.csa_rate if kind == "csa" else v4.hca_rate)
    rows = {"sliding": 0, "csa": min(v4.index_topk, finished), "hca": finished}[kind]
    return window, rows


def _v4_attention_traffic(v4: V4Shapes, batch: int, ctx: int, kind: str) -> Traffic:
    """Minimum: each query's window and compressed rows once, its query in and output out. Modelled: every program
    (a block of up to 16 heads of one query) reads all of them; programs of one query share them through L2 at best."""
    from reasoning_engine.kernels import triton_compressed_attention as tca

    window, rows = _v4_keys(v4, kind, ctx - 1)
    row_bytes = v4.head_dim * BF16
    io = batch * v4.heads * 2 * row_bytes
    programs = batch * -(-v4.heads // tca._HEAD_BLOCK)
    return Traffic(batch * (window + rows) * row_bytes + io,
                   {"_compressed_attention_kernel": (programs * (window + rows) * row_bytes + io, programs)})


def v4_attention_case(v4: V4Shapes, kind: str, tokens: int, context: int, decode_path: bool) -> Case:
    """One layer of `kind` through `triton_compressed_attention.compressed_attention`: decode (one query per
    sequence of `context` tokens) or a prefill chunk of `tokens` after `context` (each query its own window and
    rows). Addressing as `compressed_attention.prepare_compressed` builds it (random blocks: the kernel gathers)."""
    def build(device: str) -> tuple[Callable[[], Any], Callable[[list[Launch]], Traffic] | None]:
        import torch

        from reasoning_engine.kernels import triton_compressed_attention as tca

        n = tokens  # query tokens
        last = context + (0 if decode_path else tokens) - 1
        window, rows = _v4_keys(v4, kind, last)
        window_blocks = n * -(-v4.window // BLOCK_SIZE) + 1
        cache = torch.randn(window_blocks, BLOCK_SIZE, v4.head_dim, dtype=torch.bfloat16, device=device)
        address = lambda width, blocks, per: (  # noqa: E731
            torch.randint(0, blocks, (n, width), device=device), torch.randint(0, per, (n, width), device=device),
            torch.ones(n, width, dtype=torch.bool, device=device))
        q = torch.randn(n, v4.heads, v4.head_dim, dtype=torch.bfloat16, device=device)
        sinks = torch.randn(v4.heads, dtype=torch.bfloat16, device=device)
        kwargs = {}
        if rows:
            rate = v4.csa_rate if kind == "csa" else v4.hca_rate
            per = max(1, BLOCK_SIZE // rate)
            row_blocks = -(-(last + 1) // max(BLOCK_SIZE, rate)) * (n if decode_path else 1) + 1
            kwargs = dict(zip(("row_block", "row_offset", "row_valid"), address(rows, row_blocks, per)))
            kwargs["row_cache"] = torch.randn(row_blocks, per, v4.head_dim, dtype=torch.bfloat16, device=device)
        run = lambda: tca.compressed_attention(q, cache, *address(window, window_blocks, BLOCK_SIZE), sinks,  # noqa: E731
                                               v4.head_dim**-0.5, **kwargs)
        return run, (lambda _: _v4_attention_traffic(v4, tokens, context, kind)) if decode_path else None

    shape = f"b{tokens} ctx{_k(context)}" if decode_path else f"chunk{_k(tokens)} after {_k(context)}"
    return Case(v4.name, f"v4 {kind} attention", shape, decode_path, build)


def v4_indexer_case(v4: V4Shapes, tokens: int, context: int, decode_path: bool) -> Case:
    """The DSA indexer kernel at V4-Flash's indexer shapes (64 heads x 128): CSA's scores over the finished 4:1 rows
    of a `context`-token sequence (context / 4 positions)."""
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_sparse_attention as tsa

        rows = context // v4.csa_rate
        fb, num_blocks = (_decode_batch(tokens, rows, False, device) if decode_path
                          else _ragged_batch(rows, [tokens // v4.csa_rate], False, device))
        keys = torch.randn(num_blocks, BLOCK_SIZE, v4.index_dim, dtype=torch.bfloat16, device=device)
        q = torch.randn(fb.num_tokens, v4.index_heads, v4.index_dim, dtype=torch.bfloat16, device=device)
        weights = torch.randn(fb.num_tokens, v4.index_heads, dtype=torch.float32, device=device)
        return (lambda: tsa.indexer_scores(q, weights, keys, fb, 0, fb.num_tokens)), None

    shape = f"b{tokens} ctx{_k(context)}" if decode_path else f"chunk{_k(tokens)} after {_k(context)}"
    return Case(v4.name, "v4 csa indexer (dsa kernel)", shape, decode_path, build)


def v4_cases() -> list[Case]:
    """DeepSeek-V4-Flash's attention kernels: each layer kind's attention at decode (batches 1, 8, 64; 32k and 128k
    contexts) and in a 2k chunk after 30k, on one GPU's 64 heads and TP 8's 8; the DSA indexer at its index shapes."""
    cases: list[Case] = []
    for v4 in (V4_FLASH, V4_FLASH_TP8):
        for kind in V4_KINDS:
            contexts = (32768,) if kind == "sliding" else (32768, 131072)  # a window's work does not grow
            cases += [v4_attention_case(v4, kind, b, ctx, True) for b in DECODE_BATCHES for ctx in contexts]
            cases.append(v4_attention_case(v4, kind, 2048, 30720, False))
    cases += [v4_indexer_case(V4_FLASH, b, ctx, True) for b in DECODE_BATCHES for ctx in (32768, 131072)]
    cases.append(v4_indexer_case(V4_FLASH, 2048, 30720, False))
    return cases


GPT_OSS_HEADS, GPT_OSS_KV_HEADS, GPT_OSS_HEAD_DIM, GPT_OSS_WINDOW = 64, 8, 64, 128  # gpt-oss-120b on one GPU


def gpt_oss_attention_case(batch: int, ctx: int, window: int | None, decode_path: bool) -> Case:
    """gpt-oss-120b's GQA with sinks, on a sliding (window 128) or full layer: decode steps as a CUDA graph replays
    them, or one prefill chunk after `ctx` cached tokens."""
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_attention as ta

        fb, num_blocks = _decode_batch(batch, ctx, True, device) if decode_path else _ragged_batch(ctx, [batch], False, device)
        cache = torch.randn(num_blocks, BLOCK_SIZE, GPT_OSS_KV_HEADS, GPT_OSS_HEAD_DIM, dtype=torch.bfloat16, device=device)
        q = torch.randn(fb.num_tokens, GPT_OSS_HEADS, GPT_OSS_HEAD_DIM, dtype=torch.bfloat16, device=device)
        sinks = torch.randn(GPT_OSS_HEADS, dtype=torch.bfloat16, device=device)
        meta = ta.prepare_attention(fb, BLOCK_SIZE)
        return (lambda: ta.paged_attention(q, cache, cache, fb, meta, GPT_OSS_HEAD_DIM**-0.5, sinks, window)), None

    layer = f"window{window}" if window else "full"
    shape = f"b{batch} ctx{_k(ctx)} graph {layer}" if decode_path else f"chunk{_k(batch)} after {_k(ctx)} {layer}"
    return Case("gpt-oss-120b", "gqa+sinks decode" if decode_path else "gqa+sinks prefill", shape, decode_path, build)


def gpt_oss_moe_case(tokens: int, decode_path: bool) -> Case:
    """gpt-oss-120b's experts as shipped: 128 experts in MXFP4, top-4, hidden = intermediate = 2880, with biases and
    the clamped SwiGLU."""
    def build(device: str) -> tuple[Callable[[], Any], None]:
        import torch

        from reasoning_engine.kernels import triton_moe
        from reasoning_engine.kernels.fused_moe import MoEQuant

        e, h, i, k = 128, 2880, 2880, 4
        w13 = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, device=device)
        w2 = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, device=device)
        quant = MoEQuant("mxfp4", torch.full((e, 2 * i, h // 32), 120, dtype=torch.uint8, device=device),
                         torch.full((e, h, i // 32), 120, dtype=torch.uint8, device=device))
        b13 = torch.zeros(e, 2 * i, dtype=torch.bfloat16, device=device)
        b2 = torch.zeros(e, h, dtype=torch.bfloat16, device=device)
        hidden = torch.randn(tokens, h, dtype=torch.bfloat16, device=device)
        weights = torch.rand(tokens, k, device=device)
        ids = torch.rand(tokens, e, device=device).topk(k, dim=-1).indices.to(torch.int32)
        return (lambda: triton_moe.fused_moe(hidden, w13, w2, weights, ids, quant, w13_bias=b13, w2_bias=b2,
                                             swiglu_limit=7.0)), None

    return Case("gpt-oss-120b", "moe mxfp4", f"t{tokens}", decode_path, build)


def gpt_oss_cases() -> list[Case]:
    cases = [gpt_oss_attention_case(b, ctx, w, True) for b in (1, 64) for ctx in (32768, 131072)
             for w in (GPT_OSS_WINDOW, None)]
    cases += [gpt_oss_attention_case(8192, 0, w, False) for w in (GPT_OSS_WINDOW, None)]
    cases += [gpt_oss_moe_case(t, True) for t in DECODE_BATCHES] + [gpt_oss_moe_case(8192, False)]
    return cases


def all_cases() -> list[Case]:
    cases: list[Case] = []
    for model in ATTENTION_MODELS:
        for graph in (False, True):
            cases += [attention_decode_case(model, b, ctx, graph) for b in DECODE_BATCHES for ctx in CONTEXTS]
        cases += [attention_ragged_case(model, 0, [n], False, False, f"chunk{_k(n)}") for n in PREFILL_CHUNKS]
        cases.append(attention_ragged_case(model, 30720, [2048], False, False, "chunk2k after 30k"))
        for ctx in (32768, 131072):  # verification alone, and a mixed step: decodes, draft trees and a prefill chunk
            cases.append(attention_ragged_case(model, ctx, [4] * 8, True, True, f"b8 x 4 tokens ctx{_k(ctx)} tree"))
            cases.append(attention_ragged_case(model, ctx, [1] * 8 + [4] * 2 + [2048], True, True,
                                               f"mixed 8 decodes + 2 x 4-token trees + chunk2k ctx{_k(ctx)}"))
        cases += [cache_write_case(model, b, True) for b in DECODE_BATCHES]
        cases.append(cache_write_case(model, 8192, False))
    for model in (KIMI_TP8, KIMI_EP8):  # `--kv-cache-dtype fp8`: the same decode and verify steps over FP8 latent rows
        for graph in (False, True):
            cases += [attention_decode_case(model, b, ctx, graph, fp8=True) for b in DECODE_BATCHES for ctx in CONTEXTS]
        for ctx in (32768, 131072):
            cases.append(attention_ragged_case(model, ctx, [4] * 8, True, True, f"b8 x 4 tokens ctx{_k(ctx)} tree", fp8=True))
            cases.append(attention_ragged_case(model, ctx, [1] * 8 + [4] * 2 + [2048], True, True,
                                               f"mixed 8 decodes + 2 x 4-token trees + chunk2k ctx{_k(ctx)}", fp8=True))
    for model in MOE_MODELS:
        cases += [moe_case(model, b, True) for b in DECODE_BATCHES]
        cases += [moe_case(model, n, False) for n in PREFILL_CHUNKS]
    cases += [align_case(KIMI_TP8, 16384), align_case(KIMI_EP8, 16384)]
    for model in (KIMI_TP8, MOONLIGHT):
        cases += [router_case(model, b) for b in DECODE_BATCHES]
        widths = (model.hidden, model.latent) + ((model.q_lora,) if model.q_lora else ())
        cases += [norm_case(model, b, w, w == model.hidden) for b in DECODE_BATCHES for w in widths]
        cases += [rotary_case(model, b) for b in DECODE_BATCHES]
        cases += [route_sort_case(model, b) for b in (1, 8)]
        cases += [mla_rope_cache_case(model, b) for b in DECODE_BATCHES]
        cases += [combine_case(model, b) for b in DECODE_BATCHES]
    cases += [sampling_case(KIMI_TP8, b, f) for b in DECODE_BATCHES for f in (False, True)]
    cases += [verify_sampling_case(KIMI_TP8, b, 3) for b in (1, 8)]
    cases += [vision_attention_case([4096], "1 image x 4096 patches"),
              vision_attention_case([1024] * 8, "8 images x 1024 patches"),
              vision_attention_case([16384], "1 image x 16384 patches")]
    cases += dsa_cases()
    cases += gpt_oss_cases()
    cases += v4_cases()
    return cases


# ---------------------------------------------------------------------------------------------------------- capture


@dataclass
class Launch:
    fn: Any  # the JITFunction
    args: tuple
    kwargs: dict
    grid: tuple

    @property
    def kernel(self) -> str:
        return self.fn.__name__

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


@contextlib.contextmanager
def recording_launches(launches: list[Launch]):
    """Replace every JIT launch with a recorder: the wrappers run their host code (on meta tensors) and each kernel
    launch is kept instead of compiled and run."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self, args, dict(kwargs), tuple(grid)))

    JITFunction.run = record
    try:
        yield
    finally:
        JITFunction.run = original


@dataclass(frozen=True)
class CompileJob:
    """Everything `triton.compile` needs for one kernel specialisation, picklable for a worker process."""

    module: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict  # argument path -> value
    attrs: dict  # argument path -> [["tt.divisibility", 16]] and the like
    options: dict  # the backend options of the launch (num_warps, num_stages, ...)
    arch: int
    source_key: str  # the JIT function's hash of its source and the functions it calls

    def key(self) -> str:
        import triton

        text = repr((self.module, self.kernel, sorted(self.signature.items()), sorted(self.constexprs.items()),
                     sorted(self.attrs.items()), sorted(self.options.items()), self.arch, self.source_key,
                     triton.__version__, RESULT_VERSION))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def config(self) -> str:
        """The launch configuration in one short string: constexprs (and integers specialised to 1) by name, the
        number of arguments specialised as 16-divisible, warps and stages."""
        names = list(self.signature)
        parts = [f"{names[path[0]]}={value}" for path, value in sorted(self.constexprs.items())]
        parts += [f"div16={sum(1 for a in self.attrs.values() if a)}", f"warps={self.options['num_warps']}",
                  f"stages={self.options['num_stages']}"]
        return " ".join(parts)


def compile_job(launch: Launch, target: Target) -> CompileJob:
    """Specialise a recorded launch for `target` exactly as Triton's launcher would, without a driver."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", target.arch, 32))
    kwargs = dict(launch.kwargs, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
    binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = launch.fn._pack_args(backend, kwargs, bound, specialization, options)
    return CompileJob(module=launch.fn.__module__, kernel=launch.kernel, signature=signature, constexprs=constexprs,
                      attrs=attrs, options=dict(options.__dict__), arch=target.arch, source_key=launch.fn.cache_key)


RESULT_VERSION = 3  # of a cached compile result's fields (2: the SASS main loop; 3: loops moving no memory left out)
_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def run_compile(job: CompileJob) -> dict[str, Any]:
    """Compile one job (in a worker process) and read its resources from ptxas's log and the kernel metadata."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(job.module), job.kernel)
    src = ASTSource(fn=fn, signature=job.signature, constexprs=job.constexprs, attrs=job.attrs)
    log = io.StringIO()
    start = time.perf_counter()
    knobs.nvidia.dump_ptxas_log = True
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=GPUTarget("cuda", job.arch, 32), options=job.options)
    text = log.getvalue()
    regs = [int(m) for m in _PTXAS.findall(text)]
    spills = [tuple(int(x) for x in m) for m in _SPILL.findall(text)]
    if not regs or not spills:
        raise RuntimeError(f"no ptxas resource line for {job.kernel}: {text[-500:]!r}")
    return {"sass": sass_main_loop(disassemble(compiled.asm["cubin"])),
        "registers": regs[-1], "stack_bytes": spills[-1][0], "spill_bytes": spills[-1][1], "spill_load_bytes": spills[-1][2],
        "shared_bytes": int(compiled.metadata.shared), "num_warps": int(compiled.metadata.num_warps),
        "num_stages": int(compiled.metadata.num_stages), "compile_s": round(time.perf_counter() - start, 2),
    }


def disassemble(cubin: bytes) -> str:
    """The cubin's SASS, from the cuobjdump bundled with Triton."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-sass", handle.name], capture_output=True, text=True,
                              check=True).stdout


def _worker_init() -> None:
    """Compile only; and compile always: a kernel Triton has cached would not run ptxas, whose log is read here."""
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set to silence its warning


def compile_all(jobs: list[CompileJob], cache_dir: Path, workers: int) -> dict[str, dict[str, Any]]:
    """Results of every distinct job, from the cache or compiled in `workers` processes (written to the cache)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    todo: dict[str, CompileJob] = {}
    for job in jobs:
        key = job.key()
        path = cache_dir / f"{key}.json"
        if key in results or key in todo:
            continue
        if path.exists():
            results[key] = json.loads(path.read_text())
        else:
            todo[key] = job
    if todo:
        print(f"compiling {len(todo)} kernel variants ({len(results)} cached) in {workers} processes", file=sys.stderr)
    for _ in range(2):  # a compiler crash kills its process and fails the pool's pending jobs: those get a second pool
        broken: dict[str, CompileJob] = {}
        if not todo:
            break
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
            futures = {pool.submit(run_compile, job): key for key, job in todo.items()}
            for done in concurrent.futures.as_completed(futures):
                key = futures[done]
                job = todo[key]
                try:
                    result = done.result()
                except BrokenProcessPool:
                    broken[key] = job
                    continue
                except Exception as exc:  # a kernel that does not compile is a finding, not a crash of the report
                    result = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                else:
                    (cache_dir / f"{key}.json").write_text(json.dumps(result))
                results[key] = result
                print(f"  {job.kernel} sm_{job.arch} {result.get('registers', '?')} regs "
                      f"{result.get('spill_bytes', '?')} B spill {result.get('shared_bytes', '?')} B smem "
                      f"({result.get('compile_s', '?')} s)", file=sys.stderr)
        todo = broken
    results.update({key: {"error": "the compiling process died"} for key in todo})
    return results


# --------------------------------------------------------------------------------------------------------- analysis


_SASS = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.+?)\s*;", re.MULTILINE)
_GLOBAL_MEMORY = ("LDG", "LDGSTS", "STG", "ATOMG", "RED", "LD", "ST")
_BULK_COPIES = ("UTMALDG", "UBLKCP", "UTMASTG", "UTMAPF")


def _access_bytes(opcode: str) -> int:
    """Bytes one thread moves with a global load or store, from its width suffix (32 bits when none is given)."""
    parts = opcode.split(".")[1:]
    for width, size in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("16", 2), ("U8", 1), ("S8", 1), ("8", 1)):
        if width in parts:
            return size
    return 4


def mma_kind(opcodes: list[str]) -> str:
    """The tensor-core instruction kind in SASS: HGMMA/QGMMA/IGMMA = wgmma (sm_90a), UTC*MMA = tcgen05 (sm_100a),
    HMMA/IMMA/QMMA = mma.sync; "none" when the kernel does no matrix work on tensor cores."""
    heads = {op.split(".")[0] for op in opcodes}
    if heads & {"HGMMA", "QGMMA", "IGMMA", "BGMMA"}:
        return "wgmma"
    if any(h.startswith("UTC") and h.endswith("MMA") for h in heads):
        return "tcgen05"
    if heads & {"HMMA", "IMMA", "QMMA", "OMMA"}:
        return "mma.sync"
    return "none"


def sass_main_loop(sass: str) -> dict[str, Any]:
    """The main loop of a kernel from its SASS (cuobjdump --dump-sass): loops are backward branches; the main one is
    the innermost loop moving the most global-memory bytes (ties: the longest), which for a streaming kernel is the
    hottest; a kernel with no loop that moves global memory is one pass, counted whole. Returns its warp-instructions per iteration (NOPs left
    out), the global bytes per warp its loads and stores request per iteration (None when it uses bulk/TMA copies,
    whose sizes SASS does not show), the mma kind of the whole kernel and of the loop, and the loop's span."""
    code = []  # (address, opcode, operands)
    for address, text in _SASS.findall(sass):
        tokens = text.split()
        if tokens and tokens[0].startswith("@"):
            tokens = tokens[1:]
        if tokens:
            code.append((int(address, 16), tokens[0], tokens[1:]))
    loops = []
    for address, opcode, operands in code:
        if opcode.split(".")[0] == "BRA" and operands:
            target = operands[-1].rstrip(";")
            if target.startswith("0x") and int(target, 16) < address:
                loops.append((int(target, 16), address))

    def span(start: int, end: int) -> dict[str, Any]:
        body = [(op, args) for address, op, args in code if start <= address <= end and not op.startswith("NOP")]
        global_bytes = sum(32 * _access_bytes(op) for op, _ in body if op.split(".")[0] in _GLOBAL_MEMORY)
        bulk = any(op.split(".")[0] in _BULK_COPIES for op, _ in body)
        return {"instructions": len(body), "global_bytes": None if bulk else global_bytes, "bulk": bulk,
                "mma": mma_kind([op for op, _ in body]), "span": f"{start:#x}-{end:#x}"}

    innermost = [(a, b) for a, b in loops if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]
    # a loop that moves no global memory (a barrier wait, as for a tcgen05 mma on sm_100) is not the main loop
    candidates = [c for c in (span(a, b) for a, b in innermost) if c["bulk"] or c["global_bytes"]]
    if candidates:
        main = max(candidates, key=lambda c: (c["bulk"] or bool(c["global_bytes"]), c["global_bytes"] or 0, c["instructions"]))
        main["loop"] = True
    else:
        last = code[-1][0] if code else 0
        main = dict(span(0, last), loop=False)
        # the trailing self-branch (`BRA .`) that pads every kernel is no work: `span` counts it, take it off
        main["instructions"] = max(0, main["instructions"] - 1)
    main["kernel_mma"] = mma_kind([op for _, op, _ in code])
    return main


def streamed_tile_bytes(kernel: str, kwargs: dict[str, Any]) -> float | None:
    """HBM bytes one main-loop iteration of a CTA streams, from the launch's tile shape, for the kernels whose loop
    walks a tensor that lives in HBM and is read once (expert weights, the KV cache); None for others (the SASS
    global bytes stand in). Other operands of these loops (activations, queries) are re-read from L2 and not counted."""
    get = kwargs.get
    step = get("STEP", get("BLOCK_K"))  # input channels per iteration (STEP since the W4A16 rewrite)
    if kernel == "_moe_gemm_kernel" and step and {"BLOCK_N", "QUANT"} <= set(kwargs):
        rows = get("BLOCK_N") * (2 if get("GATED") else 1)
        weight, scale = {0: (2.0, 0), 1: (0.5, 2), 2: (1.0, 4), 3: (0.5, 1)}.get(get("QUANT"), (2.0, 0))
        scales = rows / get("SCALE_N", 1) * step / get("SCALE_K", 1) * scale if scale else 0.0
        return rows * step * weight + scales
    if kernel in ("_decode_partial_kernel", "_prefill_kernel", "_latent_partial_kernel") and {"BLOCK_N", "D1"} <= set(kwargs):
        from reasoning_engine.kernels.fp8_cache import SCALE_BYTES

        v_from_k = get("V_FROM_K", True)  # the latent kernel's values are its key rows' latent part
        if get("FP8"):  # e4m3 channels with a bf16 scale per row, the tail (MLA's rotary key) in bf16
            key = get("D1") + SCALE_BYTES + get("D2", 0) * BF16
            return get("BLOCK_N") * (key + (0 if v_from_k else get("DV", 0) + SCALE_BYTES))
        return get("BLOCK_N") * (get("D1") + get("D2", 0) + (0 if v_from_k else get("DV", 0))) * BF16
    if kernel == "_compressed_attention_kernel" and {"BLOCK_N", "D"} <= set(kwargs):
        return get("BLOCK_N") * get("D") * BF16  # the gathered K = V rows (values are the keys' tile)
    return None


def issue_bound(sass: dict[str, Any] | None, launch: Launch, num_warps: int, target: Target) -> tuple[float | None, float | None, str]:
    """(fraction, bytes per CTA iteration, where the bytes come from): the tile model, capped by what the loop's
    loads request (each warp runs the loop: SASS bytes x warps), or the SASS bytes alone."""
    if not sass or not sass.get("instructions"):
        return None, None, "none"
    tile = streamed_tile_bytes(launch.kernel, launch.kwargs)
    requested = sass["global_bytes"] * num_warps if sass.get("global_bytes") is not None else None
    if tile is not None:
        moved, source = (min(tile, requested), "tile shape") if requested else (tile, "tile shape")
    elif requested is not None:
        moved, source = float(requested), "sass loads"
    else:
        return None, None, "bulk copies of unknown size"
    return target.issue_bound_fraction(moved, sass["instructions"] * num_warps), moved, source



def ctas_per_sm(registers: int, num_warps: int, shared: int) -> int:
    """Resident CTAs per SM allowed by registers, shared memory, threads and the CTA limit (sm_90 and sm_100)."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = (REGISTERS_PER_SM // regs_per_warp) // num_warps
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED) if shared <= SHARED_PER_CTA else 0
    by_threads = MAX_THREADS_PER_SM // (32 * num_warps)
    return min(by_regs, by_shared, by_threads, MAX_CTAS_PER_SM)


@dataclass
class Row:
    case: Case
    launch: Launch
    target: Target
    job: CompileJob
    result: dict[str, Any]

    def record(self) -> dict[str, Any]:
        r = self.result
        ctas = ctas_per_sm(r["registers"], r["num_warps"], r["shared_bytes"]) if "error" not in r else 0
        sass = r.get("sass")
        fraction, moved, source = issue_bound(sass, self.launch, r.get("num_warps", 0), self.target)
        return {
            "kernel": self.launch.kernel, "target": self.target.name, "shape": self.case.label, "model": self.case.model,
            "registers": r.get("registers"), "spill_bytes": r.get("spill_bytes"), "spill_load_bytes": r.get("spill_load_bytes"),
            "shared_bytes": r.get("shared_bytes"), "shared_limit": SHARED_PER_CTA, "num_warps": r.get("num_warps"),
            "num_stages": r.get("num_stages"), "programs": self.launch.programs, "ctas_per_sm": ctas,
            "occupancy": round(ctas * r.get("num_warps", 0) / 64, 3), "decode_path": self.case.decode_path,
            "launched": self.case.launched, "config": self.job.config(),
            "mma": sass["kernel_mma"] if sass else None, "loop_mma": sass["mma"] if sass else None,
            "loop_instructions": sass["instructions"] if sass else None, "main_loop": bool(sass and sass["loop"]),
            "loop_bytes": moved, "loop_bytes_source": source,
            "issue_bound_fraction": None if fraction is None else round(fraction, 3),
            **({"error": r["error"]} if "error" in r else {}),
        }


def passes_targets(record: dict[str, Any]) -> bool:
    return "error" not in record and record["spill_bytes"] == 0 and record["shared_bytes"] <= record["shared_limit"]


@dataclass
class Measurement:
    case: Case
    seconds: float | None
    error: str = ""  # why the shape has no time (out of memory, a failed launch)


def measure(cases: list[Case], device: str, budget_s: float,
            on_measured: Callable[[list[Measurement]], None] = lambda _: None) -> list[Measurement]:
    """Time each op with do_bench (medians; L2 flushed between runs) on real tensors; stop when the budget is spent.
    `on_measured` sees the list after every shape, so the report on disk grows as the numbers come in."""
    import torch
    import triton

    out: list[Measurement] = []
    start = time.time()
    for case in cases:
        if time.time() - start > budget_s:
            print(f"budget spent: {case.label} and later cases not measured", file=sys.stderr)
            break
        try:
            run, _ = case.build(device)
            if device == "cuda":
                seconds = triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median") * 1e-3
            else:
                run()
                t0 = time.perf_counter()
                run()
                seconds = time.perf_counter() - t0
            out.append(Measurement(case, seconds))
            print(f"  {case.label}: {seconds * 1e6:.1f} us", file=sys.stderr)
        except Exception as exc:  # one failing shape (e.g. out of memory) costs that shape only
            error = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "\\|")[:200]
            out.append(Measurement(case, None, error))
            print(f"  {case.label}: {error}", file=sys.stderr)
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        on_measured(out)
    return out


def loaded_kernels() -> list[str]:
    """Registers and spills of the kernel binaries the driver loaded during --measure (the ground truth the
    ahead-of-time table predicts)."""
    import importlib

    lines = []
    for module in ("triton_attention", "triton_moe", "triton_norm", "triton_rotary", "triton_sampling",
                   "triton_sparse_attention", "triton_vision_attention", "triton_compressed_attention"):
        mod = importlib.import_module(f"reasoning_engine.kernels.{module}")
        for name, fn in sorted(vars(mod).items()):
            for caches in getattr(fn, "device_caches", {}).values():
                for kernel in caches[0].values():
                    kernel._init_handles()
                    lines.append(f"| {name} | {kernel.n_regs} | {kernel.n_spills} | {kernel.metadata.shared} | "
                                 f"{kernel.metadata.num_warps} |")
    return lines


# ----------------------------------------------------------------------------------------------------------- report


def _op(case: Case) -> str:
    return case.op if case.launched else f"{case.op} (not launched by the engine)"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def render(records: list[dict[str, Any]], rows: list[Row], traffic: dict[str, tuple[Case, Traffic]],
           measurements: list[Measurement], loaded: list[str], measured_on: str, command: str, date: str,
           targets: list[Target], device: str, launches: dict[str, Any] | None = None) -> str:
    import triton

    lines = [
        f"# Triton kernels compiled for {', '.join(f'{t.name} ({t.gpu})' for t in targets)}: registers, spills, shared "
        f"memory, occupancy, decode bytes vs roofline ({date}; {device})",
        "",
        f"Produced by `{command}` (Triton {triton.__version__}, ptxas bundled with it). Registers and spill bytes are "
        "per thread, from ptxas -v; shared memory per CTA, from the compiled kernel; occupancy = resident warps / 64 per "
        "SM. How the shapes and models are chosen: the docstring of benchmarks/kernel_report.py.",
        "",
        "## Targets",
        "",
        "| target | decode-path kernel x shape records | with spills | over 227 KB shared | result |",
        "|---|---|---|---|---|",
    ]
    for t in targets:
        mine = [r for r in records if r["target"] == t.name and r["decode_path"]]
        spills = sum(1 for r in mine if r.get("spill_bytes"))
        over = sum(1 for r in mine if (r.get("shared_bytes") or 0) > r["shared_limit"])
        errors = sum(1 for r in mine if "error" in r)
        ok = all(passes_targets(r) for r in mine)
        lines.append(f"| {t.name} no spills, shared within limit | {len(mine)} | {spills} | {over}"
                     f"{f' ({errors} failed to compile)' if errors else ''} | {'PASS' if ok else 'FAIL'} |")

    lines += ["", "## Compiled variants", "",
              "Each distinct specialisation once; `used by` counts the shapes that launch it.", "",
              "Main loop: the innermost SASS loop moving the most global bytes (`-` none: one pass, counted whole); "
              "instr = warp-instructions per iteration per warp; bytes = HBM bytes per CTA iteration (tile shape of the "
              "streamed operand, or the loop's SASS loads); issue-bound = share of HBM bandwidth reachable were issue the "
              f"only limit ({ISSUE_PER_SM_CYCLE} warp-instructions per SM per cycle, "
              + ", ".join(f"{t.gpu} {t.sms} SMs at {t.clock_hz / 1e9:.2f} GHz, {t.bandwidth / 1e12:.1f} TB/s" for t in targets)
              + "); mma = tensor-core instructions (wgmma, tcgen05, mma.sync, none).", "",
              "| kernel | config | target | regs | spill st/ld B | shared B | CTAs/SM | occupancy | loop instr | loop bytes "
              "| issue-bound | mma | decode path | used by |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    variants: dict[str, list[Row]] = {}
    for row in rows:
        variants.setdefault(row.job.key(), []).append(row)
    order = {t.name: i for i, t in enumerate(targets)}
    for group in sorted(variants.values(), key=lambda g: (g[0].launch.kernel, g[0].job.config(), order[g[0].target.name])):
        tname = group[0].target.name
        rec = group[0].record()
        decode = any(g.case.decode_path for g in group)
        if "error" in rec:
            lines.append(f"| {rec['kernel']} | {rec['config']} | {tname} | error: {rec['error'][:120]} | | | | | | | | | "
                         f"{decode} | {len(group)} |")
            continue
        lines.append(f"| {rec['kernel']} | {rec['config']} | {tname} | {rec['registers']} | {rec['spill_bytes']}/"
                     f"{rec['spill_load_bytes']} | {rec['shared_bytes']} | {rec['ctas_per_sm']} | {rec['occupancy']:.0%} | "
                     f"{rec['loop_instructions'] if rec['main_loop'] else '-'} | {_fmt_bytes(rec['loop_bytes'] or 0)} | "
                     f"{'-' if rec['issue_bound_fraction'] is None else format(rec['issue_bound_fraction'], '.0%')} | "
                     f"{rec['mma']} | {'yes' if decode else 'no'} | {len(group)} |")

    tnames = [t.name for t in targets]
    lines += ["", "## Every kernel at every shape", "",
              "regs / spill stores (B) / shared (B) per target; `programs` is the launch grid's size.", "",
              "| model | op | shape | kernel | programs | " + " | ".join(tnames) + " | decode path | launched |",
              "|---|---|---|---|---|" + "---|" * len(tnames) + "---|---|"]
    by_launch: dict[int, list[Row]] = {}
    for row in rows:
        by_launch.setdefault(id(row.launch), []).append(row)
    for group in by_launch.values():
        case, launch = group[0].case, group[0].launch
        per = {row.target.name: row.record() for row in group}
        cells = ["-" if t not in per else "error" if "error" in per[t] else
                 f"{per[t]['registers']} / {per[t]['spill_bytes']} / {per[t]['shared_bytes']}" for t in tnames]
        lines.append(f"| {case.model} | {case.op} | {case.shape} | {launch.kernel} | {launch.programs} | "
                     + " | ".join(cells) + f" | {'yes' if case.decode_path else 'no'} | {'yes' if case.launched else 'no'} |")

    if traffic:
        lines += ["", "## Decode ops: bytes moved vs the roofline", "",
                  "minimum = bytes the op must move; modelled = bytes its kernels request as written (no L2 reuse "
                  "assumed: the programs of one attention slice's head blocks are adjacent in launch order, so their "
                  "repeated cache reads may well hit L2, which --measure decides); roofline = minimum / HBM bandwidth; "
                  "modelled time = each launch's bytes / (bandwidth x min(1, its programs with work / SMs)), a "
                  "first-order model of grids too small to fill the GPU (one SM can draw more than its share, so it "
                  "is pessimistic there); launches = each kernel's share of the modelled bytes, with its programs.", "",
                  "| model | op | shape | minimum | modelled | modelled / minimum | "
                  + " | ".join(f"{t.gpu} roofline us | {t.gpu} modelled us" for t in targets) + " | launches |",
                  "|---|---|---|---|---|---|" + "---|---|" * len(targets) + "---|"]
        for case, tr in traffic.values():
            cells = [f"{tr.minimum / t.bandwidth * 1e6:.1f} | {tr.modelled_seconds(t) * 1e6:.1f}" for t in targets]
            shares = ", ".join(f"{name} {b / tr.modelled:.0%} x {p}" for name, (b, p) in tr.kernels.items())
            lines.append(f"| {case.model} | {_op(case)} | {case.shape} | {_fmt_bytes(tr.minimum)} | {_fmt_bytes(tr.modelled)} | "
                         f"{tr.modelled / tr.minimum:.2f} | " + " | ".join(cells) + f" | {shares} |")
        first = targets[0]
        gaps = sorted(traffic.values(), key=lambda ct: ct[1].minimum / first.bandwidth - ct[1].modelled_seconds(first))
        lines += ["", f"Largest modelled losses on {first.gpu} (modelled time - roofline), the first things to measure:", "",
                  "| model | op | shape | roofline us | modelled us | lost us |", "|---|---|---|---|---|---|"]
        for case, tr in gaps[:10]:
            roof, modelled = tr.minimum / first.bandwidth * 1e6, tr.modelled_seconds(first) * 1e6
            lines.append(f"| {case.model} | {_op(case)} | {case.shape} | {roof:.1f} | {modelled:.1f} | {modelled - roof:.1f} |")
    if launches is not None:
        lines += ["", "## Kernels per decode step (benchmarks/launch_count.py)", ""]
        if "error" in launches:
            lines.append(f"launch count failed: {launches['error'][-300:]}")
        else:
            moe, dense, other = launches["moe_layer"], launches["dense_layer"], launches["outside_layers"]
            lines += [f"A greedy decode step of a Moonlight-shaped deepseek_v3 ({launches['model']}; dummy weights, Triton "
                      f"path, eager{', kernels interpreted' if launches['interpreted'] else ''}): "
                      f"**{launches['launches_per_moe_layer']} launches per MoE layer** ({moe['triton']} Triton + "
                      f"{moe['torch']} torch ops), {dense['total'] if dense else '-'} per dense layer, {other['total']} "
                      f"outside the layers, {launches['step_total']} in the step.", "",
                      "| scope | Triton kernels | torch ops |", "|---|---|---|"]
            for name, part in (("MoE layer", moe), ("dense layer", dense), ("outside layers", other)):
                if part:
                    lines.append(f"| {name} | " + ", ".join(f"{k} x{v}" for k, v in part["triton_kernels"].items())
                                 + " | " + ", ".join(f"{k} x{v}" for k, v in part["torch_ops"].items()) + " |")
    if measurements:
        lines += ["", f"## Measured on {measured_on} (--measure)", "",
                  "Medians of triton.testing.do_bench (L2 flushed between runs) on random inputs of the same shapes.", "",
                  "| model | op | shape | time us | minimum bytes / time | of the H200's 4.8 TB/s |", "|---|---|---|---|---|---|"]
        for m in measurements:
            if m.seconds is None:
                lines.append(f"| {m.case.model} | {m.case.op} | {m.case.shape} | error: {m.error} | | |")
                continue
            tr = traffic.get(m.case.label)
            rate = tr[1].minimum / m.seconds if tr else None
            lines.append(f"| {m.case.model} | {m.case.op} | {m.case.shape} | {m.seconds * 1e6:.1f} | "
                         + (f"{rate / 1e9:.0f} GB/s | {rate / TARGETS['sm_90'].bandwidth:.0%} |" if rate else " | |"))
    if loaded:
        lines += ["", "## Kernels the driver loaded (--measure)", "", "| kernel | regs | spills | shared B | warps |",
                  "|---|---|---|---|---|", *loaded]
    return "\n".join(lines) + "\n"


def count_launches(timeout_s: float = 600.0) -> dict[str, Any]:
    """benchmarks/launch_count.py's decode-step count, in a process of its own (it needs Triton's interpreter where
    this one compiles only); its error in place of the count when it fails."""
    import subprocess

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "launch_count.py")], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    if proc.returncode != 0:
        return {"error": proc.stderr[-800:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(records: list[dict[str, Any]], launches: dict[str, Any] | None) -> dict[str, Any]:
    """Per target: the decode-path kernels' lowest issue-bound fraction and the mma kinds seen; and the decode step's
    launches per MoE layer (Triton + torch ops, each listed) with the whole count."""
    out: dict[str, Any] = {"launches_per_moe_layer": (launches or {}).get("launches_per_moe_layer"),
                           "launch_count": launches}
    for target in sorted({r["target"] for r in records}):
        mine = [r for r in records if r["target"] == target and r["decode_path"] and r.get("issue_bound_fraction") is not None]
        worst = min(mine, key=lambda r: r["issue_bound_fraction"], default=None)
        out[target] = {"min_decode_issue_bound_fraction": worst and worst["issue_bound_fraction"],
                       "min_at": worst and f"{worst['kernel']} {worst['shape']}",
                       "mma": sorted({r["mma"] for r in mine if r.get("mma")})}
    return out


def describe_device(measure: bool, gpu_name: str | None) -> tuple[str, str]:
    """What produced the report, for its heading, and the same as a file-name part: ahead-of-time compiles alone, or
    with timings on a GPU (named), or with timings through Triton's interpreter on a CPU (a check of the script)."""
    if not measure:
        return ("CPU ahead-of-time compile, no GPU" if gpu_name is None else
                f"CPU ahead-of-time compile on a {gpu_name} machine, nothing run on the GPU"), "cpu_aot"
    if gpu_name is None:
        return "CPU, Triton's interpreter, no GPU (a check of the script: its timings mean nothing)", "cpu_interpreted"
    slug = re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_")
    return f"{gpu_name}, timed with --measure; registers also from a CPU ahead-of-time compile", slug


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="sm_90,sm_100", help="comma-separated: sm_90, sm_100")
    parser.add_argument("--only", default=None, help="regex over case labels ('model op shape')")
    parser.add_argument("--json", action="store_true", help="print the records as a JSON list on the last line")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="folder of the markdown report")
    parser.add_argument("--no-write", action="store_true", help="do not write the markdown report")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--tag", default="", help="appended to the report's file name (a partial report beside the full one)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                        / "reasoning_engine" / "kernel_report")
    parser.add_argument("--measure", action="store_true", help="also time the decode ops on the GPU (see above)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget of --measure")
    parser.add_argument("--no-launch-count", action="store_true",
                        help="leave launches_per_moe_layer out of the --json summary (it runs a decode step)")
    args = parser.parse_args(argv)

    import torch

    gpu = torch.cuda.is_available()
    interpret = args.measure and not gpu
    # before reasoning_engine.kernels imports triton: compile-only without a GPU, or the interpreter for a CPU --measure
    if gpu:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    # as in the compiling workers: Triton keys its on-disk cache by this variable too, so with it set alike the
    # kernels --measure launches here are the ones those workers compiled, not compiled again one by one
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    targets = [TARGETS[t] for t in args.targets.split(",")]
    cases = [c for c in all_cases() if args.only is None or re.search(args.only, c.label)]
    if not cases:
        parser.error(f"no case matches --only {args.only!r}")

    records: list[dict[str, Any]] = []
    rows: list[Row] = []
    traffic: dict[str, tuple[Case, Traffic]] = {}
    if not interpret:
        captured: list[tuple[Case, Launch]] = []
        for case in cases:
            launches: list[Launch] = []
            run, model_traffic = case.build("meta")
            with recording_launches(launches):
                run()
            captured += [(case, launch) for launch in launches]
            if model_traffic is not None:
                traffic[case.label] = (case, model_traffic(launches))
        jobs = [(case, launch, target, compile_job(launch, target)) for case, launch in captured for target in targets]
        results = compile_all([job for *_, job in jobs], args.cache_dir, max(1, args.jobs))
        for case, launch, target, job in jobs:
            row = Row(case, launch, target, job, results[job.key()])
            rows.append(row)
            records.append(row.record())

    measurements: list[Measurement] = []
    loaded: list[str] = []
    measured_on = ""
    if args.measure:
        measured_on = torch.cuda.get_device_name() if gpu else "CPU through Triton's interpreter (a check of the script)"
    device, slug = describe_device(args.measure, torch.cuda.get_device_name() if gpu else None)
    command = "python benchmarks/kernel_report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    path = args.out / f"kernel_report_{slug}_{args.date}{'_' + args.tag if args.tag else ''}.md"

    def write_report() -> None:
        """The whole report as it stands, replaced atomically: after the compiles, after every measured shape."""
        from reasoning_engine.adaptive.state import write_atomically

        if args.no_write:
            return
        args.out.mkdir(parents=True, exist_ok=True)
        text = render(records, rows, traffic, measurements, loaded, measured_on, command.strip(), args.date, targets, device,
                      launches)
        write_atomically(path, lambda handle: handle.write(text.encode()))

    launches = None if args.no_launch_count else count_launches()
    write_report()
    if args.measure:
        decode_ops = [c for c in cases if c.decode_path and c.launched]
        decode_ops.sort(key=lambda c: c.op not in MEASURE_FIRST)  # the big ops first, should the budget run out

        def measured(so_far: list[Measurement]) -> None:
            measurements[:] = so_far
            if gpu:
                loaded[:] = loaded_kernels()
            write_report()

        measure(decode_ops, "cuda" if gpu else "cpu", args.budget_s, measured)
    if not args.no_write:
        print(f"wrote {path}", file=sys.stderr)
    failed = [r for r in records if r["decode_path"] and not passes_targets(r)]
    for r in failed:
        print(f"target missed: {r['kernel']} {r['target']} {r['shape']}: {r.get('spill_bytes')} B spill, "
              f"{r.get('shared_bytes')} B shared {r.get('error', '')}", file=sys.stderr)
    if args.json:
        print(json.dumps({"records": records, "summary": summary(records, launches)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
