"""One-call GPU check: end-to-end decode tokens/s of a random-weight Moonlight-16B-A3B-shaped deepseek_v3 (bf16 and
INT4 experts, CUDA graphs on and off) against its roofline and transformers' generate, every Triton kernel timed
against its torch reference and its roofline, end-to-end greedy parity on the GPU, the adaptive engine against static
speculation settings, and (without --skip-tests) the kernel tests compiled for the GPU. Writes a markdown report to
benchmarks/results/gpu_check_<date>.md, rewritten (atomically) after every row measured, so a run killed at its time
limit keeps everything it measured; SIGTERM records which section it stopped.

    python benchmarks/gpu_check.py [--budget-s 330] [--dry-run] [--skip-tests] [--skip-e2e] [--results-dir DIR]
                                   [--tensor-parallel-size N]

Roofline of a kernel = max(bytes it must move / measured copy bandwidth, FLOPs / measured bf16 matmul rate), both
ceilings measured first (a 2 GiB device-to-device copy counting bytes read plus written; an 8192^3 bf16 matmul on
random data). Kernel times are medians of `triton.testing.do_bench`. Models use `load_format="dummy"` (random weights
made on the device from config.json alone), so nothing is written to disk but config files.

Order (`run_steps`), the numbers that matter first, each section in try/except and skipped once `--budget-s` is spent:
1. ceilings; with the kernel tests, they start now (pytest-xdist workers, compiled, TRITON_INTERPRET unset) beside
   the greedy parity check (neither is timed; both mostly compile on CPU cores) and are joined before any timing;
2. end-to-end bf16 decode, CUDA graphs on, batch 1 first (the >= 60% of roofline target), within its own cap so a
   slow build cannot starve the rest; 3. transformers' generate at batch 1 (the >= 5x target);
4. kernel timing; 5. end-to-end greedy parity on a 2-layer model (Triton with graphs, Triton eager, torch; bf16 and
   INT4), unless it ran beside the tests;
6. the adaptive engine against static k=0, k=4 and the static default (suffix speculation) on the bundled model at
   1, 16 and 32 requests (targets: >= 1.15x the default at 16 and more, >= 0.95x the best static);
7. end-to-end bf16 with graphs off, INT4 experts (graphs on, off); 8. with --tensor-parallel-size N (N GPUs): greedy
   parity of TP=N and TP=N + EP against one GPU on a saved random checkpoint, and TP=N decode tok/s.
Sections run in a spawned worker process: one that crashes, hangs past the budget or leaves the CUDA context broken
(an illegal address poisons it for the process) costs that section only, and the rows it wrote before are kept; the
next runs in a fresh worker.

`--dry-run` runs the same logic on CPU with tiny shapes (Triton interpreted, perf_counter timing) to check the script
itself before spending GPU time.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
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
# The parity model: Moonlight's attention and expert sizes (so its compiled kernels serve the big runs too), 2 layers,
# 8 experts, a smaller vocabulary.
CHECK_CONFIG = dict(MOONLIGHT_CONFIG, num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2, vocab_size=32768,
                    bos_token_id=0, eos_token_id=1)
# The dry run's model, for both the parity check and the decode timing.
TINY_CONFIG = dict(MOONLIGHT_CONFIG, vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                   num_experts_per_tok=2, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                   max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
# Kimi K2's compressed-tensors layout: routed experts pack-quantized INT4, symmetric, one bf16 scale per 32 inputs.
INT4_QUANT_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"format": "pack-quantized", "targets": ["Linear"],
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*mlp\\.gate$"],
}
INT4_BYTES_PER_PARAM = 0.5 + 2 / 32  # a nibble plus its share of the bf16 group scale
BANDWIDTH_TARGET = 0.70  # MLA decode attention and W4A16 fused MoE at batch 1, of the measured copy bandwidth
DECODE_ROOFLINE_TARGET = 0.60  # batch-1 decode, of (active weight bytes per token / bandwidth)
HF_SPEEDUP_TARGET = 5.0  # our batch-1 decode over transformers' generate


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the GPU's, or the dry run's tiny ones on CPU."""

    dry: bool
    device: str
    e2e_config: dict[str, Any]
    check_config: dict[str, Any]
    batch_sizes: tuple[int, ...]
    prompt_len: int
    output_len: int
    hf_output_len: int
    max_model_len: int
    test_paths: tuple[str, ...]
    test_workers: int
    test_timeout_s: float
    adaptive_levels: tuple[int, ...]  # concurrencies of the adaptive-vs-static section
    adaptive_max_tokens: int

    @staticmethod
    def make(dry: bool) -> Plan:
        if dry:
            return Plan(dry=True, device="cpu", e2e_config=TINY_CONFIG, check_config=TINY_CONFIG, batch_sizes=(1, 2),
                        prompt_len=8, output_len=4, hf_output_len=4, max_model_len=64,
                        test_paths=("tests/kernels/test_triton_norm.py",), test_workers=2, test_timeout_s=240.0,
                        adaptive_levels=(1, 4), adaptive_max_tokens=24)
        return Plan(dry=False, device="cuda", e2e_config=MOONLIGHT_CONFIG, check_config=CHECK_CONFIG, batch_sizes=(1, 8, 64),
                    prompt_len=32, output_len=64, hf_output_len=16, max_model_len=1024,
                    test_paths=("tests/kernels",), test_workers=8, test_timeout_s=120.0,
                    adaptive_levels=(1, 16, 32), adaptive_max_tokens=160)


class Budget:
    """Wall-clock budget of the whole run (epoch time, so it reads the same in the section worker process)."""

    def __init__(self, seconds: float) -> None:
        self.start = time.time()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.time() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


# ------------------------------------------------------------------------------------------------------------ report


def _err(exc: BaseException) -> str:
    """One markdown-table-safe line naming the exception."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "\\|")
    return text[:300]


class Report:
    """The markdown report: header, targets, a status line per section, then each section's tables. Written to disk
    (atomically) after every row a section measures, so a run killed at its time limit keeps all it measured; in the
    section worker, `on_write` also hands each version to the orchestrating process."""

    def __init__(self, path: Path, header: list[str]) -> None:
        self.path = path
        self.header = header
        self.targets: list[tuple[str, str, str]] = []
        self.statuses: list[tuple[str, str, float]] = []
        self.body: dict[str, list[str]] = {}
        self.on_write: Callable[[Report], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "on_write": None}  # the hook stays in the process that set it

    def add(self, title: str, lines: list[str]) -> None:
        self.body.setdefault(title, []).extend(lines)

    def replace(self, title: str, lines: list[str]) -> None:
        """A section's whole body, for tables recomputed as results come in (medians over rounds)."""
        self.body[title] = list(lines)

    def target(self, name: str, measured: str, ok: bool | None) -> None:
        """Record a target's result; a later result for the same target replaces the earlier one."""
        entry = (name, measured, "n/a" if ok is None else "PASS" if ok else "FAIL")
        for i, (existing, _, _) in enumerate(self.targets):
            if existing == name:
                self.targets[i] = entry
                return
        self.targets.append(entry)

    def status(self, section: str, status: str, seconds: float) -> None:
        self.statuses.append((section, status, seconds))

    def render(self) -> str:
        lines = [*self.header, "", "## Targets", "", "| target | measured | result |", "|---|---|---|"]
        lines += [f"| {n} | {m} | {r} |" for n, m, r in self.targets] or ["| (none measured yet) | | |"]
        lines += ["", "## Sections", "", "| section | status | s |", "|---|---|---|"]
        lines += [f"| {n} | {s} | {t:.0f} |" for n, s, t in self.statuses]
        for title, body in self.body.items():
            lines += ["", f"## {title}", "", *body]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        from reasoning_engine.adaptive.state import write_atomically

        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = self.render().encode()
        write_atomically(self.path, lambda handle: handle.write(text))  # a kill mid-write leaves the last version whole
        if self.on_write is not None:
            self.on_write(self)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()  # a no-op where CUDA was never initialised


def run_section(report: Report, budget: Budget, name: str, min_s: float, fn: Callable[[], None]) -> None:
    """Run fn unless less than min_s of the budget is left; record ok / error / skipped and rewrite the report."""
    if budget.left() < min_s:
        print(f"[{budget.elapsed():4.0f} s] {name}: skipped (time budget)", flush=True)
        report.status(name, "skipped: time budget", 0.0)
        report.write()
        return
    print(f"[{budget.elapsed():4.0f} s] {name} ...", flush=True)
    start = time.perf_counter()
    try:
        fn()
        status = "ok"
    except Exception as exc:  # a section's failure is a result, not the end of the run
        traceback.print_exc()
        status = f"error: {_err(exc)}"
    free_memory()  # after the except block, so the traceback no longer holds the section's tensors
    report.status(name, status, time.perf_counter() - start)
    report.write()


# --------------------------------------------------------------------------------------------------------- ceilings


