"""`bench throughput`: offline generation throughput of the engine on random prompts of fixed shape, optionally
against transformers' `generate` on the same model, machine, dtype and batch size.

Prompts are random token ids (no tokenizer round trip, so lengths are exact) and every request generates exactly
`output_tokens` tokens (EOS ignored; transformers gets `min_new_tokens`), so both sides do the same work.
Each side first runs a warm-up batch of other random prompts, outside the timing (other prompts, so the engine's
prefix cache holds nothing of the measured ones).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class ThroughputResult:
    """One engine's timing on the workload."""

    engine: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tps": self.output_tps, "total_tps": self.total_tps,
                "requests_per_s": self.requests_per_s}


def random_prompts(vocab_size: int, special_ids: set[int], input_tokens: int, count: int, seed: int) -> list[list[int]]:
    """Token ids drawn uniformly from the non-special vocabulary: distinct prompts, so no prefix cache helps."""
    rng = random.Random(f"throughput:{seed}")
    allowed = [i for i in range(vocab_size) if i not in special_ids]
    return [rng.choices(allowed, k=input_tokens) for _ in range(count)]


def run_engine(model: str, prompts: list[list[int]], warmup: list[list[int]], output_tokens: int, concurrency: int,
               dtype: str | None, device: str | None, max_model_len: int, enforce_eager: bool = False) -> ThroughputResult:
    from reasoning_engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device=device, max_num_seqs=concurrency, max_model_len=max_model_len,
              enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in warmup],
                 SamplingParams(temperature=0.0, max_tokens=min(4, output_tokens), ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return ThroughputResult("reasoning-engine", len(prompts), sum(map(len, prompts)), generated, elapsed)


def run_transformers(model: str, prompts: list[list[int]], warmup: list[list[int]], output_tokens: int,
                     concurrency: int, dtype: Any, device: Any, pad_id: int) -> ThroughputResult:
    """Batches of `concurrency` prompts, left-padded (the layout decoder-only `generate` needs), one after another:
    static batching, the way a plain transformers deployment serves."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()

    def batch_generate(batch: list[list[int]], new_tokens: int) -> int:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=pad_id)
        return int((out.shape[1] - width) * len(batch))

    batch_generate(warmup, min(4, output_tokens))
    start = time.perf_counter()
    generated = sum(batch_generate(prompts[i:i + concurrency], output_tokens)
                    for i in range(0, len(prompts), concurrency))
    elapsed = time.perf_counter() - start
    return ThroughputResult("transformers", len(prompts), sum(map(len, prompts)), generated, elapsed)


def throughput(model: str, input_tokens: int, output_tokens: int, num_prompts: int, concurrency: int,
               dtype: str | None, device: str | None, compare: str | None, seed: int,
               enforce_eager: bool = False) -> dict[str, Any]:
    """Run the engine (and transformers when asked) on the same prompts; the result as a JSON-ready dict."""
    from reasoning_engine.llm import build_engine_config

    engine_config = build_engine_config(model, dtype=dtype, device=device)
    model_config = engine_config.model
    special: set[int] = set(model_config.eos_token_ids)
    tokenizer = _tokenizer(model)
    if tokenizer is not None:
        special |= set(tokenizer.all_special_ids)
    drawn = random_prompts(model_config.vocab_size, special, input_tokens, num_prompts + concurrency, seed)
    prompts, warmup = drawn[:num_prompts], drawn[num_prompts:]
    needed = input_tokens + output_tokens
    if needed > engine_config.max_model_len:
        raise ValueError(f"input + output tokens ({needed}) exceed the model's context ({engine_config.max_model_len})")
    results = [run_engine(model, prompts, warmup, output_tokens, concurrency, dtype, device, needed, enforce_eager)]
    if compare == "transformers":
        pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        results.append(run_transformers(model, prompts, warmup, output_tokens, concurrency, engine_config.dtype,
                                        engine_config.device, pad_id))
    summary: dict[str, Any] = {
        "model": model, "input_tokens": input_tokens, "output_tokens": output_tokens, "num_prompts": num_prompts,
        "concurrency": concurrency, "dtype": str(engine_config.dtype).removeprefix("torch."),
        "device": str(engine_config.device), "seed": seed, "enforce_eager": enforce_eager,
        "results": [r.as_dict() for r in results],
    }
    if len(results) == 2:
        summary["speedup_output_tps"] = results[0].output_tps / results[1].output_tps
    return summary


def _tokenizer(model: str) -> Any | None:
    """The checkpoint's tokenizer when it has one (for special ids and the pad id); random-id prompts need no more."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, KeyError):
        return None


def summary_table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"bench throughput: {summary['model']} ({summary['num_prompts']} prompts x "
                        f"{summary['input_tokens']} in / {summary['output_tokens']} out, concurrency "
                        f"{summary['concurrency']}, {summary['dtype']} on {summary['device']})", title_justify="left")
    for name in ("engine", "elapsed s", "req/s", "output tok/s", "total tok/s"):
        table.add_column(name, justify="right")
    for r in summary["results"]:
        table.add_row(r["engine"], f"{r['elapsed_s']:.2f}", f"{r['requests_per_s']:.2f}", f"{r['output_tps']:.1f}",
                      f"{r['total_tps']:.1f}")
    return table
