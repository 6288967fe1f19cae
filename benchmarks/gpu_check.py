"""One-call GPU check for the Triton kernels: run the kernel tests compiled on the GPU, time every kernel against the
torch reference (eager) and against its roofline, time end-to-end decode, and write a markdown table to
benchmarks/results/gpu_check_<date>.md.

    python benchmarks/gpu_check.py [--skip-tests] [--skip-e2e] [--results-dir DIR] [--model-dir DIR]

Roofline of a kernel = max(bytes it must move / measured copy bandwidth, FLOPs / measured bf16 matmul rate), with both
ceilings measured at the start of the run (a large device-to-device copy counting bytes read plus written; an
8192^3 bf16 matmul on random data). Times are medians of CUDA-event timings (`triton.testing.do_bench`). Sized to
finish in under 8 minutes on one H200. Importable without a GPU (nothing runs at import).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python benchmarks/gpu_check.py` from a checkout, without installing

MOONLIGHT_CONFIG: dict[str, Any] = {
    # Moonlight-16B-A3B (moonshotai), the deepseek_v3 architecture Kimi K2 shares, at its published sizes
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 163840,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "torch_dtype": "bfloat16",
}


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float

    def roofline_s(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.copy_bytes_per_s, flops / self.matmul_flops_per_s)


@dataclass
class KernelRow:
    name: str
    shape: str
    triton_s: float | None = None
    torch_s: float | None = None
    nbytes: float = 0.0
    flops: float = 0.0
    agreement: str = ""  # rel. error of Triton vs torch (or matching fraction of token ids)
    error: str = ""


def _bench(fn: Callable[[], Any]) -> float:
    """Median seconds of fn on the current device (warm-up and repeats handled by do_bench, in milliseconds)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> str:
    a64, b64 = a.double(), b.double()
    return f"{float((a64 - b64).norm() / b64.norm().clamp_min(1e-30)):.1e}"


