#!/usr/bin/env bash
# llama.cpp as a side-by-side peer for benchmarks/cpu_decode.py, everything outside the repo under $WORK:
#   1. builds llama-cpp-python from its source distribution (its vendored llama.cpp, native CPU flags);
#   2. writes the benchmark's random Llama checkpoint (cpu_decode.py --keep) and, in a folder of links for the
#      converter, a small SentencePiece tokenizer.model, which llama.cpp's converter requires (the benchmark feeds
#      token ids, so the vocabulary's content does not matter; the converter pads it to the checkpoint's 16,000
#      entries);
#   3. converts it with llama.cpp's own convert_hf_to_gguf.py to an f32 GGUF (same weights, same precision);
#   4. runs cpu_decode.py with --gguf: ours, transformers and llama.cpp in one run.
# Usage: bash benchmarks/llama_cpp_peer.sh [threads [cpu_decode.py options, e.g. --compile --rounds 4]]
# (the first run builds for ~10 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
shift || true
PY=${PYTHON:-.venv/bin/python}
WORK=${WORK:-/tmp/llama_cpp_peer}
mkdir -p "$WORK"

# The source distribution carries the converter too, so it is fetched even when the package is already built.
if ! ls "$WORK"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$WORK"
fi
if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_NATIVE=ON" \
        "$PY" -m pip install -v "$WORK"/llama_cpp_python-*.tar.gz
fi
"$PY" -m pip install -q sentencepiece
SRC=$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -1 || true)
if [ -z "$SRC" ]; then
    tar xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
    SRC=$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp | head -1)
fi

CKPT="$WORK/checkpoint"
if [ ! -f "$CKPT/config.json" ]; then
    "$PY" - "$CKPT" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from cpu_decode import build_checkpoint
build_checkpoint(Path(sys.argv[1]))
EOF
fi
# The converter reads the checkpoint plus tokenizer.model from one folder; our engine and transformers would try to load
# that tokenizer too, so the converter gets its own folder of links.
CONV="$WORK/convert_input"
mkdir -p "$CONV"
ln -sf "$CKPT/config.json" "$CKPT/model.safetensors" "$CONV/"
if [ ! -f "$CONV/tokenizer.model" ]; then
    "$PY" - "$CONV" <<'EOF'
import random
import sys
import sentencepiece as spm
rng = random.Random(0)
words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(3000)]
lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(5000)]
spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=f"{sys.argv[1]}/tokenizer",
                               vocab_size=1000, model_type="bpe")
EOF
fi
GGUF="$WORK/model-f32.gguf"
if [ ! -f "$GGUF" ]; then
    PYTHONPATH="$SRC/gguf-py" "$PY" "$SRC/convert_hf_to_gguf.py" "$CONV" --outtype f32 --outfile "$GGUF"
fi
"$PY" benchmarks/cpu_decode.py --threads "$THREADS" --keep "$CKPT" --gguf "$GGUF" "$@"