@dataclass
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float

    def roofline_s(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.copy_bytes_per_s, flops / self.matmul_flops_per_s)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _bench(fn: Callable[[], Any], device: str) -> float:
    """Median seconds of fn: CUDA-event timings by do_bench on the GPU; three perf_counter runs on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_ceilings(plan: Plan) -> Ceilings:
    """Copy bandwidth (bytes read + written per second) and the bf16 matmul rate on random data."""
    numel, n = (512 * 2**20, 8192) if not plan.dry else (4 * 2**20, 256)
    src = torch.randn(numel, device=plan.device)
    dst = torch.empty_like(src)
    copy_s = _bench(lambda: dst.copy_(src), plan.device)
    del src, dst
    a = torch.randn(n, n, device=plan.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=plan.device, dtype=torch.bfloat16)
    mm_s = _bench(lambda: a @ b, plan.device)
    return Ceilings(copy_bytes_per_s=2 * numel * 4 / copy_s, matmul_flops_per_s=2 * n**3 / mm_s)


# ----------------------------------------------------------------------------------------------------- kernel tests


_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b")
_PROGRESS = re.compile(r"[.FEsxX]+\s*(\[\s*\d+%\])?")


def summarize_pytest(output: str) -> tuple[dict[str, int], list[str]]:
    """Counts from pytest's closing line, or from its progress characters when it never printed one (killed), and
    its FAILED / ERROR lines."""
    lines = output.splitlines()
    closing = [line for line in lines if _COUNT.search(line) and re.search(r" in [\d.]+s", line)]
    counts: dict[str, int] = {}
    if closing:
        for number, kind in _COUNT.findall(closing[-1]):
            counts["error" if kind.startswith("error") else kind] = int(number)
    else:
        progress = "".join(line.split("[")[0].strip() for line in lines if _PROGRESS.fullmatch(line.strip()))
        counts = {kind: progress.count(ch) for kind, ch in (("passed", "."), ("failed", "F"), ("error", "E"), ("skipped", "s"))}
    return counts, [line for line in lines if line.startswith(("FAILED", "ERROR"))]


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class KernelTests:
    """tests/kernels in a pytest subprocess (its own session, so a timeout kills the xdist workers too), compiled for
    the GPU (TRITON_INTERPRET removed; the dry run sets it instead). Started early, joined before any timing."""

    def __init__(self, plan: Plan, log_path: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if plan.dry:
            env["TRITON_INTERPRET"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        workers = ["-n", str(plan.test_workers)] if _has_module("xdist") else []
        # --maxfail rather than -x: one failing test (say the CPU-only engine test) must not hide the others
        self.cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=10", "-o", "timeout=60",
                    *workers, *plan.test_paths]
        self.timeout_s = plan.test_timeout_s
        self.log_path = log_path
        self.started = time.perf_counter()
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def join(self, report: Report, budget: Budget) -> None:
        """Wait out the timeout (or what is left of the budget), then report counts, failures and the target."""
        try:
            self.proc.wait(timeout=max(min(self.timeout_s - (time.perf_counter() - self.started), budget.left()), 0.0))
            timed_out = False
        except subprocess.TimeoutExpired:
            self.kill()
            timed_out = True
        seconds = time.perf_counter() - self.started
        output = self.log_path.read_text(errors="replace")
        counts, failures = summarize_pytest(output)
        summary = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) or "nothing counted"
        outcome = f"killed after {seconds:.0f} s (timeout); progress so far: {summary}" if timed_out else f"{summary} (exit {self.proc.returncode})"
        lines = [f"- command: `{' '.join(self.cmd[1:])}`", f"- {outcome}, {seconds:.0f} s"]
        if failures:
            lines += ["", "```", *failures[:20], "```"]
        elif not counts.get("passed"):
            lines += ["", "```", *output.splitlines()[-15:], "```"]
        report.add("Kernel tests (compiled)", lines)
        ok = not timed_out and counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error")
        report.target("kernel tests pass on the device", outcome, ok)


# ---------------------------------------------------------------------------------------------------- kernel timing


@dataclass
class KernelRow:
    name: str
    shape: str
    triton_s: float | None = None
    torch_s: float | None = None
    nbytes: float = 0.0
    flops: float = 0.0
    agreement: str = ""  # rel. error of Triton vs torch (or matching fraction of token ids)
    target: float | None = None  # required fraction of the copy bandwidth, where one is set
    error: str = ""


def _measure(row: KernelRow, fill: Callable[[KernelRow], None]) -> KernelRow:
    """Fill one row; an exception becomes the row's error so the other cases still run."""
    try:
        fill(row)
    except Exception as exc:
        row.error = _err(exc)
    free_memory()
    return row


def _rel(a: torch.Tensor, b: torch.Tensor) -> str:
    a64, b64 = a.double(), b.double()
    return f"{float((a64 - b64).norm() / b64.norm().clamp_min(1e-30)):.1e}"


def _paged_batch(context_lens: list[int], query_lens: list[int], block_size: int, device: str) -> tuple[Any, int]:
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