def measure_ceilings(device: str = "cuda") -> Ceilings:
    """Copy bandwidth (bytes read + written per second) over 2 GiB and the bf16 matmul rate at 8192^3, random data."""
    src = torch.randn(512 * 1024 * 1024, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = _bench(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() * src.element_size() / copy_s
    del src, dst
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_s = _bench(lambda: a @ b)
    return Ceilings(copy_bytes_per_s=copy_bw, matmul_flops_per_s=2 * 8192**3 / mm_s)


def run_kernel_tests(timeout_s: int = 300) -> str:
    """The CPU-interpreted kernel suite, compiled for the GPU this time; returns pytest's summary line and failures."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    workers = ["-n", "8"] if _has_module("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider", *workers]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s} s"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FAILED") or " passed" in line or " failed" in line or "error" in line.lower()]
    return "\n".join(lines[-40:]) or proc.stdout[-2000:] + proc.stderr[-2000:]


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ----------------------------------------------------------------------------------------------------- kernel benches


def _paged_batch(context_lens: list[int], query_lens: list[int], block_size: int, device: str):
    """A ForwardBatch over randomly placed cache blocks (sequence b: context_lens[b] cached + query_lens[b] new)."""
    from reasoning_engine.batch import ForwardBatch

    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32, device=device)
    slots, positions, start = [], [], 0
    for b, (ctx, q) in enumerate(zip(context_lens, query_lens)):
        blocks = perm[start : start + need[b]]
        start += need[b]
        tables[b, : need[b]] = blocks
        pos = torch.arange(ctx, ctx + q, device=device)
        slots.append(blocks.long()[pos // block_size] * block_size + pos % block_size)
        positions.append(pos)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device=device)
    batch = ForwardBatch(
        input_ids=torch.zeros(sum(query_lens), dtype=torch.int64, device=device),
        positions=torch.cat(positions), slot_mapping=torch.cat(slots), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, device=device), block_tables=tables, logits_indices=qsl[1:] - 1,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens,
    )
    return batch, num_blocks


def bench_attention(device: str) -> list[KernelRow]:
    from reasoning_engine.kernels import attention, triton_attention

    rows = []
    bf16 = torch.bfloat16
    # MLA decode (absorbed, latent 512 + rope 64), Kimi K2.5's 64 heads: long thinking context at batch 1, batch 64
    for batch_size, ctx in ((1, 32768), (8, 16384), (64, 4096)):
        heads, latent, rope, bs = 64, 512, 64, 64
        row = KernelRow("mla_decode", f"B={batch_size} ctx={ctx} H={heads} L={latent}+{rope}")
        batch, nblocks = _paged_batch([ctx - 1] * batch_size, [1] * batch_size, bs, device)
        kv = torch.randn(nblocks, bs, latent + rope, device=device, dtype=bf16)
        q = torch.randn(batch_size, heads, latent + rope, device=device, dtype=bf16)
        scale = 192**-0.5
        meta = triton_attention.prepare_attention(batch, bs)
        tmeta = attention.prepare_attention(batch, bs)
        out = triton_attention.paged_latent_attention(q, kv, latent, batch, meta, scale)
        ref = attention.paged_latent_attention(q, kv, latent, batch, tmeta, scale)
        row.agreement = _rel(out, ref)
        row.triton_s = _bench(lambda: triton_attention.paged_latent_attention(q, kv, latent, batch, meta, scale))
        row.torch_s = _bench(lambda: attention.paged_latent_attention(q, kv, latent, batch, tmeta, scale))
        row.nbytes = batch_size * ctx * (latent + rope) * 2 + batch_size * heads * (2 * latent + rope) * 2
        row.flops = 2 * batch_size * heads * ctx * (2 * latent + rope)
        rows.append(row)
    # GQA decode (llama-8B-like heads) and causal prefill
    for name, ctx_lens, q_lens in (("gqa_decode", [4095] * 64, [1] * 64), ("gqa_prefill", [0] * 4, [2048] * 4)):
        heads, kv_heads, head_dim, bs = 32, 8, 128, 16
        row = KernelRow(name, f"B={len(q_lens)} q={q_lens[0]} ctx={ctx_lens[0] + q_lens[0]} H={heads}/{kv_heads} D={head_dim}")
        batch, nblocks = _paged_batch(ctx_lens, q_lens, bs, device)
        k = torch.randn(nblocks, bs, kv_heads, head_dim, device=device, dtype=bf16)
        v = torch.randn_like(k)
        q = torch.randn(batch.num_tokens, heads, head_dim, device=device, dtype=bf16)
        meta = triton_attention.prepare_attention(batch, bs)
        tmeta = attention.prepare_attention(batch, bs)
        row.agreement = _rel(triton_attention.paged_attention(q, k, v, batch, meta, 0.088), attention.paged_attention(q, k, v, batch, tmeta, 0.088))
        row.triton_s = _bench(lambda: triton_attention.paged_attention(q, k, v, batch, meta, 0.088))
        row.torch_s = _bench(lambda: attention.paged_attention(q, k, v, batch, tmeta, 0.088))
        row.nbytes = 2 * sum(c + n for c, n in zip(ctx_lens, q_lens)) * kv_heads * head_dim * 2 + 2 * q.numel() * 2
        pairs = sum(n * c + n * (n + 1) / 2 for c, n in zip(ctx_lens, q_lens))
        row.flops = 4 * pairs * heads * head_dim
        rows.append(row)
    # writing the MLA latent of a prefill chunk into the paged cache
    row = KernelRow("write_kv_cache", "T=16384 width=576")
    cache = torch.zeros(16384 // 64 + 8, 64, 576, device=device, dtype=bf16)
    values = torch.randn(16384, 576, device=device, dtype=bf16)
    slots = torch.randperm(cache.shape[0] * 64, device=device)[:16384]
    row.triton_s = _bench(lambda: triton_attention.write_kv_cache(cache, values, slots))
    row.torch_s = _bench(lambda: attention.write_kv_cache(cache, values, slots))
    row.nbytes = 2 * values.numel() * 2 + slots.numel() * 8
    row.agreement = "exact" if torch.equal(cache.view(-1, 576)[slots], values) else "MISMATCH"
    rows.append(row)
    return rows


def _moe_inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, quant: str | None, device: str):
    from reasoning_engine.kernels.fused_moe import MoEQuant

    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device=device)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    ids = ids.to(torch.int32)
    if quant is None:
        w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * hidden**-0.5
        w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) * inter**-0.5
        return x, w13, w2, weights, ids, None, 2.0
    if quant == "w4a16":
        w13 = torch.randint(-(2**31), 2**31 - 1, (experts, 2 * inter, hidden // 8), device=device, dtype=torch.int32)
        w2 = torch.randint(-(2**31), 2**31 - 1, (experts, hidden, inter // 8), device=device, dtype=torch.int32)
        s13 = torch.rand(experts, 2 * inter, hidden // 32, device=device).to(torch.bfloat16) * 0.02
        s2 = torch.rand(experts, hidden, inter // 32, device=device).to(torch.bfloat16) * 0.02
        return x, w13, w2, weights, ids, MoEQuant("w4a16", s13, s2, group_size=32), 0.5 + 2 / 32
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) * 0.1).to(torch.float8_e4m3fn)
    w2 = (torch.randn(experts, hidden, inter, device=device) * 0.1).to(torch.float8_e4m3fn)
    s13 = torch.rand(experts, 2 * math.ceil(inter / 128), math.ceil(hidden / 128), device=device) * 0.01
    s2 = torch.rand(experts, math.ceil(hidden / 128), math.ceil(inter / 128), device=device) * 0.01
    return x, w13, w2, weights, ids, MoEQuant("fp8_block", s13, s2), 1.0 + 4 / 128**2


def bench_moe(device: str) -> list[KernelRow]:
    from reasoning_engine.kernels import fused_moe, triton_moe

    rows = []
    cases = [
        # (label, tokens, experts, top_k, hidden, inter, quant): Moonlight bf16, Kimi K2 INT4 and DeepSeek-V3 FP8 experts
        ("moe_bf16 moonlight", 1, 64, 6, 2048, 1408, None),
        ("moe_bf16 moonlight", 64, 64, 6, 2048, 1408, None),
        ("moe_bf16 moonlight", 2048, 64, 6, 2048, 1408, None),
        ("moe_w4a16 kimi-k2", 1, 64, 8, 7168, 2048, "w4a16"),
        ("moe_w4a16 kimi-k2", 64, 64, 8, 7168, 2048, "w4a16"),
        ("moe_fp8 deepseek-v3", 1, 32, 8, 7168, 2048, "fp8_block"),
        ("moe_fp8 deepseek-v3", 64, 32, 8, 7168, 2048, "fp8_block"),
    ]
    for label, tokens, experts, top_k, hidden, inter, quant in cases:
        row = KernelRow(label, f"T={tokens} E={experts} k={top_k} H={hidden} I={inter}")
        try:
            x, w13, w2, weights, ids, q, bytes_per_weight = _moe_inputs(tokens, experts, top_k, hidden, inter, quant, device)
            out = triton_moe.fused_moe(x, w13, w2, weights, ids, q)
            row.agreement = _rel(out, fused_moe.fused_moe(x, w13, w2, weights, ids, q))
            row.triton_s = _bench(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, q))
            row.torch_s = _bench(lambda: fused_moe.fused_moe(x, w13, w2, weights, ids, q))
            hit = int(ids.unique().numel())
            row.nbytes = hit * 3 * hidden * inter * bytes_per_weight + 2 * tokens * hidden * 2
            row.flops = 2 * tokens * top_k * 3 * hidden * inter
            del x, w13, w2, q
        except Exception as exc:  # one failing case must not hide the others
            row.error = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
        torch.cuda.empty_cache()
    row = KernelRow("noaux_tc_router", "T=4096 E=256 k=8 groups=8/4")
    logits = torch.randn(4096, 256, device=device)
    bias = torch.randn(256, device=device) * 0.1
    args = (logits, bias, 8, 8, 4, True, 2.5)
    ref_w, ref_ids = fused_moe.noaux_tc_router(*args)
    w, ids = triton_moe.noaux_tc_router(*args)
    row.agreement = f"ids {float((ids == ref_ids).float().mean()):.4f} equal, weights {_rel(w, ref_w)}"
    row.triton_s = _bench(lambda: triton_moe.noaux_tc_router(*args))
    row.torch_s = _bench(lambda: fused_moe.noaux_tc_router(*args))
    row.nbytes = logits.numel() * 4 + 4096 * 8 * 8
    rows.append(row)
    row = KernelRow("moe_align_block_size", "T=4096 k=8 E=256 block=64")
    ids = torch.randint(0, 256, (4096, 8), device=device, dtype=torch.int32)
    row.triton_s = _bench(lambda: triton_moe.moe_align_block_size(ids, 256, 64))
    row.torch_s = _bench(lambda: fused_moe.moe_align_block_size(ids, 256, 64))
    same = all(torch.equal(a, b) for a, b in zip(triton_moe.moe_align_block_size(ids, 256, 64), fused_moe.moe_align_block_size(ids, 256, 64)))
    row.agreement = "exact" if same else "MISMATCH"
    row.nbytes = ids.numel() * 4 * 3
    rows.append(row)
    return rows


def bench_elementwise(device: str) -> list[KernelRow]:
    from reasoning_engine.kernels import norm, rotary, triton_norm, triton_rotary

    rows = []
    bf16 = torch.bfloat16
    row = KernelRow("fused_add_rms_norm", "T=16384 H=7168")
    x = torch.randn(16384, 7168, device=device, dtype=bf16)
    r = torch.randn_like(x)
    w = torch.randn(7168, device=device, dtype=bf16)
    row.agreement = _rel(triton_norm.fused_add_rms_norm(x, r, w, 1e-6)[0], norm.fused_add_rms_norm(x, r, w, 1e-6)[0])
    row.triton_s = _bench(lambda: triton_norm.fused_add_rms_norm(x, r, w, 1e-6))
    row.torch_s = _bench(lambda: norm.fused_add_rms_norm(x, r, w, 1e-6))
    row.nbytes = 4 * x.numel() * 2
    rows.append(row)
    del x, r
    row = KernelRow("rotary interleaved", "T=16384 q=128x64 k=1x64")
    tokens = 16384
    angles = torch.arange(8192, device=device)[:, None] * (1e-4 ** (torch.arange(32, device=device) / 32))[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    pos = torch.randint(0, 8192, (tokens,), device=device)
    q = torch.randn(tokens, 128, 64, device=device, dtype=bf16)
    k = torch.randn(tokens, 1, 64, device=device, dtype=bf16)
    row.agreement = _rel(triton_rotary.apply_rotary(pos, q, k, cos, sin, True)[0], rotary.apply_rotary(pos, q, k, cos, sin, True)[0])
    row.triton_s = _bench(lambda: triton_rotary.apply_rotary(pos, q, k, cos, sin, True))
    row.torch_s = _bench(lambda: rotary.apply_rotary(pos, q, k, cos, sin, True))
    row.nbytes = 2 * (q.numel() + k.numel()) * 2 + tokens * 64 * 4
    rows.append(row)
    return rows


def bench_sampling(device: str) -> list[KernelRow]:
    from reasoning_engine.kernels import sampling, triton_sampling

    rows = []
    batch, vocab = 64, 163840
    logits = torch.randn(batch, vocab, device=device) * 3
    temp = torch.full((batch,), 0.7, device=device)
    top_k = torch.full((batch,), 50, dtype=torch.int32, device=device)
    top_p = torch.full((batch,), 0.9, device=device)
    min_p = torch.full((batch,), 0.0, device=device)
    seeds = torch.arange(batch, device=device)
    args = (logits, temp, top_k, top_p, min_p, seeds, seeds)
    row = KernelRow("sample top-k/top-p", f"B={batch} V={vocab}")
    row.agreement = f"{float((triton_sampling.sample(*args) == sampling.sample(*args)).float().mean()):.3f} equal"
    row.triton_s = _bench(lambda: triton_sampling.sample(*args))
    row.torch_s = _bench(lambda: sampling.sample(*args))
    row.nbytes = logits.numel() * 4
    rows.append(row)
    drafts = 4
    row = KernelRow("rejection_sample", f"B={batch} S={drafts} V={vocab}")
    target = torch.softmax(torch.randn(batch, drafts + 1, vocab, device=device), -1)
    q = torch.softmax(torch.randn(batch, drafts, vocab, device=device), -1)
    draft_ids = torch.randint(0, vocab, (batch, drafts), device=device)
    n = torch.full((batch,), drafts, dtype=torch.int32, device=device)
    vargs = (draft_ids, n, q, target, seeds, seeds)
    row.agreement = "exact" if torch.equal(triton_sampling.rejection_sample(*vargs)[0], sampling.rejection_sample(*vargs)[0]) else "MISMATCH"
    row.triton_s = _bench(lambda: triton_sampling.rejection_sample(*vargs))
    row.torch_s = _bench(lambda: sampling.rejection_sample(*vargs))
    row.nbytes = (target.numel() + q.numel()) * 4
    rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------- end to end


def active_weight_bytes_per_token(config: dict[str, Any], expert_bytes_per_param: float, dense_bytes_per_param: float = 2.0) -> float:
    """Bytes of weights one decode token must read: embeddings row, attention, dense MLPs, shared and routed experts
    actually chosen (top-k), norms, lm_head. The batch-1 roofline is bandwidth / this."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, nope, rope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    lora = config["kv_lora_rank"]
    q_rank = config.get("q_lora_rank")
    q_proj = h * heads * (nope + rope) if not q_rank else h * q_rank + q_rank * heads * (nope + rope)
    attn = q_proj + h * (lora + rope) + lora * heads * (nope + v) + heads * v * h
    dense_layers = config["first_k_dense_replace"]
    dense_mlp = 3 * h * config["intermediate_size"]
    expert = 3 * h * config["moe_intermediate_size"]
    shared = config["n_shared_experts"] * expert
    routed = config["num_experts_per_tok"] * expert
    moe_layers = layers - dense_layers
    dense_params = h + layers * attn + dense_layers * dense_mlp + moe_layers * (shared + h * config["n_routed_experts"]) + config["vocab_size"] * h
    return dense_params * dense_bytes_per_param + moe_layers * routed * expert_bytes_per_param


def write_random_checkpoint(path: Path, config: dict[str, Any], quant: str | None = None, device: str = "cuda") -> None:
    """A random-weight deepseek_v3 checkpoint in the published tensor naming (per-expert linears), one safetensors
    file per layer. quant "w4a16" stores routed experts in Kimi's compressed-tensors pack-quantized INT4 layout."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    if quant == "w4a16":
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"format": "pack-quantized", "targets": ["Linear"],
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*mlp\\.gate$"],
        }
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    h, bf16 = cfg["hidden_size"], torch.bfloat16
    heads, nope, rope, v, lora = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]

    def dense(out_ch: int, in_ch: int) -> torch.Tensor:
        return (torch.randn(out_ch, in_ch, device=device) * in_ch**-0.5).to(bf16).cpu()

    def linear(prefix: str, out_ch: int, in_ch: int, int4: bool) -> dict[str, torch.Tensor]:
        if not int4:
            return {f"{prefix}.weight": dense(out_ch, in_ch)}
        return {
            f"{prefix}.weight_packed": torch.randint(-(2**31), 2**31 - 1, (out_ch, in_ch // 8), dtype=torch.int32, device=device).cpu(),
            f"{prefix}.weight_scale": (torch.rand(out_ch, in_ch // 32, device=device) * 0.4 * in_ch**-0.5).to(bf16).cpu(),
            f"{prefix}.weight_shape": torch.tensor([out_ch, in_ch], dtype=torch.int32),
        }

    ones = lambda n: torch.ones(n, dtype=bf16)
    index: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        save_file(tensors, str(path / name))
        index.update({key: name for key in tensors})

    save({"model.embed_tokens.weight": dense(cfg["vocab_size"], h), "model.norm.weight": ones(h), "lm_head.weight": dense(cfg["vocab_size"], h)}, "embed.safetensors")
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        t = {f"{p}.input_layernorm.weight": ones(h), f"{p}.post_attention_layernorm.weight": ones(h),
             f"{p}.self_attn.kv_a_layernorm.weight": ones(lora)}
        t.update(linear(f"{p}.self_attn.q_proj", heads * (nope + rope), h, False))
        t.update(linear(f"{p}.self_attn.kv_a_proj_with_mqa", lora + rope, h, False))
        t.update(linear(f"{p}.self_attn.kv_b_proj", heads * (nope + v), lora, False))
        t.update(linear(f"{p}.self_attn.o_proj", h, heads * v, False))
        if layer < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            for name, (o, i) in {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}.items():
                t.update(linear(f"{p}.mlp.{name}", o, i, False))
        else:
            inter = cfg["moe_intermediate_size"]
            t[f"{p}.mlp.gate.weight"] = dense(cfg["n_routed_experts"], h)
            t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(cfg["n_routed_experts"], dtype=torch.float32)
            shapes = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
            for e in range(cfg["n_routed_experts"]):
                for name, (o, i) in shapes.items():
                    t.update(linear(f"{p}.mlp.experts.{e}.{name}", o, i, quant == "w4a16"))
            for name, (o, i) in shapes.items():
                o, i = (o * cfg["n_shared_experts"], i) if name != "down_proj" else (o, i * cfg["n_shared_experts"])
                t.update(linear(f"{p}.mlp.shared_experts.{name}", o, i, False))
        save(t, f"layer-{layer:03d}.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_end_to_end(
    model_dir: str | os.PathLike,
    batch_sizes: tuple[int, ...] = (1, 8, 64),
    prompt_len: int = 32,
    output_len: int = 64,
    kernel_backend: str = "triton",
    dtype: str = "bfloat16",
    **llm_kwargs: Any,
) -> list[dict[str, Any]]:
    """Decode tokens/s of `reasoning_engine.LLM(model_dir, dtype=dtype, kernel_backend=...)` at each batch size:
    (time of a run generating output_len tokens - time of a run generating 1) over batch * (output_len - 1), so the
    prefill and request setup cancel. Prompts are random token ids; EOS is ignored. Extra keyword arguments go to LLM
    (e.g. a switch for CUDA graphs)."""
    from reasoning_engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, kernel_backend=kernel_backend, **llm_kwargs)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    results = []
    for batch in batch_sizes:
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (prompt_len,)).tolist()} for _ in range(batch)]

        def timed(max_tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            _sync()
            start = time.perf_counter()
            llm.generate(prompts, params)
            _sync()
            return time.perf_counter() - start

        timed(4)  # warm-up: compilation, graph capture, allocator
        decode_s = timed(output_len) - timed(1)
        results.append({"batch": batch, "decode_tok_per_s": batch * (output_len - 1) / decode_s, "step_ms": 1e3 * decode_s / (output_len - 1)})
    del llm
    torch.cuda.empty_cache()
    return results


def bench_transformers_generate(model_dir: str | os.PathLike, prompt_len: int = 32, output_len: int = 32) -> float:
    """Batch-1 decode tokens/s of transformers' generate on the same checkpoint (the comparison the issue sets)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, device_map="cuda")
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), device="cuda")

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(2)
    rate = (output_len - 1) / (timed(output_len) - timed(1))
    del model
    torch.cuda.empty_cache()
    return rate


