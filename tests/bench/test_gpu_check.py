"""The pure helpers of benchmarks/gpu_check.py on CPU: roofline byte counts, pytest summaries, greedy parity, budget
skipping, the kernel table's targets, the section order, and results reaching the report as they are measured (a run
killed at its time limit keeps them). The whole script's logic runs on CPU with `gpu_check.py --dry-run`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from .scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    return load_script("gpu_check")


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_active_weight_bytes_match_a_transformers_parameter_count(gpu_check: ModuleType, q_lora_rank: int | None) -> None:
    """Active parameters = all of transformers' model, less the embedding table but one row, the routed experts not
    chosen, and the norms and routing biases the count leaves out."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(gpu_check.TINY_CONFIG, q_lora_rank=q_lora_rank)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}))
    h, layers, experts = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["n_routed_experts"]
    moe_layers = layers - cfg["first_k_dense_replace"]
    total = sum(p.numel() for p in model.parameters())
    norms = layers * (2 * h + cfg["kv_lora_rank"] + (q_lora_rank or 0)) + h
    biases = sum(b.numel() for n, b in model.named_parameters() if "e_score_correction_bias" in n)
    unchosen = moe_layers * (experts - cfg["num_experts_per_tok"]) * 3 * h * cfg["moe_intermediate_size"]
    active = total - cfg["vocab_size"] * h + h - unchosen - norms - biases
    assert gpu_check.active_weight_bytes_per_token(cfg, 2.0) == pytest.approx(2 * active, rel=1e-9)
    routed = moe_layers * cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    int4 = gpu_check.active_weight_bytes_per_token(cfg, gpu_check.INT4_BYTES_PER_PARAM)
    assert int4 == pytest.approx(2 * active - routed * (2 - gpu_check.INT4_BYTES_PER_PARAM))


def test_moonlight_batch1_roofline_is_about_5_gb_per_token(gpu_check: ModuleType) -> None:
    bf16 = gpu_check.active_weight_bytes_per_token(gpu_check.MOONLIGHT_CONFIG, 2.0)
    assert 5.0e9 < bf16 < 5.4e9  # ~2.6B active parameters (Moonlight's "A3B" counts the embedding table too)


def test_summarize_pytest(gpu_check: ModuleType) -> None:
    closing = "....F..s\nFAILED tests/kernels/test_x.py::test_y - AssertionError: boom\n6 passed, 1 failed, 1 skipped, 2 errors in 3.21s\n"
    counts, failures = gpu_check.summarize_pytest(closing)
    assert counts == {"passed": 6, "failed": 1, "skipped": 1, "error": 2}
    assert failures == ["FAILED tests/kernels/test_x.py::test_y - AssertionError: boom"]
    killed = "....F...s.   [ 40%]\n......\n"  # no closing line: counted from the progress characters
    assert gpu_check.summarize_pytest(killed)[0] == {"passed": 14, "failed": 1, "error": 0, "skipped": 1}


def test_compare_tokens_forgives_only_near_ties_and_late_divergence(gpu_check: ModuleType) -> None:
    Greedy = gpu_check.Greedy
    want = [Greedy([1, 2, 3, 4], [1.0, 0.01, 1.0, 1.0]), Greedy([5, 6, 7, 8], [1.0, 1.0, 1.0, 1.0])]
    assert gpu_check.compare_tokens(want, want, 2) == (True, "all 2 sequences equal (4 tokens)")
    tie = [Greedy([1, 9, 9, 9], []), want[1]]  # diverges at token 1, where the reference's top two were 0.01 apart
    ok, text = gpu_check.compare_tokens(tie, want, 4)
    assert ok and "first divergence at token 1 (sequence 0" in text
    real = [want[0], Greedy([5, 9, 9, 9], [])]
    assert not gpu_check.compare_tokens(real, want, 4)[0]
    assert gpu_check.compare_tokens(real, want, 1)[0], "divergence after the compared prefix passes"


def test_run_section_records_errors_and_skips_past_the_budget(gpu_check: ModuleType, tmp_path: Path) -> None:
    report = gpu_check.Report(tmp_path / "r.md", ["# title"])
    budget = gpu_check.Budget(100.0)
    gpu_check.run_section(report, budget, "fine", 0, lambda: report.add("Fine", ["body"]))

    def broken() -> None:
        raise ValueError("bad | thing")

    gpu_check.run_section(report, budget, "broken", 0, broken)
    gpu_check.run_section(report, budget, "too long", 1000, lambda: None)
    statuses = [(name, status) for name, status, _ in report.statuses]
    assert statuses == [("fine", "ok"), ("broken", "error: ValueError: bad \\| thing"), ("too long", "skipped: time budget")]
    text = (tmp_path / "r.md").read_text()
    assert "| too long | skipped: time budget |" in text and "## Fine\n\nbody" in text