def bench_attention(plan: Plan) -> Iterator[KernelRow]:
    from reasoning_engine.kernels import attention, triton_attention

    dev, bf16 = plan.device, torch.bfloat16
    # MLA decode (absorbed, latent 512 + rope 64), Kimi K2.5's 64 heads: long thinking contexts at batch 1, then batches
    heads, latent, rope, bs = (64, 512, 64, 64) if not plan.dry else (4, 64, 16, 16)
    mla_cases = ((1, 32768), (1, 131072), (8, 16384), (64, 4096)) if not plan.dry else ((1, 48), (2, 40))
    for batch_size, ctx in mla_cases:

        def mla(row: KernelRow, batch_size: int = batch_size, ctx: int = ctx) -> None:
            batch, nblocks = _paged_batch([ctx - 1] * batch_size, [1] * batch_size, bs, dev)
            kv = torch.randn(nblocks, bs, latent + rope, device=dev, dtype=bf16)
            q = torch.randn(batch_size, heads, latent + rope, device=dev, dtype=bf16)
            scale = 192**-0.5
            meta, tmeta = triton_attention.prepare_attention(batch, bs), attention.prepare_attention(batch, bs)
            row.agreement = _rel(triton_attention.paged_latent_attention(q, kv, latent, batch, meta, scale),
                                 attention.paged_latent_attention(q, kv, latent, batch, tmeta, scale))
            row.triton_s = _bench(lambda: triton_attention.paged_latent_attention(q, kv, latent, batch, meta, scale), dev)
            row.torch_s = _bench(lambda: attention.paged_latent_attention(q, kv, latent, batch, tmeta, scale), dev)
            row.nbytes = batch_size * ctx * (latent + rope) * 2 + batch_size * heads * (2 * latent + rope) * 2
            row.flops = 2 * batch_size * heads * ctx * (2 * latent + rope)

        target = BANDWIDTH_TARGET if batch_size == 1 else None
        yield _measure(KernelRow("mla_decode", f"B={batch_size} ctx={ctx} H={heads} L={latent}+{rope}", target=target), mla)
    # GQA decode (llama-8B-like heads) and causal prefill
    heads, kv_heads, head_dim, bs = (32, 8, 128, 16) if not plan.dry else (4, 2, 32, 16)
    gqa_cases = ((("gqa_decode", [4095] * 64, [1] * 64), ("gqa_prefill", [0] * 4, [2048] * 4)) if not plan.dry
                 else (("gqa_decode", [39] * 2, [1] * 2), ("gqa_prefill", [0] * 2, [16] * 2)))
    for name, ctx_lens, q_lens in gqa_cases:

        def gqa(row: KernelRow, ctx_lens: list[int] = ctx_lens, q_lens: list[int] = q_lens) -> None:
            batch, nblocks = _paged_batch(ctx_lens, q_lens, bs, dev)
            k = torch.randn(nblocks, bs, kv_heads, head_dim, device=dev, dtype=bf16)
            v = torch.randn_like(k)
            q = torch.randn(batch.num_tokens, heads, head_dim, device=dev, dtype=bf16)
            meta, tmeta = triton_attention.prepare_attention(batch, bs), attention.prepare_attention(batch, bs)
            scale = head_dim**-0.5
            row.agreement = _rel(triton_attention.paged_attention(q, k, v, batch, meta, scale), attention.paged_attention(q, k, v, batch, tmeta, scale))
            row.triton_s = _bench(lambda: triton_attention.paged_attention(q, k, v, batch, meta, scale), dev)
            row.torch_s = _bench(lambda: attention.paged_attention(q, k, v, batch, tmeta, scale), dev)
            row.nbytes = 2 * sum(c + n for c, n in zip(ctx_lens, q_lens)) * kv_heads * head_dim * 2 + 2 * q.numel() * 2
            pairs = sum(n * c + n * (n + 1) / 2 for c, n in zip(ctx_lens, q_lens))
            row.flops = 4 * pairs * heads * head_dim

        shape = f"B={len(q_lens)} q={q_lens[0]} ctx={ctx_lens[0] + q_lens[0]} H={heads}/{kv_heads} D={head_dim}"
        yield _measure(KernelRow(name, shape), gqa)
    yield from _bench_sparse_attention(plan)
    yield from _bench_gpt_oss_attention(plan)
    # writing the MLA latent of a prefill chunk into the paged cache
    tokens, width, bs = (16384, 576, 64) if not plan.dry else (64, 80, 16)

    def write(row: KernelRow) -> None:
        cache = torch.zeros(tokens // bs + 8, bs, width, device=dev, dtype=bf16)
        values = torch.randn(tokens, width, device=dev, dtype=bf16)
        slots = torch.randperm(cache.shape[0] * bs, device=dev)[:tokens]
        row.triton_s = _bench(lambda: triton_attention.write_kv_cache(cache, values, slots), dev)
        written = torch.equal(cache.view(-1, width)[slots], values)
        row.torch_s = _bench(lambda: attention.write_kv_cache(cache, values, slots), dev)
        row.nbytes = 2 * values.numel() * 2 + slots.numel() * 8
        row.agreement = "exact" if written else "MISMATCH"

    yield _measure(KernelRow("write_kv_cache", f"T={tokens} width={width}"), write)


def _bench_gpt_oss_attention(plan: Plan) -> Iterator[KernelRow]:
    """gpt-oss-120b's GQA (64 / 8 heads of 64) with sinks at decode: a sliding layer (window 128) reads only its
    window, a full layer the whole context."""
    from reasoning_engine.kernels import attention, triton_attention

    dev, bf16 = plan.device, torch.bfloat16
    heads, kv_heads, head_dim, bs = (64, 8, 64, 16) if not plan.dry else (4, 2, 32, 16)
    batch_size, ctx = (8, 32768) if not plan.dry else (2, 40)
    for window in ((128, None) if not plan.dry else (8, None)):

        def gqa(row: KernelRow, window: int | None = window) -> None:
            batch, nblocks = _paged_batch([ctx - 1] * batch_size, [1] * batch_size, bs, dev)
            k = torch.randn(nblocks, bs, kv_heads, head_dim, device=dev, dtype=bf16)
            v = torch.randn_like(k)
            q = torch.randn(batch_size, heads, head_dim, device=dev, dtype=bf16)
            sinks = torch.randn(heads, device=dev, dtype=bf16)
            meta, tmeta = triton_attention.prepare_attention(batch, bs), attention.prepare_attention(batch, bs)
            args = (q, k, v, batch)
            row.agreement = _rel(triton_attention.paged_attention(*args, meta, head_dim**-0.5, sinks, window),
                                 attention.paged_attention(*args, tmeta, head_dim**-0.5, sinks, window))
            row.triton_s = _bench(lambda: triton_attention.paged_attention(*args, meta, head_dim**-0.5, sinks, window), dev)
            row.torch_s = _bench(lambda: attention.paged_attention(*args, tmeta, head_dim**-0.5, sinks, window), dev)
            span = min(ctx, window or ctx)
            row.nbytes = 2 * batch_size * span * kv_heads * head_dim * 2 + 2 * q.numel() * 2
            row.flops = 4 * batch_size * span * heads * head_dim

        shape = f"B={batch_size} ctx={ctx} H={heads}/{kv_heads} D={head_dim} {'window ' + str(window) if window else 'full'}"
        yield _measure(KernelRow("gqa_sinks_decode gpt-oss", shape), gqa)


def _bench_sparse_attention(plan: Plan) -> Iterator[KernelRow]:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) at decode: the lightning indexer's scores over the whole
    context (64 index heads of 128 channels) and MLA over each query's 2,048 selected tokens (64 heads)."""
    from reasoning_engine.kernels import attention, sparse_attention, triton_attention, triton_sparse_attention

    dev, bf16 = plan.device, torch.bfloat16
    index_heads, index_dim, topk, heads, latent, rope, bs = ((64, 128, 2048, 64, 512, 64, 64) if not plan.dry
                                                             else (8, 32, 16, 4, 64, 16, 16))
    for batch_size, ctx in ((1, 131072), (8, 32768)) if not plan.dry else ((1, 48), (2, 40)):
        batch, nblocks = _paged_batch([ctx - 1] * batch_size, [1] * batch_size, bs, dev)
        keys = torch.randn(nblocks, bs, index_dim, device=dev, dtype=bf16)
        q_index = torch.randn(batch_size, index_heads, index_dim, device=dev, dtype=bf16)
        weights = torch.randn(batch_size, index_heads, device=dev)

        def indexer(row: KernelRow, batch=batch, keys=keys, q_index=q_index, weights=weights, ctx=ctx) -> None:
            def run(module):
                return module.indexer_scores(q_index, weights, keys, batch, 0, batch.num_tokens)

            row.agreement = _rel(run(triton_sparse_attention), run(sparse_attention))
            row.triton_s = _bench(lambda: run(triton_sparse_attention), dev)
            row.torch_s = _bench(lambda: run(sparse_attention), dev)
            row.nbytes = batch.num_tokens * ctx * index_dim * 2
            row.flops = 2 * batch.num_tokens * index_heads * ctx * index_dim

        yield _measure(KernelRow("dsa_indexer", f"B={batch_size} ctx={ctx} H={index_heads} D={index_dim}"), indexer)
        kv = torch.randn(nblocks, bs, latent + rope, device=dev, dtype=bf16)
        q = torch.randn(batch_size, heads, latent + rope, device=dev, dtype=bf16)
        selected = torch.stack([torch.randperm(ctx, device=dev)[:topk] for _ in range(batch_size)])

        def sparse_mla(row: KernelRow, batch=batch, kv=kv, q=q, selected=selected) -> None:
            meta, tmeta = triton_attention.prepare_attention(batch, bs), attention.prepare_attention(batch, bs)
            scale = 192**-0.5

            def run_triton():
                return triton_sparse_attention.sparse_latent_attention(q, kv, latent, batch, meta, scale, selected)

            def run_torch():
                return sparse_attention.sparse_latent_attention(q, kv, latent, batch, tmeta, scale, selected)

            row.agreement = _rel(run_triton(), run_torch())
            row.triton_s = _bench(run_triton, dev)
            row.torch_s = _bench(run_torch, dev)
            row.nbytes = batch_size * topk * (latent + rope) * 2 + batch_size * heads * (2 * latent + rope) * 2
            row.flops = 2 * batch_size * heads * topk * (2 * latent + rope)

        yield _measure(KernelRow("dsa_sparse_mla", f"B={batch_size} ctx={ctx} k={topk} H={heads} "
                                                   f"L={latent}+{rope}"), sparse_mla)


