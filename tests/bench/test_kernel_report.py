"""benchmarks/kernel_report.py on CPU: a handful of real ahead-of-time compiles for sm_90 and sm_100 (the decode
attention at the CUDA-graph path's 128k bound, which once spilled 32 KB a thread, and the batch-1 INT4
MoE), the occupancy and roofline arithmetic, and the --measure path through the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from .scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kernel_report.py"
FIELDS = {"kernel", "target", "shape", "registers", "spill_bytes", "shared_bytes", "shared_limit", "decode_path"}


@pytest.fixture(scope="module")
def kernel_report() -> ModuleType:
    return load_script("kernel_report")



def _run_with_report(code: str, compile_kernels: bool = True) -> subprocess.CompletedProcess:
    """`code` in a fresh Python with benchmarks/kernel_report.py imported as `kr` (and os, sys, json, signal): Triton
    compiling (`compile_kernels`) or in the mode the script chooses itself."""
    mode = 'os.environ["TRITON_INTERPRET"] = "0"\n' if compile_kernels else ""
    prelude = f"""import importlib.util, json, os, signal, sys
{mode}sys.path.insert(0, {str(REPO)!r})
spec = importlib.util.spec_from_file_location("kernel_report", {str(SCRIPT)!r})
kr = importlib.util.module_from_spec(spec)
sys.modules["kernel_report"] = kr
spec.loader.exec_module(kr)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO)

def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script chooses the mode itself
    return subprocess.run([sys.executable, str(SCRIPT), "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path),
                           "--date", "2026-12-02", *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


@pytest.mark.slow
def test_compiles_decode_kernels_for_hopper_and_blackwell(tmp_path: Path) -> None:
    only = "^(kimi-tp8 (mla decode b1 ctx128k graph|moe w4a16 t1)|kimi-ep8 mla decode b1 ctx128k graph)$"
    proc = _run(tmp_path, "--only", only, "--json", "--jobs", "2", "--no-launch-count")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report_json = json.loads(proc.stdout.strip().splitlines()[-1])
    records = report_json["records"]
    assert report_json["summary"]["launches_per_moe_layer"] is None  # --no-launch-count
    kernels = {r["kernel"] for r in records}
    assert {"_moe_gemm_kernel", "_align_one_program_kernel", "_combine_kernel"} <= kernels  # few pairs: one sort launch
    # MLA decode: 8 heads a rank (TP 8) through the decode kernel, 64 (EP 8, attention unsplit) through the latent one
    by_model = {m: {r["kernel"] for r in records if r["shape"].startswith(f"{m} mla decode")} for m in ("kimi-tp8", "kimi-ep8")}
    assert by_model == {"kimi-tp8": {"_decode_partial_kernel", "_decode_reduce_kernel"},
                        "kimi-ep8": {"_latent_partial_kernel", "_latent_reduce_kernel"}}
    assert {r["target"] for r in records} == {"sm_90", "sm_100"}
    for r in records:
        assert FIELDS <= set(r), r
        assert r["decode_path"] is True and "error" not in r, r
        assert 0 < r["registers"] <= 255
        assert r["spill_bytes"] == 0 and r["shared_bytes"] <= r["shared_limit"] == 232448, r
    report = (tmp_path / "kernel_report_cpu_aot_2026-12-02.md").read_text()
    assert "2026-12-02; CPU ahead-of-time compile, no GPU)" in report.splitlines()[0]  # the heading names the device
    assert "| sm_90 no spills, shared within limit | " in report and "FAIL" not in report
    assert "## Decode ops: bytes moved vs the roofline" in report
    assert "python benchmarks/kernel_report.py --cache-dir" in report  # the command that produced it

    again = _run(tmp_path, "--only", only, "--json", "--no-write", "--no-launch-count")  # every variant from the cache
    assert "compiling" not in again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1]) == report_json


