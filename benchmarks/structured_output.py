"""Structured output on the bundled model: how many answers parse and validate, and what the grammar costs in tok/s.

200 generated schemas (schema_gen.py: nested objects, arrays with item bounds, enums, numbers with ranges, optional
fields, strings with patterns), one chat prompt each with thinking on (the model thinks, then the constraint starts
after `</think>`): the share of answers that parse as JSON and validate against their schema (jsonschema). Then
decode throughput, output tokens per second of wall time, with a schema and without one (same prompts, each free
request decoding as many tokens as its constrained run did), at batch 1 and batch 32, in alternating rounds so both see the same machine load; the ratio of the
medians is the figure (CPU timings are noisy).

    python benchmarks/structured_output.py [--schemas 200] [--rounds 3] [--out benchmarks/results/...json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from schema_gen import generate_schemas

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reasoning_engine import LLM, SamplingParams  # noqa: E402


def prompt(llm: LLM, schema: dict[str, Any]) -> str:
    """A short request naming the fields: the tiny model cannot read a schema, and the grammar enforces it anyway."""
    message = f"Reply in JSON with {', '.join(schema['properties'])}."
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)


def answer_text(llm: LLM, token_ids: list[int]) -> str | None:
    end = llm.engine.think_end_id
    if end not in token_ids:
        return None
    return llm.tokenizer.decode(token_ids[token_ids.index(end) + 1:], skip_special_tokens=True)


def validity(llm: LLM, cases: list[tuple[dict[str, Any], Any]], max_tokens: int) -> dict[str, Any]:
    import jsonschema

    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs={"json": schema})
              for schema, _ in cases]
    t0 = time.perf_counter()
    outs = llm.generate([prompt(llm, schema) for schema, _ in cases], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    valid, failures, reasons = 0, [], {}
    for (schema, _), out in zip(cases, outs):
        sample = out.outputs[0]
        reasons[sample.finish_reason] = reasons.get(sample.finish_reason, 0) + 1
        text = answer_text(llm, sample.token_ids)
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except Exception as e:  # noqa: BLE001 - any failure is a miss, reported
            failures.append({"finish_reason": sample.finish_reason, "answer": text, "error": str(e)[:200]})
    return {"schemas": len(cases), "valid": valid, "valid_pct": 100.0 * valid / len(cases),
            "finish_reasons": reasons, "seconds": seconds, "failures": failures[:5]}


def throughput(llm: LLM, prompts: list[str], params: list[SamplingParams], batch: int) -> tuple[float, list[int]]:
    """Output tokens per second of wall time for `prompts` run `batch` at a time, and each output's length."""
    lengths: list[int] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        outs = llm.generate(prompts[start:start + batch], params[start:start + batch], use_tqdm=False)
        lengths += [len(o.outputs[0].token_ids) for o in outs]
    return sum(lengths) / (time.perf_counter() - t0), lengths


def grammar_share(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> dict[str, float]:
    """Share of the wall time spent on the grammar (filling and unpacking masks, walking drafts, advancing
    matchers), timed inside one constrained batch: both sides see the same machine load, so unlike the tok/s ratio
    it stays meaningful on a busy CPU. The tok/s ratio it predicts is 1 - share."""
    from reasoning_engine.engine.model_runner import ModelRunner
    from reasoning_engine.structured.matcher import StructuredMatcher

    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    originals = {(ModelRunner, "_grammar_bitmask"): ModelRunner._grammar_bitmask,
                 (ModelRunner, "_allowed"): ModelRunner._allowed, (StructuredMatcher, "accept"): StructuredMatcher.accept}
    for (owner, name), fn in originals.items():
        setattr(owner, name, timed(fn))
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"share": spent[0] / wall, "grammar_seconds": spent[0], "wall_seconds": wall, "tokens": tokens,
            "grammar_us_per_token": spent[0] / tokens * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-validity", action="store_true", help="throughput only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(max_model_len=1024)
    cases = generate_schemas(args.schemas, seed=0)
    t0 = time.perf_counter()
    for schema, _ in cases:
        llm.engine.grammars.compile(SamplingParams(structured_outputs={"json": schema}).structured_outputs)
    compile_ms = (time.perf_counter() - t0) * 1e3 / len(cases)
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "compile_ms_mean": compile_ms,
                              "max_tokens": args.max_tokens}
    if not args.skip_validity:
        result["validity"] = validity(llm, cases, args.max_tokens)
        print(json.dumps({k: v for k, v in result["validity"].items() if k != "failures"}), flush=True)
    for batch in (1, 32):
        chosen = cases[:max(batch, 8)]  # batch 1: eight requests, one after the other
        prompts = [prompt(llm, schema) for schema, _ in chosen]
        constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": schema})
                       for schema, _ in chosen]
        _, lengths = throughput(llm, prompts, constrained, batch)  # warm-up, and the lengths the free run matches
        # the same prompts decoding the same number of tokens, free: equal work, only the grammar differs
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        with_schema, without = [], []
        for _ in range(args.rounds):
            with_schema.append(throughput(llm, prompts, constrained, batch)[0])
            without.append(throughput(llm, prompts, free, batch)[0])
        row = {"with_schema_tok_s": statistics.median(with_schema), "without_tok_s": statistics.median(without),
               "rounds_with": with_schema, "rounds_without": without}
        row["ratio"] = row["with_schema_tok_s"] / row["without_tok_s"]
        row["grammar_share"] = grammar_share(llm, prompts, constrained)
        result[f"batch_{batch}"] = row
        print(f"batch {batch}: {row['with_schema_tok_s']:.1f} tok/s with a schema, {row['without_tok_s']:.1f} "
              f"without: {row['ratio']:.2f}x; grammar share of the constrained run's wall time "
              f"{100 * row['grammar_share']['share']:.1f}%", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