def test_kernel_table_marks_the_bandwidth_targets(gpu_check: ModuleType) -> None:
    ceil = gpu_check.Ceilings(copy_bytes_per_s=1e12, matmul_flops_per_s=1e15)
    fast = gpu_check.KernelRow("mla_decode", "B=1", triton_s=1.25e-6, torch_s=5e-6, nbytes=1e6, target=0.7)  # 80% of BW
    slow = gpu_check.KernelRow("moe", "T=1", triton_s=2e-6, torch_s=4e-6, nbytes=1e6, target=0.7)  # 50%
    broken = gpu_check.KernelRow("rope", "T=1", error="RuntimeError: x", target=0.7)
    lines = [gpu_check.kernel_line(row, ceil) for row in (fast, slow, broken)]
    assert "| 80% | memory | ≥70% BW: PASS |" in lines[0] and "| 4.0x |" in lines[0]
    assert "| 50% | memory | ≥70% BW: FAIL |" in lines[1]
    assert "RuntimeError: x" in lines[2]
    report = gpu_check.Report(Path("unused"), [])
    gpu_check.kernel_targets([fast, slow, broken], ceil, report)
    assert [r for _, _, r in report.targets] == ["PASS", "FAIL", "n/a"]


def test_imports_nothing_from_the_server_stack() -> None:
    """The GPU machine has no fastapi / uvicorn / pydantic / openai: the script and the engine it drives must not
    need them."""
    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'pydantic', 'openai'):\n"
        "    sys.modules[name] = None\n"
        "import runpy\n"
        f"module = runpy.run_path({str(SCRIPT)!r})\n"
        "from reasoning_engine import LLM, SamplingParams\n"
        "import reasoning_engine.models.dummy, reasoning_engine.kernels.fused_moe, reasoning_engine.kernels.attention\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_dry_run_plan_is_small(gpu_check: ModuleType) -> None:
    plan = gpu_check.Plan.make(True)
    assert plan.device == "cpu" and max(plan.batch_sizes) <= 2 and plan.e2e_config["num_hidden_layers"] == 2
    assert gpu_check.Plan.make(False).e2e_config["num_hidden_layers"] == 27


def test_kernel_tests_killed_at_their_timeout_report_progress(gpu_check: ModuleType, tmp_path: Path) -> None:
    import dataclasses

    plan = dataclasses.replace(gpu_check.Plan.make(True), test_timeout_s=1.0, test_workers=1)  # pytest cannot even import torch by then
    tests = gpu_check.KernelTests(plan, tmp_path / "tests.log")
    report = gpu_check.Report(tmp_path / "r.md", [])
    tests.join(report, gpu_check.Budget(100.0))
    assert tests.proc.returncode is not None, "the pytest process group is gone"
    _, measured, result = report.targets[0]
    assert result == "FAIL" and measured.startswith("killed after 1 s (timeout)")


def test_run_steps_put_the_batch1_decode_first_and_join_the_tests_before_any_timing(gpu_check: ModuleType) -> None:
    timed = ["e2e decode bf16 experts, graphs on", "transformers generate, batch 1", "kernel timing"]
    rest = ["adaptive vs static speculation", "e2e decode bf16 experts, graphs off", "e2e decode int4 experts, graphs on",
            "e2e decode int4 experts, graphs off"]
    assert gpu_check.run_steps(skip_tests=True, skip_e2e=False) == ["ceilings", *timed, gpu_check.PARITY, *rest]
    with_tests = gpu_check.run_steps(skip_tests=False, skip_e2e=False)
    assert with_tests == ["ceilings", gpu_check.START_TESTS, gpu_check.PARITY, gpu_check.JOIN_TESTS, *timed, *rest]
    assert set(with_tests) - {gpu_check.START_TESTS, gpu_check.JOIN_TESTS} == set(gpu_check.SECTIONS) - {"tensor parallel"}
    assert gpu_check.run_steps(skip_tests=True, skip_e2e=True) == ["ceilings", "kernel timing"]
    assert gpu_check.SECTIONS[gpu_check.FIRST_DECODE].cap_s < 300, "a slow first decode leaves time for the rest"


def test_tensor_parallel_section_comes_last_when_asked(gpu_check: ModuleType) -> None:
    steps = gpu_check.run_steps(skip_tests=True, skip_e2e=False, tensor_parallel=True)
    assert steps[-1] == "tensor parallel" and "tensor parallel" in gpu_check.SECTIONS
    assert "tensor parallel" not in gpu_check.run_steps(skip_tests=True, skip_e2e=False)