def _moe_inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, quant: str | None, device: str) -> tuple[Any, ...]:
    """Activations, routing and expert weights (bf16, W4A16 packed INT4 or block FP8); last: bytes per weight."""
    from reasoning_engine.kernels.fused_moe import MoEQuant

    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    weights, ids = torch.randn(tokens, experts, device=device).softmax(-1).topk(top_k, dim=-1)
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
        return x, w13, w2, weights, ids, MoEQuant("w4a16", s13, s2, group_size=32), INT4_BYTES_PER_PARAM
    if quant == "mxfp4":  # e8m0 scales near 2^-6: weights of the spread the clamped SwiGLU sees
        w13 = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), device=device, dtype=torch.uint8)
        w2 = torch.randint(0, 256, (experts, hidden, inter // 2), device=device, dtype=torch.uint8)
        s13 = torch.randint(119, 123, (experts, 2 * inter, hidden // 32), device=device, dtype=torch.uint8)
        s2 = torch.randint(119, 123, (experts, hidden, inter // 32), device=device, dtype=torch.uint8)
        return x, w13, w2, weights, ids, MoEQuant("mxfp4", s13, s2), 0.5 + 1 / 32
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) * 0.1).to(torch.float8_e4m3fn)
    w2 = (torch.randn(experts, hidden, inter, device=device) * 0.1).to(torch.float8_e4m3fn)
    s13 = torch.rand(experts, 2 * math.ceil(inter / 128), math.ceil(hidden / 128), device=device) * 0.01
    s2 = torch.rand(experts, math.ceil(hidden / 128), math.ceil(inter / 128), device=device) * 0.01
    return x, w13, w2, weights, ids, MoEQuant("fp8_block", s13, s2), 1.0 + 4 / 128**2


def bench_moe(plan: Plan) -> Iterator[KernelRow]:
    from reasoning_engine.kernels import fused_moe, triton_moe

    dev = plan.device
    # (label, tokens, experts, top_k, hidden, inter, quant, bandwidth target)
    cases = [
        ("moe_bf16 moonlight", 1, 64, 6, 2048, 1408, None, None),
        ("moe_bf16 moonlight", 64, 64, 6, 2048, 1408, None, None),
        ("moe_bf16 moonlight", 2048, 64, 6, 2048, 1408, None, None),
        ("moe_w4a16 kimi-k2", 1, 64, 8, 7168, 2048, "w4a16", BANDWIDTH_TARGET),
        ("moe_w4a16 kimi-k2", 64, 64, 8, 7168, 2048, "w4a16", None),
        ("moe_w4a16 moonlight", 1, 64, 6, 2048, 1408, "w4a16", None),  # the e2e INT4 model's shape
        ("moe_fp8 deepseek-v3", 1, 32, 8, 7168, 2048, "fp8_block", None),
        ("moe_fp8 deepseek-v3", 64, 32, 8, 7168, 2048, "fp8_block", None),
    ] if not plan.dry else [
        ("moe_bf16", 1, 4, 2, 64, 64, None, None),
        ("moe_bf16", 8, 4, 2, 64, 64, None, None),
        ("moe_w4a16", 1, 4, 2, 64, 64, "w4a16", BANDWIDTH_TARGET),
        ("moe_fp8", 1, 4, 2, 64, 64, "fp8_block", None),
    ]
    # gpt-oss-120b's experts as shipped: MXFP4, biases, the clamped SwiGLU (hidden = intermediate = 2880, top-4)
    cases += [("moe_mxfp4 gpt-oss-120b", t, 128, 4, 2880, 2880, "mxfp4", None) for t in (1, 64)] if not plan.dry else [
        ("moe_mxfp4", 1, 4, 2, 64, 64, "mxfp4", None)]
    for label, tokens, experts, top_k, hidden, inter, quant, target in cases:

        def moe(row: KernelRow, tokens: int = tokens, experts: int = experts, top_k: int = top_k, hidden: int = hidden,
                inter: int = inter, quant: str | None = quant) -> None:
            x, w13, w2, weights, ids, q, bytes_per_weight = _moe_inputs(tokens, experts, top_k, hidden, inter, quant, dev)
            extra: dict[str, Any] = {}
            if quant == "mxfp4":
                extra = dict(w13_bias=torch.randn(experts, 2 * inter, device=dev, dtype=torch.bfloat16),
                             w2_bias=torch.randn(experts, hidden, device=dev, dtype=torch.bfloat16), swiglu_limit=7.0)
            row.agreement = _rel(triton_moe.fused_moe(x, w13, w2, weights, ids, q, **extra),
                                 fused_moe.fused_moe(x, w13, w2, weights, ids, q, **extra))
            row.triton_s = _bench(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, q, **extra), dev)
            row.torch_s = _bench(lambda: fused_moe.fused_moe(x, w13, w2, weights, ids, q, **extra), dev)
            hit = int(ids.unique().numel())
            row.nbytes = hit * 3 * hidden * inter * bytes_per_weight + 2 * tokens * hidden * 2
            row.flops = 2 * tokens * top_k * 3 * hidden * inter

        yield _measure(KernelRow(label, f"T={tokens} E={experts} k={top_k} H={hidden} I={inter}", target=target), moe)
    tokens, experts, top_k, groups, topk_groups = (4096, 256, 8, 8, 4) if not plan.dry else (8, 16, 4, 4, 2)

    def router(row: KernelRow) -> None:
        logits = torch.randn(tokens, experts, device=dev)
        bias = torch.randn(experts, device=dev) * 0.1
        args = (logits, bias, top_k, groups, topk_groups, True, 2.5)
        ref_w, ref_ids = fused_moe.noaux_tc_router(*args)
        w, ids = triton_moe.noaux_tc_router(*args)
        row.agreement = f"ids {float((ids == ref_ids).float().mean()):.4f} equal, weights {_rel(w, ref_w)}"
        row.triton_s = _bench(lambda: triton_moe.noaux_tc_router(*args), dev)
        row.torch_s = _bench(lambda: fused_moe.noaux_tc_router(*args), dev)
        row.nbytes = logits.numel() * 4 + tokens * top_k * 8

    yield _measure(KernelRow("noaux_tc_router", f"T={tokens} E={experts} k={top_k} groups={groups}/{topk_groups}"), router)
    block = 64 if not plan.dry else 16

    def align(row: KernelRow) -> None:
        ids = torch.randint(0, experts, (tokens, top_k), device=dev, dtype=torch.int32)
        row.triton_s = _bench(lambda: triton_moe.moe_align_block_size(ids, experts, block), dev)
        row.torch_s = _bench(lambda: fused_moe.moe_align_block_size(ids, experts, block), dev)
        pairs = zip(triton_moe.moe_align_block_size(ids, experts, block), fused_moe.moe_align_block_size(ids, experts, block))
        row.agreement = "exact" if all(torch.equal(a, b) for a, b in pairs) else "MISMATCH"
        row.nbytes = ids.numel() * 4 * 3

    yield _measure(KernelRow("moe_align_block_size", f"T={tokens} k={top_k} E={experts} block={block}"), align)


def bench_elementwise(plan: Plan) -> Iterator[KernelRow]:
    from reasoning_engine.kernels import norm, rotary, triton_norm, triton_rotary

    dev, bf16 = plan.device, torch.bfloat16
    tokens, hidden = (16384, 7168) if not plan.dry else (8, 64)

    def rms(row: KernelRow) -> None:
        x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
        r = torch.randn_like(x)
        w = torch.randn(hidden, device=dev, dtype=bf16)
        row.agreement = _rel(triton_norm.fused_add_rms_norm(x, r, w, 1e-6)[0], norm.fused_add_rms_norm(x, r, w, 1e-6)[0])
        row.triton_s = _bench(lambda: triton_norm.fused_add_rms_norm(x, r, w, 1e-6), dev)
        row.torch_s = _bench(lambda: norm.fused_add_rms_norm(x, r, w, 1e-6), dev)
        row.nbytes = 4 * x.numel() * 2

    tokens_r, heads, dim, max_pos = (16384, 128, 64, 8192) if not plan.dry else (8, 4, 16, 64)

    def rope(row: KernelRow) -> None:
        half = dim // 2
        angles = torch.arange(max_pos, device=dev)[:, None] * (1e-4 ** (torch.arange(half, device=dev) / half))[None, :]
        cos, sin = angles.cos().float(), angles.sin().float()
        pos = torch.randint(0, max_pos, (tokens_r,), device=dev)
        q = torch.randn(tokens_r, heads, dim, device=dev, dtype=bf16)
        k = torch.randn(tokens_r, 1, dim, device=dev, dtype=bf16)
        row.agreement = _rel(triton_rotary.apply_rotary(pos, q, k, cos, sin, True)[0], rotary.apply_rotary(pos, q, k, cos, sin, True)[0])
        row.triton_s = _bench(lambda: triton_rotary.apply_rotary(pos, q, k, cos, sin, True), dev)
        row.torch_s = _bench(lambda: rotary.apply_rotary(pos, q, k, cos, sin, True), dev)
        row.nbytes = 2 * (q.numel() + k.numel()) * 2 + tokens_r * dim * 4

    yield _measure(KernelRow("fused_add_rms_norm", f"T={tokens} H={hidden}"), rms)
    yield _measure(KernelRow("rotary interleaved", f"T={tokens_r} q={heads}x{dim} k=1x{dim}"), rope)


def bench_sampling(plan: Plan) -> Iterator[KernelRow]:
    from reasoning_engine.kernels import sampling, triton_sampling

    dev = plan.device
    batch, vocab, drafts = (64, 163840, 4) if not plan.dry else (2, 256, 2)
    seeds = torch.arange(batch, device=dev)

    def sample(row: KernelRow) -> None:
        logits = torch.randn(batch, vocab, device=dev) * 3
        args = (logits, torch.full((batch,), 0.7, device=dev), torch.full((batch,), 50, dtype=torch.int32, device=dev),
                torch.full((batch,), 0.9, device=dev), torch.full((batch,), 0.0, device=dev), seeds, seeds)
        row.agreement = f"{float((triton_sampling.sample(*args) == sampling.sample(*args)).float().mean()):.3f} equal"
        row.triton_s = _bench(lambda: triton_sampling.sample(*args), dev)
        row.torch_s = _bench(lambda: sampling.sample(*args), dev)
        row.nbytes = logits.numel() * 4

    def reject(row: KernelRow) -> None:
        target = torch.softmax(torch.randn(batch, drafts + 1, vocab, device=dev), -1)
        q = torch.softmax(torch.randn(batch, drafts, vocab, device=dev), -1)
        draft_ids = torch.randint(0, vocab, (batch, drafts), device=dev)
        n = torch.full((batch,), drafts, dtype=torch.int32, device=dev)
        args = (draft_ids, n, q, target, seeds, seeds)
        row.agreement = "exact" if torch.equal(triton_sampling.rejection_sample(*args)[0], sampling.rejection_sample(*args)[0]) else "MISMATCH"
        row.triton_s = _bench(lambda: triton_sampling.rejection_sample(*args), dev)
        row.torch_s = _bench(lambda: sampling.rejection_sample(*args), dev)
        row.nbytes = (target.numel() + q.numel()) * 4

    yield _measure(KernelRow("sample top-k/top-p", f"B={batch} V={vocab}"), sample)
    yield _measure(KernelRow("rejection_sample", f"B={batch} S={drafts} V={vocab}"), reject)


def _fmt_us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.1f}"


KERNEL_TITLE = "Kernels (bf16 unless noted)"
KERNEL_HEADER = [
    "| kernel | shape | Triton µs | torch eager µs | speedup | roofline µs | % of roofline | % of bandwidth | bound | target | Triton vs torch |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]


def kernel_line(r: KernelRow, ceil: Ceilings) -> str:
    """One markdown row; `% of bandwidth` = bytes moved / Triton time / measured copy bandwidth."""
    if r.error or r.triton_s is None:
        return f"| {r.name} | {r.shape} | {r.error or 'not run'} | | | | | | | | |"
    roof = ceil.roofline_s(r.nbytes, r.flops)
    bw = r.nbytes / r.triton_s / ceil.copy_bytes_per_s
    bound = "memory" if r.nbytes / ceil.copy_bytes_per_s >= r.flops / ceil.matmul_flops_per_s else "compute"
    speedup = f"{r.torch_s / r.triton_s:.1f}x" if r.torch_s else ""
    target = "" if r.target is None else f"≥{100 * r.target:.0f}% BW: {'PASS' if bw >= r.target else 'FAIL'}"
    return (f"| {r.name} | {r.shape} | {_fmt_us(r.triton_s)} | {_fmt_us(r.torch_s)} | {speedup} | {_fmt_us(roof)} | "
            f"{100 * roof / r.triton_s:.0f}% | {100 * bw:.0f}% | {bound} | {target} | {r.agreement} |")


def kernel_targets(rows: list[KernelRow], ceil: Ceilings, report: Report) -> None:
    for r in rows:
        if r.target is None:
            continue
        name = f"{r.name} {r.shape} ≥ {100 * r.target:.0f}% of bandwidth"
        if r.error or r.triton_s is None:
            report.target(name, f"not measured: {r.error}", None)
            continue
        bw = r.nbytes / r.triton_s / ceil.copy_bytes_per_s
        report.target(name, f"{100 * bw:.0f}% ({_fmt_us(r.triton_s)} µs)", bw >= r.target)


KERNEL_GROUPS: tuple[Callable[[Plan], Iterator[KernelRow]], ...] = (bench_attention, bench_moe, bench_elementwise, bench_sampling)


def run_kernel_timing(plan: Plan, ceil: Ceilings, budget: Budget, report: Report,
                      groups: tuple[Callable[[Plan], Iterator[KernelRow]], ...] | None = None) -> None:
    """Each group's rows in turn, each row (and its target) written to the report as soon as it is measured; a group
    not reached within the budget gets one 'skipped' row, a group whose setup fails one error row."""
    report.add(KERNEL_TITLE, list(KERNEL_HEADER))

    def emit(row: KernelRow) -> None:
        report.add(KERNEL_TITLE, [kernel_line(row, ceil)])
        kernel_targets([row], ceil, report)
        report.write()

    for group in KERNEL_GROUPS if groups is None else groups:
        if budget.left() < 10:
            emit(KernelRow(group.__name__, "", error="skipped: time budget"))
            continue
        try:
            for row in group(plan):
                emit(row)
                if budget.left() < 10:
                    break
        except Exception as exc:  # an import or setup failure of one group
            emit(KernelRow(group.__name__, "", error=_err(exc)))
        free_memory()
    report.add(KERNEL_TITLE, [""])


# ------------------------------------------------------------------------------------------------------- end to end


def active_weight_bytes_per_token(config: dict[str, Any], expert_bytes_per_param: float, dense_bytes_per_param: float = 2.0) -> float:
    """Bytes of weights one decode token must read: its embedding row, attention, dense MLPs, routers, shared and the
    top-k routed experts, lm_head (norms are negligible). The batch-1 roofline is bandwidth / this."""
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


def write_config(folder: Path, config: dict[str, Any], int4: bool) -> Path:
    """A checkpoint folder holding only config.json (the engine's load_format="dummy" makes the weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config, quantization_config=INT4_QUANT_CONFIG) if int4 else dict(config)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def make_llm(plan: Plan, folder: Path, backend: str, graphs: bool, max_num_seqs: int, **parallel: Any) -> Any:
    from reasoning_engine import LLM

    torch.manual_seed(0)  # the same dummy weights for every backend
    return LLM(str(folder), load_format="dummy", dtype="bfloat16", device=plan.device, kernel_backend=backend,
               enforce_eager=not graphs, max_model_len=plan.max_model_len, max_num_seqs=max_num_seqs, **parallel)


def graph_info(llm: Any) -> str:
    """Which decode batch sizes the runner captured as CUDA graphs and how many steps took that path."""
    runner = getattr(getattr(getattr(llm, "engine", None), "runner", None), "worker", None)
    sizes = getattr(runner, "cuda_graph_batch_sizes", None)
    if sizes is None:
        return "unknown (the runner exposes no cuda_graph_batch_sizes)"
    steps = getattr(getattr(runner, "decode_graphs", None), "num_steps", None)
    return (f"buckets {list(sizes)}" if sizes else "none captured") + (f", {steps} decode steps replayed" if sizes and steps is not None else "")


@dataclass
class Greedy:
    """One sequence's greedy tokens and, per token, the gap between the top two logprobs (how close a tie it was)."""

    tokens: list[int]
    gaps: list[float]


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[Greedy]:
    from reasoning_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    results = []
    for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params):
        completion = out.outputs[0]
        gaps = []
        for step in completion.logprobs or []:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else math.inf)
        results.append(Greedy(list(completion.token_ids), gaps))
    return results


NEAR_TIE = 0.1  # logprob gap (nats) under which bf16 rounding may flip a greedy choice


def compare_tokens(got: list[Greedy], want: list[Greedy], prefix: int) -> tuple[bool, str]:
    """Whether every sequence agrees over its first `prefix` tokens, counting a divergence where the reference's top
    two logprobs were within NEAR_TIE as agreement (a bf16 tie, not a bug); the summary names the first divergence."""
    firsts = []
    for g, w in zip(got, want):
        first = next((i for i, (a, b) in enumerate(zip(g.tokens, w.tokens)) if a != b), None)
        if first is None and len(g.tokens) != len(w.tokens):
            first = min(len(g.tokens), len(w.tokens))
        firsts.append(first)
    diverged = [(seq, first) for seq, first in enumerate(firsts) if first is not None]
    if not diverged:
        return True, f"all {len(got)} sequences equal ({len(want[0].tokens)} tokens)"
    gap = lambda seq, first: want[seq].gaps[first] if first < len(want[seq].gaps) else math.inf
    ok = all(first >= prefix or gap(seq, first) < NEAR_TIE for seq, first in diverged)
    seq, first = min(diverged, key=lambda d: d[1])
    return ok, (f"{len(got) - len(diverged)}/{len(got)} sequences equal; first divergence at token {first} "
                f"(sequence {seq}, reference top-2 logprob gap {gap(seq, first):.3f})")


def _parity_run(plan: Plan, folder: Path, backend: str, graphs: bool, prompts: list[list[int]], max_tokens: int) -> tuple[list[Greedy], str]:
    """Greedy tokens of one engine (freed on return) and, with graphs asked for, what it captured."""
    llm = make_llm(plan, folder, backend, graphs, len(prompts))
    return greedy_tokens(llm, prompts, max_tokens), graph_info(llm) if graphs else ""


def check_end_to_end(plan: Plan, work: Path, budget: Budget, report: Report) -> None:
    """Greedy tokens of a 2-layer model: Triton with graphs and Triton eager against the torch backend, bf16 and INT4
    experts, same dummy weights. Passes when the first 8 tokens agree, or diverge only at a near-tie of the reference
    (random weights give flat logits, where bf16 rounding legitimately flips the argmax)."""
    cfg = plan.check_config
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg["vocab_size"], (n,), generator=gen).tolist() for n in (5, 9, 17, 32)]
    max_tokens, prefix = 16, 8
    title = "End-to-end greedy parity (load_format=dummy)"
    report.add(title, [f"{len(prompts)} prompts, {max_tokens} greedy tokens, model {cfg['num_hidden_layers']} layers x "
                       f"{cfg['n_routed_experts']} experts (hidden {cfg['hidden_size']}, kv_lora {cfg['kv_lora_rank']})", "",
                       f"| experts | backend | vs torch backend | first {prefix} agree |", "|---|---|---|---|"])

    def row(line: str) -> None:
        report.add(title, [line])
        report.write()

    for label, int4 in (("bf16", False), ("int4", True)):
        folder = write_config(work / f"check-{label}", cfg, int4)
        reference: list[Greedy] | None = None
        for name, backend, graphs in (("torch", "torch", False), ("triton graphs", "triton", True), ("triton eager", "triton", False)):
            if budget.left() < 10:
                row(f"| {label} | {name} | skipped: time budget | |")
                continue
            try:
                tokens, captured = _parity_run(plan, folder, backend, graphs, prompts, max_tokens)
            except Exception as exc:
                traceback.print_exc()
                row(f"| {label} | {name} | error: {_err(exc)} | |")
                continue
            finally:
                free_memory()
            if backend == "torch":
                reference = tokens
                continue
            shown = f"{name} ({captured})" if captured else name
            if reference is None:
                row(f"| {label} | {shown} | no torch reference | |")
                continue
            ok, text = compare_tokens(tokens, reference, prefix)
            report.target(f"e2e greedy parity {label} {name} vs torch (first {prefix} tokens)", text, ok)
            row(f"| {label} | {shown} | {text} | {'yes' if ok else 'NO'} |")
    report.add(title, [""])


