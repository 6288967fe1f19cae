"""scripts/gpu_session.sh without a GPU: it parses, its stages' time limits fit the 540 s a device call leaves them
(so an edit cannot make it overrun silently), its stages come in the order of what matters, and the kernel tests it
runs exist and cover every kernel."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_session.sh"
KERNEL_TESTS = REPO / "scripts" / "gpu_kernel_tests.txt"
CALL_BUDGET_S = 540  # of the device call's 600 s, the rest kept for the shell and transfers
# kernel test files the session leaves out: no kernel launched, or whole-engine runs gpu_check's parity section covers
# (test_linear_attention.py: torch references and the optional flash-linear-attention path, no Triton kernel of ours)
NOT_IN_SESSION = {"test_backends.py", "test_engine_backends.py", "test_triton_batch_invariance.py",
                  "test_linear_attention.py"}


def _commands() -> list[str]:
    """The script's command lines, comments and blank lines dropped."""
    return [line for line in SCRIPT.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_stage_limits_sum_within_the_call() -> None:
    """Every `timeout` names its stage's limit variable and the kill grace; nothing runs in the background (it would
    escape the accounting); the limits plus each stage's grace fit the budget; each program's own budget is smaller
    than its stage's limit."""
    commands = _commands()
    limits = {name: int(value) for name, value in
              (re.match(r"([A-Z_]+_S)=(\d+)\b", line).groups() for line in commands if re.match(r"[A-Z_]+_S=\d+\b", line))}
    stages = []
    for line in commands:
        if re.search(r"(^|[\s;|&(])timeout\s", line):
            match = re.search(r'\btimeout -k "\$KILL_S" "\$([A-Z_]+_S)" ', line)
            assert match, f"a timeout with a literal or unnamed limit: {line!r}"
            stages.append(match.group(1))
        assert not re.search(r"(^|[^&])&\s*$", line), f"a background command: {line!r}"
    assert stages == ["SETUP_S", "REPORT_S", "CHECK_S", "TESTS_S"], stages
    total = sum(limits[name] for name in stages) + len(stages) * limits["KILL_S"]
    assert total <= CALL_BUDGET_S, f"stages sum to {total} s"
    budgets = re.findall(r"--budget-s \$\(\( ([A-Z_]+_S) - (\d+) \)\)", SCRIPT.read_text())
    assert {name for name, _ in budgets} == {"REPORT_S", "CHECK_S"}
    assert all(0 < int(margin) < limits[name] for name, margin in budgets)


def test_numbers_that_matter_come_first() -> None:
    text = "\n".join(_commands())
    order = [text.index(marker) for marker in
             ("benchmarks/kernel_report.py --measure", "benchmarks/gpu_check.py", "scripts/gpu_kernel_tests.txt")]
    assert order == sorted(order)
    assert "--targets sm_90 " in text  # the GPU's own target only: sm_100 comes from the CPU report


def test_kernel_test_subset_is_collected_and_covers_every_kernel() -> None:
    ids = [line.strip() for line in KERNEL_TESTS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-o",
                           "addopts=", *ids], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert sorted(collected) == sorted(ids), "each line names exactly one test"
    files = {Path(test_id.split("::")[0]).name for test_id in ids if test_id.startswith("tests/kernels/")}
    kernel_files = {path.name for path in (REPO / "tests" / "kernels").glob("test_*.py")}
    assert kernel_files - files == NOT_IN_SESSION
    texts = "\n".join((REPO / "tests" / "kernels" / name).read_text() for name in files)
    modules = {path.stem for path in (REPO / "reasoning_engine" / "kernels").glob("triton_*.py")}
    assert {module for module in modules if module not in texts} == set(), "a Triton kernel module no listed test runs"
