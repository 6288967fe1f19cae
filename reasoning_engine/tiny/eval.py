"""Accuracy of the tiny model on fresh problems: ``python -m reasoning_engine.tiny.eval [--engine ...]``.

Problems come from the training generators with a different seed (100 per task by default) and are decoded greedily,
thinking on (``--thinking off`` asks without it). ``--engine reasoning_engine`` runs our own engine (``LLM.chat`` with
the checkpoint's chat template); ``--engine transformers`` runs Hugging Face's DeepseekV3ForCausalLM as an independent
reference.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reasoning_engine.tiny import BUNDLED_MODEL_DIR
from reasoning_engine.tiny.chat_format import (
    IM_END,
    PAD,
    THINK_END,
    TOOL_CALL_ARG_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
)
from reasoning_engine.tiny.data import EVAL_SEED, Sample, check_answer, eval_samples

MAX_NEW_TOKENS = 200
TARGETS = {"addition": 0.95, "subtraction": 0.95, "comparison": 0.95, "multiplication": 0.90, "sorting": 0.90,
           "letters": 0.90, "calculator": 0.90}
_CALL = re.compile(re.escape(TOOL_CALL_BEGIN) + r"(.*?)" + re.escape(TOOL_CALL_ARG_BEGIN) + r"(.*?)"
                   + re.escape(TOOL_CALL_END), re.S)


@dataclass
class Parsed:
    """A completion split the way the server's kimi_k2 parsers split it."""

    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]]
    has_thinking: bool


def parse_completion(text: str) -> Parsed:
    """Split generated text (after the ``<think>`` of the prompt) into reasoning, answer and Kimi tool calls."""
    for marker in (IM_END, PAD):
        text = text.split(marker)[0]
    if THINK_END in text:
        reasoning, rest = text.split(THINK_END, 1)
    elif TOOL_CALLS_BEGIN in text:
        reasoning, rest = text.split(TOOL_CALLS_BEGIN, 1)
        rest = TOOL_CALLS_BEGIN + rest
    else:
        reasoning, rest = "", text
    content = rest.split(TOOL_CALLS_BEGIN)[0]
    calls = []
    for call_id, args in _CALL.findall(rest):
        name = call_id.strip().removeprefix("functions.").rsplit(":", 1)[0]
        calls.append({"id": call_id.strip(), "name": name, "arguments": args})
    return Parsed(reasoning.strip(), content.strip(), calls, bool(reasoning.strip()) and THINK_END in text)


def generate_reasoning_engine(model_dir: Path, samples: list[Sample]) -> list[str]:
    """Our engine: each sample's conversation through LLM.chat (template rendered by the engine), greedy."""
    from reasoning_engine import LLM, SamplingParams

    llm = LLM(str(model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, skip_special_tokens=False)
    groups: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[(json.dumps(s.tools), s.thinking)].append(i)
    out: dict[int, str] = {}
    for (tools_json, thinking), idx in groups.items():
        results = llm.chat([samples[i].messages for i in idx], params, tools=json.loads(tools_json),
                           chat_template_kwargs={"thinking": thinking})
        for i, r in zip(idx, results):
            out[i] = r.outputs[0].text
    return [out[i] for i in range(len(samples))]


def generate_transformers(model_dir: Path, samples: list[Sample], batch_size: int = 50) -> list[str]:
    """Reference: transformers' DeepseekV3ForCausalLM, float32, left-padded batched greedy decoding."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False,
                                       thinking=s.thinking) for s in samples]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    texts: dict[int, str] = {}
    for start in range(0, len(order), batch_size):
        idx = order[start: start + batch_size]
        enc = tok([prompts[i] for i in idx], return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for row, i in enumerate(idx):
            texts[i] = tok.decode(gen[row, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    return [texts[i] for i in range(len(samples))]


def evaluate(model_dir: Path, engine: str, per_task: int, seed: int, show: int = 0,
             thinking: bool = True) -> dict[str, dict[str, float]]:
    """Per-task accuracy and share of answers preceded by a thinking section."""
    samples = eval_samples(per_task, seed, thinking)
    generate = generate_reasoning_engine if engine == "reasoning_engine" else generate_transformers
    texts = generate(model_dir, samples)
    stats: dict[str, dict[str, float]] = defaultdict(lambda: {"n": 0, "correct": 0, "thinking": 0})
    shown: dict[str, int] = defaultdict(int)
    for s, text in zip(samples, texts):
        parsed = parse_completion(text)
        ok = check_answer(s, parsed.content, parsed.tool_calls)
        st = stats[s.task]
        st["n"] += 1
        st["correct"] += ok
        st["thinking"] += parsed.has_thinking
        if not ok and shown[s.task] < show:
            shown[s.task] += 1
            print(f"--- {s.task} wrong: {s.messages[-1]['content']!r}\n{text}")
    return {task: {"accuracy": st["correct"] / st["n"], "thinking": st["thinking"] / st["n"], "n": st["n"]}
            for task, st in stats.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL_DIR)
    parser.add_argument("--engine", choices=["reasoning_engine", "transformers"], default="reasoning_engine")
    parser.add_argument("--per-task", type=int, default=100)
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("--show-failures", type=int, default=0, help="print up to N wrong completions per task")
    parser.add_argument("--thinking", choices=["on", "off"], default="on",
                        help="off: ask without thinking (the reply shows its working; targets apply to on)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    ns = parser.parse_args(argv)
    start = time.time()
    thinking = ns.thinking == "on"
    results = evaluate(ns.model, ns.engine, ns.per_task, ns.seed, ns.show_failures, thinking)
    print(f"{'task':<18}{'accuracy':>9}{'target':>8}{'thinking':>10}")
    for task, r in results.items():
        target = TARGETS.get(task) if thinking else None
        mark = "" if target is None else (" ok" if r["accuracy"] >= target else " MISS")
        print(f"{task:<18}{r['accuracy']:>9.0%}{'' if target is None else f'{target:.0%}':>8}"
              f"{r['thinking']:>10.0%}{mark}")
    print(f"engine {ns.engine}, {ns.per_task} problems per task, seed {ns.seed}, thinking {ns.thinking}, "
          f"{time.time() - start:.0f}s")
    if ns.json:
        ns.json.write_text(json.dumps({"engine": ns.engine, "per_task": ns.per_task, "seed": ns.seed,
                                       "thinking": ns.thinking, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