def time_decode(llm: Any, plan: Plan, batch: int, vocab: int) -> tuple[float, float]:
    """Decode tokens/s and step ms at one batch size: (time of a run generating output_len tokens - time of a run
    generating 1) over batch * (output_len - 1), so prefill and request setup cancel. Random prompts, EOS ignored."""
    from reasoning_engine import SamplingParams

    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (plan.prompt_len,)).tolist()} for _ in range(batch)]

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        _sync(plan.device)
        start = time.perf_counter()
        llm.generate(prompts, params)
        _sync(plan.device)
        return time.perf_counter() - start

    timed(4)  # warm-up: compilation, graph capture, allocator
    decode_s = timed(plan.output_len) - timed(1)
    steps = plan.output_len - 1
    return batch * steps / decode_s, 1e3 * decode_s / steps


E2E_TITLE = "End-to-end decode (random Moonlight-16B-A3B-shaped deepseek_v3, load_format=dummy)"
E2E_HEADER = ["| experts | CUDA graphs | batch | decode tok/s | step ms | batch-1 roofline tok/s | % of roofline | target |",
              "|---|---|---|---|---|---|---|---|"]


def run_e2e_variant(plan: Plan, ceil: Ceilings, work: Path, int4: bool, graphs: bool, budget: Budget, report: Report,
                    batch1: dict[str, float]) -> None:
    """Build the model (dummy weights, Triton kernels), time decode at each batch size, report rows and targets;
    the batch-1 rate goes into `batch1` under "<experts> graphs <on|off>" for the transformers ratio."""
    label, on = ("int4" if int4 else "bf16"), ("on" if graphs else "off")
    cfg = plan.e2e_config
    folder = write_config(work / f"e2e-{label}", cfg, int4)
    roof = ceil.copy_bytes_per_s / active_weight_bytes_per_token(cfg, INT4_BYTES_PER_PARAM if int4 else 2.0)
    if E2E_TITLE not in report.body:
        report.add(E2E_TITLE, [f"{cfg['num_hidden_layers']} layers, {cfg['n_routed_experts']} experts top-{cfg['num_experts_per_tok']}, "
                               f"prompt {plan.prompt_len} tokens, {plan.output_len} output tokens, max_model_len {plan.max_model_len}; "
                               "roofline = copy bandwidth / active weight bytes per token", ""])
    start = time.perf_counter()
    llm = make_llm(plan, folder, "triton", graphs, max(plan.batch_sizes))
    report.add(E2E_TITLE, [f"{label} experts, graphs {on}: built in {time.perf_counter() - start:.0f} s", "", *E2E_HEADER])
    report.write()
    for batch in plan.batch_sizes:
        if budget.left() < 5:
            report.add(E2E_TITLE, [f"| {label} | {on} | {batch} | skipped: time budget | | | | |"])
            continue
        try:
            rate, step_ms = time_decode(llm, plan, batch, cfg["vocab_size"])
        except Exception as exc:
            traceback.print_exc()
            report.add(E2E_TITLE, [f"| {label} | {on} | {batch} | error: {_err(exc)} | | | | |"])
            report.write()
            continue
        pct, target = "", ""
        if batch == 1:
            batch1[f"{label} graphs {on}"] = rate
            pct = f"{100 * rate / roof:.0f}%"
            target = f"≥{100 * DECODE_ROOFLINE_TARGET:.0f}%: {'PASS' if rate >= DECODE_ROOFLINE_TARGET * roof else 'FAIL'}"
            report.target(f"batch-1 decode {label} experts, graphs {on} ≥ {100 * DECODE_ROOFLINE_TARGET:.0f}% of roofline",
                          f"{rate:.0f} tok/s = {pct} of {roof:.0f}", rate >= DECODE_ROOFLINE_TARGET * roof)
        report.add(E2E_TITLE, [f"| {label} | {on} | {batch} | {rate:.1f} | {step_ms:.2f} | {roof:.0f} | {pct} | {target} |"])
        report.write()
    captured = graph_info(llm) if graphs else "not asked for (enforce_eager)"
    del llm
    report.add(E2E_TITLE, ["", f"{label} experts, graphs {on}: CUDA graphs captured: {captured}", ""])


