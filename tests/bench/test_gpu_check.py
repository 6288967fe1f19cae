"""The pure helpers of benchmarks/gpu_check.py on CPU: roofline byte counts, pytest summaries, greedy parity, budget
skipping and the kernel table's targets. The whole script's logic runs on CPU with `gpu_check.py --dry-run`."""

from __future__ import annotations

import subprocess
import sys
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
    lines = gpu_check.kernel_table([fast, slow, broken], ceil)
    assert "| 80% | memory | ≥70% BW: PASS |" in lines[2] and "| 4.0x |" in lines[2]
    assert "| 50% | memory | ≥70% BW: FAIL |" in lines[3]
    assert "RuntimeError: x" in lines[4]
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


def test_run_steps_join_the_tests_before_any_timing(gpu_check: ModuleType) -> None:
    steps = gpu_check.run_steps(skip_tests=False, skip_e2e=False)
    assert steps[:5] == ["ceilings", gpu_check.START_TESTS, "e2e greedy parity (overlaps the kernel tests)",
                         gpu_check.JOIN_TESTS, "kernel timing"]
    assert steps[5:] == ["e2e decode bf16 experts, graphs on", "e2e decode bf16 experts, graphs off", "transformers generate, batch 1",
                         "adaptive vs static speculation", "e2e decode int4 experts, graphs on",
                         "e2e decode int4 experts, graphs off"]
    assert set(steps) - {gpu_check.START_TESTS, gpu_check.JOIN_TESTS} <= set(gpu_check.SECTIONS)
    assert gpu_check.run_steps(skip_tests=True, skip_e2e=True) == ["ceilings", "kernel timing"]


def test_tensor_parallel_section_comes_last_when_asked(gpu_check: ModuleType) -> None:
    steps = gpu_check.run_steps(skip_tests=True, skip_e2e=False, tensor_parallel=True)
    assert steps[-1] == "tensor parallel" and "tensor parallel" in gpu_check.SECTIONS
    assert "tensor parallel" not in gpu_check.run_steps(skip_tests=True, skip_e2e=False)


def test_adaptive_section_runs_every_configuration_without_the_server_stack() -> None:
    """The adaptive-vs-static section on the dry-run plan (CPU, 1 and 4 requests), with the server's packages
    unimportable as on the GPU machine: a row per level, a ratio target per level, and every configuration's greedy
    outputs equal to static k=0's (float32 on CPU: speculation changes no token)."""
    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'pydantic', 'openai'):\n"
        "    sys.modules[name] = None\n"
        "import pathlib, runpy\n"
        f"module = runpy.run_path({str(SCRIPT)!r})\n"
        "report = module['Report'](pathlib.Path('unused'), [])\n"
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
