#!/usr/bin/env bash
# Everything we do with a lent GPU, in one call of at most ~9.5 minutes (the device tool's README: few, full calls):
#  1. the kernel tests run compiled on the GPU (correctness only, no timing), then the GPU-only engine tests, while
#     benchmarks/kernel_report.py compiles every Triton kernel for sm_90 and sm_100 on the CPU cores (its cache);
#  2. then, with the GPU otherwise idle, kernel_report.py --measure times every decode-path op at Kimi K2.5 and
#     Moonlight shapes (batch 1, 8, 64; contexts 1k, 32k, 128k; eager and CUDA-graph launch sizes) against its
#     modelled bytes, and lists the registers and spills of the binaries the driver loaded;
#  3. benchmarks/gpu_check.py times the kernels against torch and end-to-end decode, then the adaptive engine against
#     static speculation settings at 1, 16 and 32 requests (issue #25's GPU targets), each section while budget lasts.
# Results go to $OUT (or ./artifacts/gpu_session): kernel_report_<date>.md (+ .json, the records), gpu_check_<date>.md
# and kernel_tests.txt.
#
#   scripts/gpu_session.sh [CHECK_BUDGET_S] [REPORT_BUDGET_S]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-artifacts/gpu_session}
CHECK_BUDGET_S=${1:-270}
REPORT_BUDGET_S=${2:-80}
REPORT_CACHE=/tmp/kernel_report_cache
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

start=$(date +%s)
# compile-only (its own processes, TRITON_INTERPRET=0): fills the cache the measuring run below reads
timeout 170 python3 benchmarks/kernel_report.py --jobs 4 --cache-dir "$REPORT_CACHE" --no-write > /dev/null \
    2> "$OUT/kernel_report_compile.log" &
timeout 140 python3 -m pytest -q -p no:cacheprovider tests/kernels -n 4 > "$OUT/kernel_tests.txt" 2>&1
echo "kernel tests exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/kernel_tests.txt"
# The GPU-only engine tests: captured CUDA graphs vs eager, packed-expert peak memory.
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graph.py tests/models/test_packed_experts.py \
    -k "gpu or peak" -rA >> "$OUT/kernel_tests.txt" 2>&1
echo "GPU engine tests exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/kernel_tests.txt"
tail -3 "$OUT/kernel_tests.txt"
wait
ls -la "$OUT"

timeout $(( REPORT_BUDGET_S + 60 )) python3 benchmarks/kernel_report.py --measure --budget-s "$REPORT_BUDGET_S" \
    --jobs 8 --cache-dir "$REPORT_CACHE" --out "$OUT" --json > "$OUT/kernel_report.json" 2> "$OUT/kernel_report.log"
echo "kernel report exit $? after $(( $(date +%s) - start )) s"; grep -A3 "^## Targets" -m1 "$OUT"/kernel_report_*.md | tail -2

timeout $(( CHECK_BUDGET_S + 60 )) python3 benchmarks/gpu_check.py --skip-tests --budget-s "$CHECK_BUDGET_S" \
    --results-dir "$OUT" 2>&1 | tee "$OUT/gpu_check.log" | tail -c 20000
echo "session done after $(( $(date +%s) - start )) s"