def check_tensor_parallel(plan: Plan, work: Path, budget: Budget, report: Report, tp: int) -> None:
    """With `tp` GPUs: greedy tokens of TP=tp and of TP=tp with the experts EP against one GPU, on a 2-layer random
    checkpoint written by transformers (dummy weights are drawn per rank, so only a checkpoint gives every layout the
    same weights); then decode tok/s of the Moonlight-shaped model (dummy weights, graphs on) at TP=tp."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from reasoning_engine import LLM

    cfg = plan.check_config
    folder = work / "tp-check"
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
                          ).to(torch.bfloat16).save_pretrained(folder)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg["vocab_size"], (n,), generator=gen).tolist() for n in (5, 9, 17, 32)]
    lines = [f"{tp} GPUs; greedy parity on a saved 2-layer random checkpoint (bf16), 16 tokens", "",
             "| layout | vs one GPU | first 8 agree |", "|---|---|---|"]
    reference = None
    for name, parallel in (("TP=1", {}), (f"TP={tp}", {"tensor_parallel_size": tp}),
                           (f"TP={tp} + EP", {"tensor_parallel_size": tp, "enable_expert_parallel": True})):
        if budget.left() < 30:
            lines.append(f"| {name} | skipped: time budget | |")
            continue
        with LLM(str(folder), dtype="bfloat16", device=plan.device, kernel_backend="triton", max_model_len=plan.max_model_len,
                 max_num_seqs=len(prompts), **parallel) as llm:
            tokens = greedy_tokens(llm, prompts, 16)
        free_memory()
        if reference is None:
            reference = tokens
            continue
        ok, text = compare_tokens(tokens, reference, 8)
        lines.append(f"| {name} | {text} | {'yes' if ok else 'NO'} |")
        report.target(f"greedy parity {name} vs one GPU (first 8 tokens)", text, ok)
    if budget.left() > 60:
        e2e = write_config(work / "tp-e2e", plan.e2e_config, False)
        with make_llm(plan, e2e, "triton", True, max(plan.batch_sizes), tensor_parallel_size=tp) as llm:
            for batch in plan.batch_sizes:
                if budget.left() < 10:
                    break
                rate, step_ms = time_decode(llm, plan, batch, plan.e2e_config["vocab_size"])
                lines.append(f"- Moonlight-shaped bf16, TP={tp}, graphs on, batch {batch}: {rate:.1f} tok/s, step {step_ms:.2f} ms")
        free_memory()
    report.add(f"Tensor parallelism over {tp} GPUs", [*lines, ""])


def bench_transformers(plan: Plan, budget: Budget) -> tuple[float, str]:
    """Batch-1 decode tokens/s of transformers' generate on a random model of the same shape, built on the device."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = plan.e2e_config
    hf_config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(plan.device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.eval()
    built_s = time.perf_counter() - start
    ids = torch.randint(2, cfg["vocab_size"], (1, plan.prompt_len), device=plan.device)

    def timed(n: int) -> float:
        _sync(plan.device)
        begin = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=cfg["eos_token_id"])
        _sync(plan.device)
        return time.perf_counter() - begin

    timed(2)  # warm-up
    one = timed(1)
    per_token = max(timed(2) - one, 1e-4)
    # fit the timed run in what is left of the budget (keeping 20 s for what follows)
    n = max(3, min(plan.hf_output_len, int((budget.left() - 20) / per_token)))
    decode_s = timed(n) - one
    if decode_s <= 0:
        raise RuntimeError(f"decode time not measurable: {n} tokens took no longer than 1 ({one:.3f} s)")
    rate = (n - 1) / decode_s
    impl = getattr(model.config, "_experts_implementation", None) or "default"
    del model
    return rate, f"{n} new tokens after a {plan.prompt_len}-token prompt; model built in {built_s:.0f} s; experts implementation {impl}"


def run_transformers(plan: Plan, budget: Budget, report: Report, batch1: dict[str, float]) -> None:
    from importlib.metadata import version

    rate, note = bench_transformers(plan, budget)
    ours_key = next((k for k in ("bf16 graphs on", "bf16 graphs off") if k in batch1), None)
    lines = [f"- transformers {version('transformers')} `generate`, bf16, batch 1: {rate:.1f} tok/s ({note})"]
    if ours_key is None:
        report.target(f"batch-1 decode ≥ {HF_SPEEDUP_TARGET:.0f}x transformers", "no bf16 batch-1 result of ours", None)
    else:
        ratio = batch1[ours_key] / rate
        lines.append(f"- ours ({ours_key}) / transformers: {ratio:.1f}x")
        report.target(f"batch-1 decode ≥ {HF_SPEEDUP_TARGET:.0f}x transformers", f"{ratio:.1f}x ({ours_key})", ratio >= HF_SPEEDUP_TARGET)
    report.add("transformers baseline", [*lines, ""])


# ------------------------------------------------------------------------------------------------- adaptive engine