def run_end_to_end(ceil: Ceilings, model_dir: str | None, work: Path, num_layers: int) -> list[str]:
    """Markdown lines: bf16 and INT4-expert models, with CUDA graphs (engine default) and without (enforce_eager)."""
    lines = ["| model | CUDA graphs | batch | decode tok/s | step ms | batch-1 roofline tok/s | % of roofline |", "|---|---|---|---|---|---|---|"]
    variants = [("bf16", None), ("int4 experts", "w4a16")] if model_dir is None else [("given", None)]
    hf_rate = None
    for label, quant in variants:
        path = Path(model_dir) if model_dir else work / f"moonlight-{label.replace(' ', '-')}"
        if model_dir is None:
            write_random_checkpoint(path, dict(MOONLIGHT_CONFIG, num_hidden_layers=num_layers), quant)
        config = json.loads((path / "config.json").read_text())
        roof = ceil.copy_bytes_per_s / active_weight_bytes_per_token(config, 0.5 + 2 / 32 if quant else 2.0)
        for graphs, kwargs in (("on", {}), ("off", {"enforce_eager": True})):
            try:
                for r in bench_end_to_end(path, **kwargs):
                    pct = f"{100 * r['decode_tok_per_s'] / roof:.0f}%" if r["batch"] == 1 else ""
                    lines.append(f"| {label} | {graphs} | {r['batch']} | {r['decode_tok_per_s']:.1f} | {r['step_ms']:.2f} | {roof:.0f} | {pct} |")
            except Exception as exc:
                lines.append(f"| {label} | {graphs} | - | not run: {type(exc).__name__}: {str(exc)[:150]} | | | |")
        if quant is None:
            try:
                hf_rate = bench_transformers_generate(path)
            except Exception as exc:
                lines.append(f"\ntransformers generate baseline not run: {type(exc).__name__}: {str(exc)[:200]}")
        if model_dir is None:
            shutil.rmtree(path)  # ~32 GB in bf16: free the disk before the next variant
    if hf_rate is not None:
        lines.append(f"\ntransformers generate (bf16, batch 1): {hf_rate:.1f} tok/s")
    return lines


