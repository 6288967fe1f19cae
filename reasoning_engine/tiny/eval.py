"""Accuracy of the tiny model on fresh problems: ``python -m reasoning_engine.tiny.eval [--engine ...]``.

Problems come from the training generators with a different seed (100 per task by default) and are decoded greedily,
thinking on (``--thinking off`` asks without it). A checkpoint with a vision tower (kimi_k25) is also asked about
freshly drawn pictures (the circle's colour, the number of squares, the shape on the left), each sent as an
``image_pil`` part, in two drawing styles: the training program's (vision_data, tasks ``image_*``) and the held-out
program's that training never sees (vision_heldout, tasks ``heldout_*``; ``--no-heldout`` leaves them out).
``--engine reasoning_engine`` runs our own engine (``LLM.chat`` with the checkpoint's template);
``--engine transformers`` runs Hugging Face's DeepseekV3ForCausalLM (Kimi_K25ForConditionalGeneration for a kimi_k25
checkpoint) as an independent reference on the text tasks.
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
from reasoning_engine.tiny.vision_data import IMAGE_TASKS, VISION_EVAL_SEED, check_image_answer, eval_image_samples
from reasoning_engine.tiny.vision_heldout import HELDOUT_SEED, heldout_samples

MAX_NEW_TOKENS = 200
TARGETS = {"addition": 0.95, "subtraction": 0.95, "comparison": 0.95, "multiplication": 0.90, "sorting": 0.90,
           "letters": 0.90, "calculator": 0.90, "letters_doubled": 0.95, "sorting_one_digit": 0.95,
           "image_colour": 0.90, "image_count": 0.90, "image_left": 0.90}
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


def generate_reasoning_engine(model_dir: Path, samples: list[Sample], **engine_kwargs: Any) -> list[str]:
    """Our engine: each sample's conversation through LLM.chat (template rendered by the engine), greedy;
    `engine_kwargs` go to LLM(...) (kv_cache_dtype, dtype, ...)."""
    from reasoning_engine import LLM, SamplingParams

    llm = LLM(str(model_dir), **engine_kwargs)
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
    """Reference: transformers' DeepseekV3ForCausalLM (or Kimi_K25ForConditionalGeneration), float32, left-padded
    batched greedy decoding of text prompts."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM, Kimi_K25ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model_class = Kimi_K25ForConditionalGeneration if has_vision(model_dir) else DeepseekV3ForCausalLM
    model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
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


def has_vision(model_dir: Path) -> bool:
    """Whether the checkpoint is multimodal Kimi K2.5 (a vision tower to ask about pictures)."""
    return json.loads((model_dir / "config.json").read_text()).get("model_type") == "kimi_k25"


def task_name(sample: Sample) -> str:
    """The task a figure is reported under: a held-out picture's question as ``heldout_colour`` and so on."""
    if sample.meta.get("style") == "heldout":
        return "heldout_" + sample.task.removeprefix("image_")
    return sample.task


def evaluate(model_dir: Path, engine: str, per_task: int, seed: int, show: int = 0,
             thinking: bool = True, heldout: bool = True, **engine_kwargs: Any) -> dict[str, dict[str, float]]:
    """Per-task accuracy and share of answers preceded by a thinking section; `engine_kwargs` go to our engine's
    LLM(...)."""
    samples = eval_samples(per_task, seed, thinking)
    if has_vision(model_dir) and engine == "reasoning_engine":
        pictures = eval_image_samples(per_task, VISION_EVAL_SEED + seed - EVAL_SEED)
        if heldout:
            pictures += heldout_samples(per_task, HELDOUT_SEED + seed - EVAL_SEED)
        if not thinking:
            for sample in pictures:
                sample.thinking = False
        samples += pictures
    if engine == "reasoning_engine":
        texts = generate_reasoning_engine(model_dir, samples, **engine_kwargs)
    else:
        texts = generate_transformers(model_dir, samples)
    stats: dict[str, dict[str, float]] = defaultdict(lambda: {"n": 0, "correct": 0, "thinking": 0})
    shown: dict[str, int] = defaultdict(int)
    for s, text in zip(samples, texts):
        parsed = parse_completion(text)
        if s.task in IMAGE_TASKS:
            ok = check_image_answer(s, parsed.content)
        else:
            ok = check_answer(s, parsed.content, parsed.tool_calls)
        task = task_name(s)
        st = stats[task]
        st["n"] += 1
        st["correct"] += ok
        st["thinking"] += parsed.has_thinking
        if not ok and shown[task] < show:
            shown[task] += 1
            question = s.messages[-1]["content"]
            if isinstance(question, list):
                question = " ".join(p["text"] for p in question if p["type"] == "text") + f" {s.meta['objects']}"
            print(f"--- {task} wrong: {question!r}\n{text}")
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
    parser.add_argument("--no-heldout", action="store_true",
                        help="leave out the pictures of the held-out drawing program")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    ns = parser.parse_args(argv)
    start = time.time()
    thinking = ns.thinking == "on"
    results = evaluate(ns.model, ns.engine, ns.per_task, ns.seed, ns.show_failures, thinking, not ns.no_heldout)
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