@pytest.mark.slow
def test_measure_runs_through_the_interpreter_without_a_gpu(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--measure", "--only", "^moonlight mla decode b1 ctx1k eager$", "--no-launch-count")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "kernel_report_cpu_interpreted_2026-12-02.md").read_text()
    assert "## Measured on CPU through Triton's interpreter" in report
    assert "| moonlight | mla decode | b1 ctx1k eager |" in report


def test_measure_writes_each_shape_as_it_is_timed(tmp_path: Path) -> None:
    """--measure killed mid-run (as a stage's `timeout` would) keeps the shapes timed before: two fake decode ops are
    timed, the third kills the process with SIGKILL, and the report on disk already holds the first two rows."""
    code = f"""

def case(name, run):
    return kr.Case("fake", "mla decode", name, True, lambda device: (run, None))

def kill():
    os.kill(os.getpid(), signal.SIGKILL)

kr.all_cases = lambda: [case("first", lambda: None), case("second", lambda: None), case("third", kill),
                        case("fourth", lambda: None)]
kr.main(["--measure", "--no-launch-count", "--out", {str(tmp_path)!r}, "--date", "2026-12-07", "--cache-dir", {str(tmp_path / "cache")!r}])
"""
    proc = _run_with_report(code, compile_kernels=False)
    assert proc.returncode == -9, proc.stderr[-3000:]  # killed at the third shape, as planned
    report = (tmp_path / "kernel_report_cpu_interpreted_2026-12-07.md").read_text()
    assert "| fake | mla decode | first |" in report and "| fake | mla decode | second |" in report
    assert "third" not in report and "fourth" not in report
    assert not list(tmp_path.glob(".*.tmp")), "the report is replaced whole, never left half-written"


def test_a_shape_that_fails_is_a_row_of_the_report(kernel_report: ModuleType) -> None:
    def broken() -> None:
        raise RuntimeError("out of | memory")

    cases = [kernel_report.Case("fake", "mla decode", "ok", True, lambda device: ((lambda: None), None)),
             kernel_report.Case("fake", "mla decode", "broken", True, lambda device: (broken, None))]
    seen: list[int] = []
    out = kernel_report.measure(cases, "cpu", 60.0, lambda so_far: seen.append(len(so_far)))
    assert seen == [1, 2]
    assert out[0].seconds is not None and out[1].seconds is None and "RuntimeError: out of \\| memory" in out[1].error


def test_occupancy_limits(kernel_report: ModuleType) -> None:
    # 128 registers x 256 threads = half the register file; 56 KB: four would fit
    assert kernel_report.ctas_per_sm(128, 8, 56_576) == 2
    assert kernel_report.ctas_per_sm(255, 8, 1_024) == 1
    assert kernel_report.ctas_per_sm(32, 4, 1_024) == 16  # 2048 threads
    assert kernel_report.ctas_per_sm(16, 1, 0) == 32  # the CTA limit
    assert kernel_report.ctas_per_sm(64, 4, 232_449) == 0  # over 227 KB: does not launch


def test_modelled_time_charges_small_grids(kernel_report: ModuleType) -> None:
    h200 = kernel_report.TARGETS["sm_90"]
    full = kernel_report.Traffic(4.8e6, {"a": (4.8e6, 10_000)})
    assert full.modelled_seconds(h200) == pytest.approx(1e-6)
    quarter = kernel_report.Traffic(4.8e6, {"a": (4.8e6, 33)})  # 33 of 132 SMs
    assert quarter.modelled_seconds(h200) == pytest.approx(4e-6)
    assert quarter.modelled / quarter.minimum == 1.0


def test_moe_traffic_counts_a_split_gemms_programs_and_partial_sums() -> None:
    """Batch-1 Kimi TP 8: the gate_up GEMM runs 8 experts x 4 column tiles x 14 K spans, enough programs for every
    H200 SM, and its float32 partial sums are written and read back once; the down GEMM (K = 256) is one span."""
    code = f"""
(case,) = [c for c in kr.all_cases() if c.label == "kimi-tp8 moe w4a16 t1"]
launches = []
run, model_traffic = case.build("meta")
with kr.recording_launches(launches):
    run()
grids = [l.grid for l in launches if l.kernel == "_moe_gemm_kernel"]
print(json.dumps({{"grids": grids, "kernels": model_traffic(launches).kernels}}))
"""
    proc = _run_with_report(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (gated, down) = out["grids"]
    assert gated == [8, 4, 14] and down[2] == 1
    gate_up_bytes, gate_up_programs = out["kernels"]["gate_up GEMM"]
    assert gate_up_programs == 8 * 4 * 14
    weights = 8 * 2 * 7168 * 256 * (0.5 + 2 / 32)  # 8 experts touched, INT4 and their scales
    inputs_and_intermediate = 8 * (4 * 7168 + 256) * 2
    assert gate_up_bytes == pytest.approx(weights + inputs_and_intermediate + 2 * 14 * 8 * 512 * 4, rel=1e-3)
    assert out["kernels"]["down GEMM"][1] == 8 * down[1]


def test_every_case_names_a_model_op_and_shape(kernel_report: ModuleType) -> None:
    cases = kernel_report.all_cases()
    labels = [c.label for c in cases]
    assert len(labels) == len(set(labels))
    decode = [c for c in cases if c.op == "mla decode"]
    assert len(decode) == 3 * 3 * 3 * 2  # models x batches x contexts x (eager, graph)
    assert {c.model for c in cases} >= {"kimi-tp8", "kimi-ep8", "moonlight", "moonlight-int4"}


def test_fp8_cache_cases_and_their_byte_model(kernel_report: ModuleType) -> None:
    """`--kv-cache-dtype fp8`: Kimi K2.5's MLA decode and verify steps over FP8 latent rows are cases of their own
    (`mla decode fp8`, `mla verify fp8`, so `--only` selects them), whose cache rows weigh the e4m3 latent, its bf16
    scale and the bf16 rotary key; on a small shape (64 heads, latent 32 + rope 8, one sequence of 64 tokens: one
    slice, one row block) the latent kernel's bytes and its merge's are counted by hand."""
    kr = kernel_report
    cases = kr.all_cases()
    fp8 = [c for c in cases if c.op in ("mla decode fp8", "mla verify fp8")]
    assert {c.model for c in fp8} == {"kimi-tp8", "kimi-ep8"} and all(c.decode_path for c in fp8)
    assert len([c for c in fp8 if c.op == "mla decode fp8"]) == 2 * 3 * 3 * 2  # models x batches x contexts x graph
    assert "kimi-ep8 mla verify fp8 b8 x 4 tokens ctx32k tree" in {c.label for c in fp8}
    assert kr.mla_row_bytes(kr.KIMI_EP8, True) == 512 + 2 + 64 * 2 and kr.mla_row_bytes(kr.KIMI_EP8, False) == 576 * 2

    small = kr.Model("small", heads=64, hidden=64, experts=1, global_experts=1, top_k=1, inter=16, quant=None,
                     q_lora=None, latent=32, rope=8)
    row, query = 32 + 2 + 8 * 2, (32 + 8) * 2
    traffic = kr._mla_decode_traffic(small, 1, 64, fp8=True)
    assert traffic.minimum == 64 * row + 64 * (query + 32 * 2)
    # 64 keys of the one slice once for all 64 rows; each row's query in, its float32 partial and log-sum-exp out
    assert traffic.kernels["_latent_partial_kernel"] == (64 * row + 64 * (query + 32 * 4 + 4), 1)
    # the merge reads each row's slice and log-sum-exp (one block of 32 channels) and writes its bf16 output
    assert traffic.kernels["_latent_reduce_kernel"] == (64 * (32 * 4 + 4 + 32 * 2), 64)
    # a main-loop iteration streams BLOCK_N FP8 rows
    tile = {"BLOCK_N": 32, "D1": 512, "D2": 64, "FP8": True}
    assert kr.streamed_tile_bytes("_latent_partial_kernel", tile) == 32 * (512 + 2 + 128)
    assert kr.streamed_tile_bytes("_decode_partial_kernel", dict(tile, V_FROM_K=True)) == 32 * (512 + 2 + 128)
    assert kr.streamed_tile_bytes("_latent_partial_kernel", dict(tile, FP8=False)) == 32 * 576 * 2


@pytest.mark.slow
@pytest.mark.parametrize("model, kernel, keys, mma, fraction", [
    ("kimi-ep8", "_latent_partial_kernel", 64, {"sm_90": "wgmma", "sm_100": "tcgen05"}, {"sm_90": 0.55, "sm_100": 0.5}),
    ("kimi-tp8", "_decode_partial_kernel", 32, {"sm_90": "mma.sync", "sm_100": "mma.sync"}, {"sm_90": 0.17, "sm_100": 0.13}),
])
def test_compiles_the_fp8_latent_kernel_with_its_byte_model(model: str, kernel: str, keys: int, mma: dict,
                                                            fraction: dict) -> None:
    """Kimi K2.5's batch-1 decode over an FP8 cache (64 heads a rank: the latent split kernel; 8 under TP 8: the
    decode kernel), compiled for sm_90 and sm_100: FP8 rows, the main loop found, and its bytes per iteration those of
    its tile's FP8 rows (642 bytes each). The e4m3 values converted alone, each row's scale applied to the scores and
    probabilities (and, in the latent kernel, 64-key tiles) keep the loop's issue-bound share at least 0.55 (sm_90) /
    0.5 (sm_100) in the latent kernel and 0.17 / 0.13 in the decode kernel (a scale per loaded value: 0.29 / 0.23 and
    0.15 / 0.11); ptxas spills at most 16 bytes a thread (latent, sm_90: 8, stored before the main loop, loaded after)."""
    records = _compiled_records(f"{model} mla decode fp8 b1 ctx32k eager", kernel)
    assert {r["target"] for r in records} == {"sm_90", "sm_100"} and len(records) == 2
    for record in records:
        assert "FP8=True" in record["config"] and record["main_loop"], record
        assert record["loop_bytes_source"] == "tile shape" and record["loop_bytes"] == keys * 642, record
        assert record["mma"] == mma[record["target"]], record
        assert record["spill_bytes"] <= 16, record
        assert record["issue_bound_fraction"] >= fraction[record["target"]], record


# A hand-written SASS loop: 6 instructions (the NOP is padding, not counted) from 0x0100 back to it, two 16-byte
# loads a thread per iteration (2 x 16 x 32 = 1024 B a warp) and one mma.sync; an outer loop around it; the trailing
# self-branch every kernel ends with is no loop.
SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*00f0*/                   NOP ;
        /*0100*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0110*/               @P0 LDG.E.128 R8, desc[UR4][R2.64+0x10] ;
        /*0120*/                   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
        /*0130*/                   IADD3 R2, P1, R2, 0x20, RZ ;
        /*0140*/                   ISETP.GE.AND P2, PT, R2, R3, PT ;
        /*0150*/              @!P2 BRA 0x100 ;
        /*0160*/                   STG.E.128 desc[UR4][R6.64], R12 ;
        /*0170*/                   BRA.U !UP0, 0x10 ;
        /*0180*/                   EXIT ;
        /*0190*/                   BRA 0x190;
"""


def test_sass_main_loop_counts_the_innermost_streaming_loop(kernel_report: ModuleType) -> None:
    loop = kernel_report.sass_main_loop(SASS)
    assert loop["loop"] and loop["span"] == "0x100-0x150"
    assert loop["instructions"] == 6 and loop["global_bytes"] == 2 * 16 * 32
    assert loop["mma"] == loop["kernel_mma"] == "mma.sync"
    assert kernel_report.mma_kind(["HGMMA.64x64x16.F32.BF16"]) == "wgmma"
    assert kernel_report.mma_kind(["UTCHMMA.2CTA", "FFMA"]) == "tcgen05"
    assert kernel_report.mma_kind(["FFMA", "LDG.E"]) == "none"
    # the issue model: 1024 B per 6 warp-instructions, 4 issued a cycle on each of 132 SMs at 1.98 GHz
    h200 = kernel_report.TARGETS["sm_90"]
    expected = 1024 / 6 * 4 * 132 * 1.98e9 / 4.8e12
    assert h200.issue_bound_fraction(1024, 6) == pytest.approx(min(1.0, expected))
    assert h200.issue_bound_fraction(512, 600) == pytest.approx(512 / 600 * 4 * 132 * 1.98e9 / 4.8e12)
    straight = kernel_report.sass_main_loop(SASS.replace("@!P2 BRA 0x100", "@!P2 BRA 0x170").replace("BRA.U !UP0, 0x10", "NOP"))
    assert not straight["loop"] and straight["instructions"] == 10  # one pass: every instruction but NOPs and `BRA .`


@pytest.mark.slow
def test_issue_bound_fraction_of_a_compiled_kernel() -> None:
    """One real compile for sm_90 (Moonlight's bf16 down GEMM at batch 1): its main loop is found in the SASS, holds
    mma.sync or wgmma, and the issue-bound fraction is a share of the bandwidth in (0, 1]."""
    code = f"""
(case,) = [c for c in kr.all_cases() if c.label == "moonlight moe bf16 t1"]
launches = []
run, _ = case.build("meta")
with kr.recording_launches(launches):
    run()
launch = [l for l in launches if l.kernel == "_moe_gemm_kernel"][-1]
target = kr.TARGETS["sm_90"]
kr._worker_init()
job = kr.compile_job(launch, target)
row = kr.Row(case, launch, target, job, kr.run_compile(job))
print(json.dumps(row.record()))
"""
    proc = _run_with_report(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["main_loop"] and record["loop_instructions"] > 0, record
    assert record["mma"] in ("mma.sync", "wgmma") and record["loop_mma"] == record["mma"], record
    assert record["loop_bytes_source"] == "tile shape" and record["loop_bytes"] > 0
    assert 0 < record["issue_bound_fraction"] <= 1, record
    expected = kernel_report_target_fraction(record)
    assert record["issue_bound_fraction"] == pytest.approx(expected, abs=1e-3)


def _compiled_records(label: str, kernel: str) -> list[dict]:
    """The kernel report's records of the launches in the case `label` of the kernels whose names start with
    `kernel`, compiled for sm_90 and sm_100 in a subprocess (compile only, no cache)."""
    code = f"""
(case,) = [c for c in kr.all_cases() if c.label == {label!r}]
launches = []
run, _ = case.build("meta")
with kr.recording_launches(launches):
    run()
kr._worker_init()
for launch in [l for l in launches if l.kernel.startswith({kernel!r})]:
    for target in (kr.TARGETS["sm_90"], kr.TARGETS["sm_100"]):
        job = kr.compile_job(launch, target)
        print(json.dumps(kr.Row(case, launch, target, job, kr.run_compile(job)).record()))
"""
    proc = _run_with_report(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]


def _assert_expert_gemms_issue_bound(label: str, fraction: float) -> None:
    """The case's two expert GEMMs on sm_90 and sm_100: tensor-core instructions of each target, no spills, the
    loop's bytes from its tile shape and an issue-bound fraction of at least `fraction`."""
    records = _compiled_records(label, "_moe_gemm_kernel")
    assert len(records) == 4 and {r["target"] for r in records} == {"sm_90", "sm_100"}
    for record in records:
        assert record["mma"] == {"sm_90": "wgmma", "sm_100": "tcgen05"}[record["target"]], record
        assert record["spill_bytes"] == 0 and record["loop_bytes_source"] == "tile shape", record
        assert record["issue_bound_fraction"] >= fraction, record


@pytest.mark.slow
def test_int4_expert_gemms_are_bound_by_bandwidth_on_hopper_and_blackwell() -> None:
    """Kimi K2.5's batch-1 INT4 expert GEMMs under TP 8 (gate_up split over K, then down), compiled for sm_90 and
    sm_100: their main loops issue few enough instructions per byte of weights that instruction issue alone would
    allow at least 80% of HBM bandwidth (wgmma on Hopper, tcgen05 on Blackwell), without spilling."""
    _assert_expert_gemms_issue_bound("kimi-tp8 moe w4a16 t1", 0.8)


@pytest.mark.slow
@pytest.mark.parametrize("label, programs", [("kimi-ep8 mla decode b1 ctx32k eager", 132),
                                             ("kimi-ep8 mla verify b8 x 4 tokens ctx32k tree", 8 * 4 * 132),
                                             ("kimi-tp8 mla verify b8 x 4 tokens ctx128k tree", 8 * 1 * 132)])
def test_latent_attention_is_bound_by_bandwidth_on_hopper_and_blackwell(label: str, programs: int) -> None:
    """MLA at Kimi K2.5's shapes through the latent split kernel (64 heads a rank: decodes and draft trees; 8 under
    TP 8: draft trees), compiled for sm_90 and sm_100: one program per (row block of 64 token x head rows, slice),
    so each latent tile is read once for every head and value channel (the grid: sequences x row blocks x the 132
    slices an H200 gets), and its main loop issues few enough instructions per byte of cache that issue alone would
    allow at least 80% of HBM bandwidth, without spilling."""
    records = _compiled_records(label, "_latent_partial_kernel")
    assert len(records) == 2 and {r["target"] for r in records} == {"sm_90", "sm_100"}
    for record in records:
        assert record["mma"] == {"sm_90": "wgmma", "sm_100": "tcgen05"}[record["target"]], record
        assert record["programs"] == programs, record
        assert record["spill_bytes"] == 0 and record["loop_bytes_source"] == "tile shape", record
        assert record["issue_bound_fraction"] >= 0.8, record


@pytest.mark.slow
def test_mla_kernels_compile_for_an_fp8_cache() -> None:
    """MLA decode over an FP8 cache (e4m3 latent rows with their scale, the rotary key in bf16 after them), through
    the decode kernel (8 heads) and the latent kernel (64), compiled for sm_90: the tile loads choose FP8 or plain
    rows by a constexpr branch, which Triton's compiler (unlike its interpreter) does not end at a `return`."""
    code = f"""
import torch
from reasoning_engine.kernels import triton_attention as ta
kr._worker_init()
for heads, kernel in ((8, "_decode_partial_kernel"), (64, "_latent_partial_kernel")):
    fb, blocks = kr._decode_batch(1, 1024, False, "meta")
    kv = torch.empty(blocks, kr.BLOCK_SIZE, 512 + 2 + 64 * 2, dtype=torch.uint8, device="meta")
    q = torch.empty(1, heads, 576, dtype=torch.bfloat16, device="meta")
    launches = []
    with kr.recording_launches(launches):
        ta.paged_latent_attention(q, kv, 512, fb, ta.prepare_attention(fb, kr.BLOCK_SIZE), 0.1)
    (launch,) = [l for l in launches if l.kernel == kernel]
    assert launch.kwargs["FP8"] is True
    result = kr.run_compile(kr.compile_job(launch, kr.TARGETS["sm_90"]))
    print(json.dumps({{"kernel": kernel, "registers": result["registers"]}}))
"""
    proc = _run_with_report(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    assert [r["kernel"] for r in records] == ["_decode_partial_kernel", "_latent_partial_kernel"]
    assert all(0 < r["registers"] <= 255 for r in records), records


@pytest.mark.slow
def test_expert_sort_of_a_kimi_batch_of_8_does_not_spill() -> None:
    """Kimi TP 8 at batch 8: 64 pairs over 384 experts sorted in one program, whose [experts, pairs] comparison
    is spread over enough warps to stay in registers on sm_90 and sm_100."""
    records = _compiled_records("kimi-tp8 moe w4a16 t8", "_align_one_program_kernel")
    assert len(records) == 2
    for record in records:
        assert record["spill_bytes"] == 0, record


@pytest.mark.slow
def test_mxfp4_expert_gemms_convert_codes_in_packed_registers() -> None:
    """gpt-oss-120b's batch-1 MXFP4 expert GEMMs (gate_up and down, split over K), compiled for sm_90 and sm_100:
    e2m1 codes become bfloat16 through bit operations on packed words and paired multiplies (no per-weight float
    conversion), so issue alone would allow at least half of HBM bandwidth (it allowed 20% on Hopper and 12% on
    Blackwell when each code was converted on its own), with wgmma / tcgen05 and no spills."""
    _assert_expert_gemms_issue_bound("gpt-oss-120b moe mxfp4 t1", 0.5)


@pytest.mark.slow
def test_expert_sort_of_a_gpt_oss_batch_of_64_does_not_spill() -> None:
    """gpt-oss at 64 tokens: 256 pairs over 128 experts, too many for one program's [experts, pairs] and [pairs,
    pairs] comparisons held together (they spilled 1.4 KB a thread), so the sort takes the chunked launches, which
    compile without spills on sm_90 and sm_100."""
    records = _compiled_records("gpt-oss-120b moe mxfp4 t64", "_align_")
    assert records and {r["target"] for r in records} == {"sm_90", "sm_100"}
    for record in records:
        assert record["spill_bytes"] == 0, record


def kernel_report_target_fraction(record: dict) -> float:
    """The issue model by hand: bytes per CTA iteration over its warp-instructions, 4 per SM-cycle, H200's SMs and
    clock, over its bandwidth."""
    rate = record["loop_bytes"] / (record["loop_instructions"] * record["num_warps"]) * 4 * 132 * 1.98e9
    return min(1.0, rate / 4.8e12)


def test_a_wait_loop_moving_no_memory_is_not_the_main_loop(kernel_report: ModuleType) -> None:
    """A one-pass kernel whose only backward branch spins on a barrier (sm_100 waits so for a tcgen05 mma) is one
    pass counted whole, not a loop of a few instructions moving nothing (an issue-bound fraction of 0)."""
    waiting = SASS.replace("@!P2 BRA 0x100", "@!P2 BRA 0x170").replace("BRA.U !UP0, 0x10", "@!P3 BRA 0x170")
    waiting = waiting.replace("/*0170*/", "/*0170*/                   SYNCS.PHASECHK.TRANS64 P3, [UR4], RZ ;\n        /*0178*/")
    loop = kernel_report.sass_main_loop(waiting)
    assert not loop["loop"] and loop["global_bytes"] == 2 * 16 * 32 + 16 * 32


def test_deepseek_v4_flash_cases(kernel_report: ModuleType) -> None:
    """V4-Flash's attention per layer kind on 64 and 8 heads, decode and a chunk, and the DSA indexer at its index
    shapes; the keys a query reads: window 128, CSA's top 512 of the 4:1 rows, every 128:1 row."""
    ops = {(c.model, c.op) for c in kernel_report.all_cases()}
    for model in ("v4-flash", "v4-flash-tp8"):
        assert {(model, f"v4 {kind} attention") for kind in ("sliding", "csa", "hca")} <= ops
    assert ("v4-flash", "v4 csa indexer (dsa kernel)") in ops
    v4 = kernel_report.V4_FLASH
    assert kernel_report._v4_keys(v4, "csa", 131071) == (128, 512)
    assert kernel_report._v4_keys(v4, "hca", 131071) == (128, 1024)
    assert kernel_report._v4_keys(v4, "sliding", 5) == (6, 0)


@pytest.mark.slow
def test_compiles_the_deepseek_v4_attention_kernel(tmp_path: Path) -> None:
    """The compressed-attention kernel at V4-Flash's shapes (head_dim 512, 64 heads, CSA's 512 picked rows) compiles
    for sm_90 and sm_100 without spills, and its main loop streams the gathered rows (an issue-bound fraction)."""
    proc = _run(tmp_path, "--only", "^v4-flash v4 csa attention b8 ctx128k$", "--json", "--no-write", "--no-launch-count")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])["records"]
    assert {r["target"] for r in records} == {"sm_90", "sm_100"}
    for r in records:
        assert r["kernel"] == "_compressed_attention_kernel" and "error" not in r, r
        assert r["spill_bytes"] == 0 and r["shared_bytes"] <= r["shared_limit"], r
        assert r["main_loop"] and r["loop_bytes_source"] == "tile shape" and 0 < r["issue_bound_fraction"] <= 1, r
