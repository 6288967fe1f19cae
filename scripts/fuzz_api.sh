#!/usr/bin/env bash
# The full schemathesis run: serve the bundled model, fuzz every operation of /openapi.json with
# schemathesis' CLI (valid and schema-breaking bodies, examples, coverage and fuzzing phases) with its default checks:
# no 5xx, every status, content type, header and body as documented (errors included: OpenAI's error object, or
# Anthropic's on /v1/messages), schema-breaking data refused, 405s with `Allow`. Left out: "every schema-valid request
# is accepted", since the rules across fields and messages (a tool result answers a call, the prompt fits the
# context) have no JSON Schema. The suite runs a bounded version of this against the fake engine
# (tests/server/test_openapi.py).
#   usage: scripts/fuzz_api.sh [CASES_PER_OPERATION (default 700)] [PORT (default 8765)]
# Writes the JUnit report and the CLI's summary to artifacts/fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-700}
port=${2:-8765}
out=artifacts/fuzz
mkdir -p "$out"
# a short context bounds each fuzzed generation (the bundled model at ~100 tokens/s on two cores)
OMP_NUM_THREADS=1 .venv/bin/reasoning-engine serve --host 127.0.0.1 --port "$port" --max-model-len 512 \
  --log-level warning >"$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited:"; tail -20 "$out/server.log"; exit 1; }
  sleep 1
done
.venv/bin/st run "http://127.0.0.1:$port/openapi.json" \
  --exclude-checks positive_data_acceptance \
  --max-examples "$cases" --workers 2 --seed 27 --suppress-health-check all \
  --report junit --report-dir "$out" | tee "$out/summary.txt"