# ------------------------------------------------------------------------------------------------------------ report


def _fmt_us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.1f}"


def kernel_table(rows: list[KernelRow], ceil: Ceilings) -> list[str]:
    lines = [
        "| kernel | shape | Triton µs | torch eager µs | speedup | roofline µs | % of roofline | bound | Triton vs torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error or r.triton_s is None:
            lines.append(f"| {r.name} | {r.shape} | error: {r.error} | | | | | | |")
            continue
        roof = ceil.roofline_s(r.nbytes, r.flops)
        bound = "memory" if r.nbytes / ceil.copy_bytes_per_s >= r.flops / ceil.matmul_flops_per_s else "compute"
        speedup = f"{r.torch_s / r.triton_s:.1f}x" if r.torch_s else ""
        lines.append(
            f"| {r.name} | {r.shape} | {_fmt_us(r.triton_s)} | {_fmt_us(r.torch_s)} | {speedup} | {_fmt_us(roof)} | "
            f"{100 * roof / r.triton_s:.0f}% | {bound} | {r.agreement} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tests", action="store_true", help="do not run tests/kernels on the GPU")
    parser.add_argument("--skip-e2e", action="store_true", help="do not time end-to-end decode")
    parser.add_argument("--model-dir", default=None, help="time this checkpoint end to end instead of random Moonlight-shaped ones")
    parser.add_argument("--e2e-layers", type=int, default=MOONLIGHT_CONFIG["num_hidden_layers"],
                        help="layers of the random Moonlight-shaped models (fewer: less checkpoint writing and loading)")
    parser.add_argument("--results-dir", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    device = "cuda"
    started = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    today = datetime.date.today().isoformat()
    report = [
        f"# GPU check {today}",
        "",
        f"- device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB",
        f"- torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}",
    ]
    ceil = measure_ceilings(device)
    report += [
        f"- measured copy bandwidth: {ceil.copy_bytes_per_s / 1e12:.2f} TB/s (read + write); bf16 matmul 8192^3: {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
        "",
    ]
    if not args.skip_tests:
        report += ["## Kernel tests (compiled)", "", "```", run_kernel_tests(), "```", ""]
    rows: list[KernelRow] = []
    for section in (bench_attention, bench_moe, bench_elementwise, bench_sampling):
        try:
            rows += section(device)
        except Exception as exc:
            rows.append(KernelRow(section.__name__, "", error=f"{type(exc).__name__}: {exc}"[:200]))
        torch.cuda.empty_cache()
    report += ["## Kernels (bf16 unless noted)", "", *kernel_table(rows, ceil), ""]
    if not args.skip_e2e:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                report += ["## End-to-end decode (random Moonlight-16B-A3B-shaped deepseek_v3)", "", *run_end_to_end(ceil, args.model_dir, Path(tmp), args.e2e_layers), ""]
            except Exception as exc:
                report += ["## End-to-end decode", "", f"not run: {type(exc).__name__}: {str(exc)[:300]}", ""]
    report.append(f"total wall time {time.perf_counter() - started:.0f} s")
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / f"gpu_check_{today}.md"
    out_file.write_text("\n".join(report) + "\n")
    print("\n".join(report))
    print(f"\nwrote {out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
