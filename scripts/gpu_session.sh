#!/usr/bin/env bash
# Everything we do with a lent GPU, in one call of at most ~9.5 minutes (the device tool's README: few, full calls):
#  1. train the bundled tiny reasoner on the GPU (two learning-rate/batch variants side by side; each ends its
#     schedule by --max-minutes) while the kernel tests run compiled on the same GPU (correctness only, no timing)
#     and benchmarks/kernel_report.py compiles every Triton kernel for sm_90 and sm_100 on the CPU cores (its cache);
#  2. then, with the GPU otherwise idle, kernel_report.py --measure times every decode-path op at Kimi K2.5 and
#     Moonlight shapes (batch 1, 8, 64; contexts 1k, 32k, 128k; eager and CUDA-graph launch sizes) against its
#     modelled bytes, and lists the registers and spills of the binaries the driver loaded;
#  3. benchmarks/gpu_check.py times the kernels against torch and end-to-end decode.
# Results go to $OUT (or ./artifacts/gpu_session): kernel_report_<date>.md (+ .json, the records), gpu_check_<date>.md,
# kernel_tests.txt, and tiny.tgz split in 15 MB parts (the tool returns files of at most 16 MiB).
#
#   scripts/gpu_session.sh [TRAIN_MINUTES] [CHECK_BUDGET_S] [REPORT_BUDGET_S]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-artifacts/gpu_session}
TRAIN_MINUTES=${1:-2.8}
CHECK_BUDGET_S=${2:-210}
REPORT_BUDGET_S=${3:-80}
REPORT_CACHE=/tmp/kernel_report_cache
mkdir -p "$OUT" /tmp/tiny
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

train() {  # name tokens_per_batch lr pool_size
    timeout 240 python3 -m reasoning_engine.tiny.train --device cuda --steps 100000 --max-minutes "$TRAIN_MINUTES" \
        --tokens-per-batch "$2" --lr "$3" --warmup 150 --pool-size "$4" --data-workers 5 \
        --out-dir "/tmp/tiny/$1" --log-file "/tmp/tiny/$1_log.csv" > "/tmp/tiny/$1.out" 2>&1
    echo "train $1 exit $?" >> /tmp/tiny/status.txt
}
start=$(date +%s)
train a 65536 3e-3 8192 &
train b 32768 2e-3 4096 &
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
echo "training done after $(( $(date +%s) - start )) s"; cat /tmp/tiny/status.txt
for v in a b; do tail -c 400 "/tmp/tiny/$v.out"; echo; tail -2 "/tmp/tiny/${v}_log.csv"; done
tar czf /tmp/tiny.tgz -C /tmp tiny && split -b 15m /tmp/tiny.tgz "$OUT/tiny.tgz.part-"
ls -la "$OUT"

timeout $(( REPORT_BUDGET_S + 60 )) python3 benchmarks/kernel_report.py --measure --budget-s "$REPORT_BUDGET_S" \
    --jobs 8 --cache-dir "$REPORT_CACHE" --out "$OUT" --json > "$OUT/kernel_report.json" 2> "$OUT/kernel_report.log"
echo "kernel report exit $? after $(( $(date +%s) - start )) s"; grep -A3 "^## Targets" -m1 "$OUT"/kernel_report_*.md | tail -2

timeout $(( CHECK_BUDGET_S + 60 )) python3 benchmarks/gpu_check.py --skip-tests --budget-s "$CHECK_BUDGET_S" \
    --results-dir "$OUT" 2>&1 | tee "$OUT/gpu_check.log" | tail -c 20000
echo "session done after $(( $(date +%s) - start )) s"