@pytest.mark.slow
def test_adaptive_section_runs_every_configuration_without_the_server_stack(tmp_path: Path) -> None:
    """The adaptive-vs-static section on the dry-run plan (CPU, 1 and 4 requests), with the server's packages
    unimportable as on the GPU machine: a row per level, a ratio target per level, and every configuration's greedy
    outputs equal to static k=0's (float32 on CPU: speculation changes no token); the table reaches the report on disk
    as each level finishes."""
    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'pydantic', 'openai'):\n"
        "    sys.modules[name] = None\n"
        "import pathlib, runpy\n"
        f"module = runpy.run_path({str(SCRIPT)!r})\n"
        f"report = module['Report'](pathlib.Path({str(tmp_path / 'r.md')!r}), [])\n"
        "module['run_adaptive'](module['Plan'].make(True), module['Budget'](300), report, rounds=1)\n"
        "print(report.render())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2
    for row, requests in zip(rows, (8, 12)):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert all(float(rate) > 0 for rate in cells[1:5])
        assert cells[-1] == f"{requests}/{requests}"
    assert proc.stdout.count("adaptive ≥ 0.95x the best static at") == 2
    assert "the static default at" not in proc.stdout  # that target is for 16 requests and more
    written = (tmp_path / "r.md").read_text()
    assert all(row in written for row in rows)


def test_kernel_rows_reach_the_file_as_they_are_measured(tmp_path: Path) -> None:
    """The kernel table is written row by row: a group that measures two rows and is then killed outright (SIGKILL,
    as a stage's `timeout -k` would) leaves both rows, and the second's bandwidth target, in the report on disk."""
    path = tmp_path / "r.md"
    code = f"""
import os, pathlib, signal, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from scripts import load_script
gc = load_script("gpu_check")

def group(plan):
    yield gc.KernelRow("first", "T=1", triton_s=1e-6, torch_s=2e-6, nbytes=1e6)
    yield gc.KernelRow("second", "T=2", triton_s=1e-6, torch_s=3e-6, nbytes=1e6, target=0.7)
    os.kill(os.getpid(), signal.SIGKILL)
    yield gc.KernelRow("third", "T=3", triton_s=1e-6, torch_s=2e-6, nbytes=1e6)

report = gc.Report(pathlib.Path({str(path)!r}), ["# check"])
gc.run_kernel_timing(gc.Plan.make(True), gc.Ceilings(1e12, 1e15), gc.Budget(100), report, groups=(group,))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    text = path.read_text()
    assert "| first | T=1 | 1.0 | 2.0 | 2.0x |" in text and "| second | T=2 | 1.0 | 3.0 | 3.0x |" in text
    assert "| second T=2 ≥ 70% of bandwidth | 100% (1.0 µs) | PASS |" in text
    assert "third" not in text and not list(tmp_path.glob(".*.tmp"))


def test_a_group_that_fails_midway_keeps_its_rows(gpu_check: ModuleType, tmp_path: Path) -> None:
    def group(plan: object):
        yield gpu_check.KernelRow("first", "T=1", triton_s=1e-6, nbytes=1e6)
        raise RuntimeError("setup of the next case")

    def later(plan: object):
        yield gpu_check.KernelRow("later", "T=1", triton_s=1e-6, nbytes=1e6)

    report = gpu_check.Report(tmp_path / "r.md", [])
    gpu_check.run_kernel_timing(gpu_check.Plan.make(True), gpu_check.Ceilings(1e12, 1e15), gpu_check.Budget(100), report,
                                groups=(group, later))
    rows = [line.split(" | ")[0] for line in report.body[gpu_check.KERNEL_TITLE] if line.startswith("| ") and "---" not in line]
    assert rows == ["| kernel", "| first", "| group", "| later"]
    assert "RuntimeError: setup of the next case" in (tmp_path / "r.md").read_text()


def test_report_targets_are_replaced_by_name(gpu_check: ModuleType) -> None:
    report = gpu_check.Report(Path("unused"), [])
    report.target("adaptive at 16", "0.90x", False)
    report.target("other", "1", True)
    report.target("adaptive at 16", "1.20x", True)  # a later round's medians
    assert report.targets == [("adaptive at 16", "1.20x", "PASS"), ("other", "1", "PASS")]


@pytest.mark.slow
def test_sigterm_keeps_the_rows_measured_and_names_the_section_it_stopped(tmp_path: Path) -> None:
    """The whole script under a stage's `timeout`: SIGTERM to its process group (the orchestrator and the section
    worker) while the kernel table is being measured. The report keeps the rows the worker wrote and records the
    section as killed, and the script exits 143."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--skip-tests", "--skip-e2e", "--budget-s", "600",
                             "--results-dir", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            reports = list(tmp_path.glob("gpu_check_dryrun_*.md"))
            if reports and "| mla_decode |" in reports[0].read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    text = reports[0].read_text()
    assert "| mla_decode | B=1 ctx=48 H=4 L=64+16 |" in text
    assert "| kernel timing | killed by SIGTERM (the caller's time limit) |" in text
    assert "| ceilings | ok |" in text and not list(tmp_path.glob(".*.tmp"))
