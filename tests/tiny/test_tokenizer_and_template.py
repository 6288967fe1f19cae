"""The bundled tokenizer (special-token behaviour) and chat template (Kimi format, thinking switch, tools)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from reasoning_engine.tiny import BUNDLED_MODEL_DIR
from reasoning_engine.tiny.chat_format import SPECIAL_TOKENS, TEXT_CONTROL_TOKENS, render_chat
from reasoning_engine.tiny.data import calculator_call, calculator_tool


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)


def test_loads_as_fast_tokenizer(tok: PreTrainedTokenizerFast) -> None:
    assert isinstance(PreTrainedTokenizerFast.from_pretrained(BUNDLED_MODEL_DIR), PreTrainedTokenizerFast)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    assert len(tok) <= 1100


def test_control_tokens_are_single_tokens(tok: PreTrainedTokenizerFast) -> None:
    for text in SPECIAL_TOKENS + TEXT_CONTROL_TOKENS:
        assert len(tok(text).input_ids) == 1, text
    assert all(len(tok(d).input_ids) == 1 for d in "0123456789")
    assert tok.convert_ids_to_tokens(tok("12345").input_ids) == list("12345")


def test_skip_special_tokens_keeps_thinking_and_tool_markers(tok: PreTrainedTokenizerFast) -> None:
    text = ("<|im_assistant|>assistant<|im_middle|><think>a</think>b<|tool_calls_section_begin|><|tool_call_begin|>"
            "functions.calculator:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == (
        "assistant<think>a</think>b<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")


def test_round_trip_of_arbitrary_text(tok: PreTrainedTokenizerFast) -> None:
    text = "Héllo, wörld! 12 + 7 = 19\n\tünïcode ✓ {\"a\": [1, 2]}"
    assert tok.decode(tok(text).input_ids) == text


def test_generation_prompt_thinking_on_and_off(tok: PreTrainedTokenizerFast) -> None:
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    on = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert on == "<|im_user|>user<|im_middle|>What is 2 + 3?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, thinking=False)
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False) == off
    assert not tok.apply_chat_template(msgs, tokenize=False).endswith("<think>")


def test_system_history_reasoning_and_content_parts(tok: PreTrainedTokenizerFast) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
        {"role": "assistant", "content": "Again."},
    ]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Greet back.</think>Hello.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Again.<|im_end|>")


def test_tools_tool_calls_and_results(tok: PreTrainedTokenizerFast) -> None:
    tools = [calculator_tool()]
    call = calculator_call(4821, 377)
    msgs = [
        {"role": "user", "content": "What is 4821 * 377?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.calculator:0", "content": "1817517"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_system|>tool_declare<|im_middle|>" + json.dumps(tools, separators=(",", ":")) + "<|im_end|>"
        "<|im_user|>user<|im_middle|>What is 4821 * 377?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Use the tool.</think><|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>{\"expression\": \"4821 * 377\"}"
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.calculator:0\n1817517<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>")
    assert text == render_chat(msgs, tools=tools, add_generation_prompt=True)
    # Arguments given as a dict and a call without an id render the same way.
    dict_call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "4821 * 377"}}}
    msgs[1]["tool_calls"] = [dict_call]
    assert tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False) == text