ADAPTIVE_TITLE = "Adaptive vs static speculation (bundled tiny reasoner on its eval prompts, greedy, closed loop)"
ADAPTIVE_DEFAULT_TARGET = 1.15  # adaptive / static default at 16 requests and more
ADAPTIVE_BEST_TARGET = 0.95  # adaptive / the best static setting, at every concurrency
ADAPTIVE_ROUNDS = 3


def _suffix(k: int) -> dict[str, Any]:
    return {"method": "suffix", "num_speculative_tokens": k}


# name -> LLM keyword arguments; "static default" is what `--no-adaptive` serves with suffix speculation (draft length
# doubling and halving, plain decoding above 16 requests)
ADAPTIVE_CONFIGS: dict[str, dict[str, Any]] = {
    "static k=0": {"adaptive": False},
    "static k=4": {"adaptive": False, "speculative_config": _suffix(4)},
    "static default": {"adaptive": False, "speculative_config": _suffix(8)},
    "adaptive": {"speculative_config": _suffix(8)},
}


def adaptive_prompts(llm: Any, count: int) -> list[list[int]]:
    """The bundled model's own eval problems without tools (arithmetic, sorting, letters, comparison), templated."""
    from reasoning_engine.tiny.data import eval_samples

    tokenizer = llm.get_tokenizer()
    samples = [s for s in eval_samples(per_task=count) if s.tools is None]
    samples = [samples[(i * 7919) % len(samples)] for i in range(count)]  # a fixed mix of the tasks
    return [list(tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for s in samples]


def closed_loop(llm: Any, prompts: list[list[int]], concurrency: int, max_tokens: int,
                tag: str) -> tuple[float, int, list[list[int]]]:
    """Keep `concurrency` requests running, the next one added as one finishes: (seconds, output tokens, each
    prompt's greedy tokens)."""
    from reasoning_engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    waiting = list(range(len(prompts)))
    outputs: dict[int, list[int]] = {}
    running = 0
    start = time.perf_counter()
    while waiting or running:
        while waiting and running < concurrency:
            i = waiting.pop(0)
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompts[i]}, params)
            running += 1
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
                running -= 1
    seconds = time.perf_counter() - start
    return seconds, sum(len(t) for t in outputs.values()), [outputs[i] for i in range(len(prompts))]


def run_adaptive(plan: Plan, budget: Budget, report: Report, rounds: int = ADAPTIVE_ROUNDS) -> None:
    """Each configuration's engine built once and warmed up (graph capture, kernel compilation; the adaptive one
    calibrates, then learns across the rounds), then up to `rounds` rounds, each running every concurrency
    level under every configuration in turn; total output tokens per second, medians of the rounds. The bundled model
    is tiny, but its acceptance is a trained model's, and on a GPU its step time, like a large model's, hardly grows
    with the tokens verified (launch-bound there, memory-bound here), which is where drafting pays at 16-32 requests.
    Greedy outputs are compared with static k=0's: speculation must not change them (a near-tie in the logits may
    still flip one on a GPU, where a verification step's batch shape differs from a plain step's)."""
    from reasoning_engine import LLM

    levels = plan.adaptive_levels
    engines = {name: LLM(device=plan.device, max_num_seqs=max(levels), kv_cache_blocks=4096, **kwargs)
               for name, kwargs in ADAPTIVE_CONFIGS.items()}
    prompts = {level: adaptive_prompts(engines["static k=0"], max(8, 3 * level)) for level in levels}
    for name, llm in engines.items():  # warm-up: graph capture, allocator, compilations of plain and drafted steps
        closed_loop(llm, prompts[levels[-1]][:8], 4, 32, f"warm-{name}")
    rates: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    intro = (f"per level {', '.join(f'{lvl}: {len(prompts[lvl])}' for lvl in levels)} requests, at most "
             f"{plan.adaptive_max_tokens} output tokens (EOS ends most sooner); total output tok/s, median of the rounds")
    rounds_done = 0
    for round_index in range(rounds):
        if round_index and budget.left() < 20:
            break
        for level in levels:
            for name, llm in engines.items():
                seconds, count, outs = closed_loop(llm, prompts[level], level, plan.adaptive_max_tokens,
                                                   f"{name}-{level}-{round_index}")
                rates.setdefault((name, level), []).append(count / seconds)
                tokens[(name, level)] = outs
            # the table so far (each level's medians over the rounds it has had), rewritten as each level finishes
            report.replace(ADAPTIVE_TITLE, [f"{round_index + 1} round(s); {intro}", "", *adaptive_table(rates, tokens, report)])
            report.write()
        rounds_done += 1
    snapshot = engines["adaptive"].engine.adaptive_snapshot()
    graphs = graph_info(engines["adaptive"])
    for llm in engines.values():
        llm.shutdown()
    speculation = snapshot.get("speculation", {})
    report.replace(ADAPTIVE_TITLE, [
        f"{rounds_done} round(s); {intro}", "", *adaptive_table(rates, tokens, report), "",
        f"adaptive at the end: steps decided `{json.dumps(speculation.get('decided'))}`; drafting gate "
        f"`{json.dumps(speculation.get('gate'))}`; decode batch sizes seen "
        f"`{json.dumps(snapshot.get('decode_batch_sizes'))}`; CUDA graphs: {graphs}", ""])


def adaptive_table(rates: dict[tuple[str, int], list[float]], tokens: dict[tuple[str, int], list[list[int]]],
                   report: Report) -> list[str]:
    """The adaptive-vs-static table over the levels measured under every configuration so far (medians of their
    rounds), and each such level's targets."""
    names = list(ADAPTIVE_CONFIGS)
    lines = [f"| requests | {' | '.join(names)} | adaptive / static default | adaptive / best static | greedy outputs "
             "equal to static k=0 |", "|---" * (len(names) + 4) + "|"]
    levels = sorted({level for _, level in rates if all((n, level) in rates for n in names)})
    for level in levels:
        median = {name: statistics.median(rates[(name, level)]) for name in names}
        best_name = max((n for n in names if n != "adaptive"), key=median.__getitem__)
        to_default = median["adaptive"] / median["static default"]
        to_best = median["adaptive"] / median[best_name]
        reference = tokens[("static k=0", level)]
        equal = [sum(a == b for a, b in zip(tokens[(n, level)], reference)) for n in names[1:]]
        lines.append(f"| {level} | {' | '.join(f'{median[n]:.0f}' for n in names)} | {to_default:.2f}x | "
                     f"{to_best:.2f}x ({best_name}) | {min(equal)}/{len(reference)} |")
        report.target(f"adaptive ≥ {ADAPTIVE_BEST_TARGET}x the best static at {level} requests",
                      f"{to_best:.2f}x ({best_name})", to_best >= ADAPTIVE_BEST_TARGET)
        if level >= 16:
            report.target(f"adaptive ≥ {ADAPTIVE_DEFAULT_TARGET}x the static default at {level} requests",
                          f"{to_default:.2f}x", to_default >= ADAPTIVE_DEFAULT_TARGET)
    return lines


# ------------------------------------------------------------------------------------------------------------- main


FALLBACK_CEILINGS = Ceilings(4.3e12, 7.9e14)  # measured on an H200 before


@dataclass
class State:
    """What the sections share; it travels between the orchestrating process and the section worker."""

    plan: Plan
    budget: Budget
    report: Report
    work: Path
    ceil: Ceilings | None = None
    batch1: dict[str, float] | None = None  # batch-1 decode tok/s per e2e variant, for the transformers ratio
    tensor_parallel_size: int = 1  # GPUs for the tensor-parallel section (1: no such section)

    def ceilings(self) -> Ceilings:
        if self.ceil is None:
            self.report.header.append("- ceilings not measured: rooflines use 4.3 TB/s and 790 TFLOP/s, measured on an H200 before")
            self.ceil = FALLBACK_CEILINGS
        return self.ceil

    def decode_rates(self) -> dict[str, float]:
        if self.batch1 is None:
            self.batch1 = {}
        return self.batch1


def section_ceilings(state: State) -> None:
    ceil = measure_ceilings(state.plan)
    state.ceil = ceil
    state.report.header.append(f"- measured copy bandwidth {ceil.copy_bytes_per_s / 1e9:.0f} GB/s (read + write); "
                               f"bf16 matmul {ceil.matmul_flops_per_s / 1e12:.3g} TFLOP/s")


def _variant(int4: bool, graphs: bool) -> Callable[[State], None]:
    return lambda s: run_e2e_variant(s.plan, s.ceilings(), s.work, int4, graphs, s.budget, s.report, s.decode_rates())


@dataclass(frozen=True)
class Section:
    """A step run in the section worker: the budget it needs to start, and the longest it may take (its own budget
    inside the run's, so a slow or hung section cannot starve the ones after it; what it measured is kept)."""

    min_s: float
    run: Callable[[State], None]
    cap_s: float = math.inf


