#!/usr/bin/env bash
# Everything we do with a lent GPU, in one device call (600 s at most), the numbers that matter first. Each stage runs
# under its own `timeout`; the limits below, with each stage's kill grace, sum to 540 s at most
# (tests/bench/test_gpu_session.py checks), and every program writes its results to $OUT as they are measured, so a
# stage cut off at its limit keeps what it measured:
#  1. benchmarks/kernel_report.py --measure: every Triton kernel compiled ahead of time for sm_90 on all CPU cores
#     (registers, spills, shared memory, each main loop's instructions, mma kind and issue-bound bandwidth fraction
#     from its SASS; this also fills Triton's cache for the launches after it), the kernels one decode step launches
#     per MoE layer (benchmarks/launch_count.py on the GPU, ~20-30 s: the summary's launches_per_moe_layer), then every
#     decode-path op timed at Kimi K2.5 and Moonlight shapes (MLA decode and the MoE GEMMs first) against its modelled
#     bytes, and the registers of the binaries the driver loaded;
#  2. benchmarks/gpu_check.py: the copy and matmul ceilings, then batch-1 end-to-end decode of the Moonlight-shaped
#     model (bf16 experts, CUDA graphs; within its own cap) and transformers' batch-1 rate beside it, then the kernel
#     table, greedy parity, the adaptive engine against static speculation and the other decode variants, each while
#     the budget lasts;
#  3. last, scripts/gpu_kernel_tests.txt: each kernel's tests at a few shapes and the GPU-only engine tests (CUDA graphs =
#     eager for decode and verification steps), compiled for the GPU.
# Sizing (16 CPU cores on the GPU machine). Stage 1: 76 distinct sm_90 kernel variants; compiled here on CPU they took
# 1.2 s each on average, 11.5 s at most (_sample_kernel), so about 90 CPU-seconds: 15-25 s on 16 cores with the
# workers' imports, then --measure's budget, imports and the final writes. Stage 3: the listed tests compile 93
# distinct kernel variants (the whole of tests/kernels: 368), about 15 s on 8 workers, plus the workers' imports.
# Results in $OUT (default ./artifacts/gpu_session): kernel_report_<gpu>_<date>.md (+ kernel_report.json, the
# records), gpu_check_<date>.md (+ gpu_check.log), kernel_tests.txt, nvidia_smi.txt.
#
#   scripts/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-artifacts/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRITON_DEFAULT_FP_FUSION=1  # Triton keys its cache by it: the same value in every stage shares compiled kernels
unset TRITON_INTERPRET

# stage limits, seconds (each `timeout` below names one of them and KILL_S: SIGKILL that long after SIGTERM)
KILL_S=5
SETUP_S=20    # nvidia-smi; one import of torch, triton and transformers (which also warms the page cache)
REPORT_S=160  # kernel_report: imports and capture ~10 s, sm_90 compiles ~25 s, launch count ~30 s, --measure budget
CHECK_S=265   # gpu_check: imports ~10 s before its budget starts, the budget, the last section's overrun
TESTS_S=75    # the kernel test subset: 8 workers' imports, ~15 s of compiles, the tests themselves

start=$(date +%s)
stage() { echo "== $1 exit $2 after $(( $(date +%s) - start )) s"; }

timeout -k "$KILL_S" "$SETUP_S" bash -c '
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
    python3 -c "import torch, triton, transformers as t; print(\"torch\", torch.__version__, \"triton\",
                                                                 triton.__version__, \"transformers\", t.__version__)"
' 2>&1 | tee "$OUT/nvidia_smi.txt"
stage setup $?

timeout -k "$KILL_S" "$REPORT_S" python3 benchmarks/kernel_report.py --measure --targets sm_90 --jobs "$(nproc)" \
    --budget-s $(( REPORT_S - 100 )) --out "$OUT" --json > "$OUT/kernel_report.json" 2> "$OUT/kernel_report.log"
stage "kernel report" $?
grep -A4 -m1 "^## Targets" "$OUT"/kernel_report_*.md | tail -1  # the sm_90 row: PASS or FAIL
grep -A2 -m1 "^## Kernels per decode step" "$OUT"/kernel_report_*.md | tail -1  # launches per MoE layer

timeout -k "$KILL_S" "$CHECK_S" python3 benchmarks/gpu_check.py --skip-tests --budget-s $(( CHECK_S - 25 )) \
    --results-dir "$OUT" > "$OUT/gpu_check.log" 2>&1
stage "gpu check" $?
grep -A12 -m1 "^## Targets" "$OUT"/gpu_check_*.md

mapfile -t KERNEL_TESTS < <(grep -v '^#' scripts/gpu_kernel_tests.txt | grep .)
timeout -k "$KILL_S" "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -n 8 -rfEs "${KERNEL_TESTS[@]}" \
    > "$OUT/kernel_tests.txt" 2>&1
stage "kernel tests" $?
tail -3 "$OUT/kernel_tests.txt"
ls -la "$OUT"