PARITY = "e2e greedy parity"
FIRST_DECODE = "e2e decode bf16 experts, graphs on"
SECTIONS: dict[str, Section] = {
    "ceilings": Section(0, section_ceilings),
    FIRST_DECODE: Section(30, _variant(False, True), cap_s=150),
    "transformers generate, batch 1": Section(30, lambda s: run_transformers(s.plan, s.budget, s.report, s.decode_rates())),
    "kernel timing": Section(30, lambda s: run_kernel_timing(s.plan, s.ceilings(), s.budget, s.report)),
    PARITY: Section(20, lambda s: check_end_to_end(s.plan, s.work, s.budget, s.report)),
    "adaptive vs static speculation": Section(60, lambda s: run_adaptive(s.plan, s.budget, s.report)),
    "e2e decode bf16 experts, graphs off": Section(30, _variant(False, False)),
    "e2e decode int4 experts, graphs on": Section(30, _variant(True, True)),
    "e2e decode int4 experts, graphs off": Section(30, _variant(True, False)),
    "tensor parallel": Section(60, lambda s: check_tensor_parallel(s.plan, s.work, s.budget, s.report, s.tensor_parallel_size)),
}
START_TESTS, JOIN_TESTS = "start kernel tests", "kernel tests (compiled)"  # steps the orchestrator runs itself


def run_steps(skip_tests: bool, skip_e2e: bool, tensor_parallel: bool = False) -> list[str]:
    """The run's order, the numbers that matter first: the ceilings, then batch-1 decode of the Moonlight-shaped model
    (bf16 experts, CUDA graphs; batch 1 before 8 and 64) and transformers' batch-1 rate beside it, then the kernel
    table, greedy parity, the adaptive engine against static speculation, the other decode variants; tensor
    parallelism (several GPUs) last. With the kernel tests, they run first, beside the parity check (neither is
    timed; both mostly compile on CPU cores), and are joined before anything is timed."""
    tests = not skip_tests
    e2e = not skip_e2e
    return [
        "ceilings",
        *([START_TESTS] if tests else []),
        *([PARITY] if tests and e2e else []),
        *([JOIN_TESTS] if tests else []),
        *([FIRST_DECODE, "transformers generate, batch 1"] if e2e else []),
        "kernel timing",
        *([PARITY] if e2e and not tests else []),
        *(["adaptive vs static speculation", "e2e decode bf16 experts, graphs off", "e2e decode int4 experts, graphs on",
            "e2e decode int4 experts, graphs off"] if e2e else []),
        *(["tensor parallel"] if tensor_parallel else []),
    ]


def _device_healthy(device: str) -> bool:
    """False once the CUDA context is broken (an illegal address or a device assert poisons it for the process)."""
    if device != "cuda":
        return True
    try:
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def _section_worker(conn: Any) -> None:
    """Worker process: receives (section name, state), runs the section within its cap, sends ("progress", report)
    each time the section writes the report and ("done", (state, whether the device still works)) at its end; None
    ends it."""
    faulthandler.enable()
    torch.manual_seed(0)
    while (message := conn.recv()) is not None:
        name, state = message
        section = SECTIONS[name]
        run_budget = state.budget
        state.budget = Budget(min(max(run_budget.left(), 0.0), section.cap_s))  # the section's own share
        faulthandler.dump_traceback_later(state.budget.left() + 20)  # a hang prints where it is stuck
        state.report.on_write = lambda report: conn.send(("progress", report))
        run_section(state.report, run_budget, name, section.min_s, lambda: section.run(state))
        state.report.on_write = None
        faulthandler.cancel_dump_traceback_later()
        state.budget = run_budget
        conn.send(("done", (state, _device_healthy(state.plan.device))))


class SectionWorker:
    """A spawned process running sections, so a crash, a hang or a broken CUDA context costs one section: the next
    one gets a fresh worker (its Triton kernels come back from the on-disk compile cache). `progress` holds the last
    report the running section wrote: what it measured, should it die or hang."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_section_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.progress: Report | None = None

    def run(self, name: str, state: State, timeout_s: float) -> tuple[State, bool] | str:
        """(state after the section, device healthy), or why the worker gave no answer."""
        self.progress = None
        self.conn.send((name, state))
        deadline = time.time() + timeout_s
        while self.conn.poll(max(deadline - time.time(), 0.0)):
            try:
                kind, payload = self.conn.recv()
            except EOFError:
                self.proc.join(10)
                return f"section worker died (exit code {self.proc.exitcode})"
            if kind == "done":
                return payload
            self.progress = payload
        return f"section worker hung past its time; killed after {timeout_s:.0f} s"

    def drain(self) -> None:
        """Take the progress messages already sent (the orchestrator was interrupted while the section ran)."""
        try:
            while self.conn.poll(0):
                kind, payload = self.conn.recv()
                if kind == "progress":
                    self.progress = payload
        except (EOFError, OSError):
            pass

    def stop(self, graceful: bool = True) -> None:
        """Ask the worker to exit (graceful), or kill it outright (hung or dead)."""
        if graceful and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _header(plan: Plan, budget_s: float, argv: list[str]) -> list[str]:
    from importlib.metadata import version

    today = datetime.date.today().isoformat()
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), Triton interpreted: DRY RUN, timings meaningless"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return [
        f"# GPU check {today}{' (dry run)' if plan.dry else ''}",
        "",
        f"- device: {device}",
        f"- torch {torch.__version__}, triton {version('triton')}, transformers {version('transformers')}, "
        f"CUDA {torch.version.cuda}, python {platform.python_version()}",
        f"- commit {commit or 'unknown'}; command `{' '.join(['benchmarks/gpu_check.py', *argv])}`; budget {budget_s:.0f} s",
    ]


class Terminated(Exception):
    """SIGTERM reached the orchestrator: the caller's time limit (scripts/gpu_session.sh runs it under `timeout`)."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget; later sections are skipped once spent")
    parser.add_argument("--dry-run", action="store_true", help="the whole run on CPU with tiny shapes (Triton interpreted)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run tests/kernels")
    parser.add_argument("--skip-e2e", action="store_true", help="no end-to-end parity, decode timing or transformers baseline")
    parser.add_argument("--results-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="N > 1 (a machine with N GPUs): add greedy parity of TP=N (and TP=N + EP) against one GPU "
                             "and TP=N decode tok/s")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        if not torch.cuda.is_available():
            print("gpu_check needs a CUDA GPU (or --dry-run)", file=sys.stderr)
            return 2
    plan = Plan.make(args.dry_run)
    name = f"gpu_check_{'dryrun_' if plan.dry else ''}{datetime.date.today().isoformat()}.md"
    report = Report(Path(args.results_dir) / name, _header(plan, args.budget_s, argv))
    report.write()
    print(f"writing {report.path}", flush=True)
    tests: KernelTests | None = None
    worker: SectionWorker | None = None
    terminated = False
    signal.signal(signal.SIGTERM, _terminate)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        state = State(plan, budget, report, Path(tmp), tensor_parallel_size=args.tensor_parallel_size)
        if args.tensor_parallel_size > max(1, torch.cuda.device_count()) and not plan.dry:
            print(f"--tensor-parallel-size {args.tensor_parallel_size} needs as many GPUs; this machine has "
                  f"{torch.cuda.device_count()}", file=sys.stderr)
            return 2
        step, start = "", time.time()
        try:
            for step in run_steps(args.skip_tests, args.skip_e2e, args.tensor_parallel_size > 1):
                start = time.time()
                if step == START_TESTS:
                    tests = KernelTests(plan, report.path.with_name(report.path.stem + "_kernel_tests.log"))
                    continue
                if step == JOIN_TESTS:
                    assert tests is not None
                    running = tests  # joined (or killed, reporting its progress) even when the budget is spent
                    run_section(state.report, budget, step, -math.inf, lambda: running.join(state.report, budget))
                    continue
                worker = worker or SectionWorker()
                answer = worker.run(step, state, min(max(budget.left(), 0), SECTIONS[step].cap_s) + 30)
                if isinstance(answer, str):  # the worker died or hung: keep the rows the section wrote before that
                    print(f"[{budget.elapsed():4.0f} s] {step}: {answer}", flush=True)
                    state.report = worker.progress or state.report
                    state.report.status(step, f"error: {answer}", time.time() - start)
                    state.report.write()
                    worker.stop(graceful=False)
                    worker = None
                    continue
                state, healthy = answer
                if not healthy:
                    state.report.status("(CUDA context broken after the section above: a fresh worker runs the rest)", "restart", 0.0)
                    state.report.write()
                    worker.stop()
                    worker = None
        except Terminated as exc:  # the caller's time limit: record where it struck, keep every row measured
            terminated = True
            if worker is not None:
                worker.drain()
                state.report = worker.progress or state.report
            print(f"[{budget.elapsed():4.0f} s] {step}: killed by {exc}", flush=True)
            state.report.status(step, f"killed by {exc} (the caller's time limit)", time.time() - start)
        finally:
            if tests is not None:
                tests.kill()
            if worker is not None:
                worker.stop(graceful=not terminated)
    report = state.report
    report.header.append(f"- total wall time {budget.elapsed():.0f} s")
    report.write()
    for stale in report.path.parent.glob(f".{report.path.name}.*.tmp"):  # a worker killed mid-write left it
        stale.unlink(missing_ok=True)
    print(report.render())
    print(f"wrote {report.path}")
    return 128 + signal.SIGTERM if terminated else 0


if __name__ == "__main__":
    sys.exit(main())
