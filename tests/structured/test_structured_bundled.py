"""Structured output on the bundled tiny reasoning model (it thinks first): the constraint starts after `</think>`
(at once with thinking off), answers parse and validate, greedy and sampled, n = 2, with speculation and under
preemption exactly as without, and a too-small max_tokens ends with "length" and a valid prefix."""

from __future__ import annotations

import pytest

from reasoning_engine import LLM, SamplingParams

from .helpers import answer_ids, check_json, grammar_accepts

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "level", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "level": {"type": "integer", "minimum": 1, "maximum": 9},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
                         "note": {"type": "string", "pattern": "^[a-z]{2,4}$"}}}
QUESTIONS = ["Describe a player as JSON", "What is 2 + 3?", "Name a city"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256)


def prompts(llm: LLM, thinking: bool = True, questions: list[str] = QUESTIONS) -> list[str]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=thinking) for q in questions]


def json_params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=160, structured_outputs={"json": SCHEMA}, **kwargs)


def test_json_schema_after_thinking_greedy_sampled_and_n2(llm: LLM) -> None:
    outs = llm.generate(prompts(llm), [json_params(temperature=0), json_params(temperature=1.0, seed=3),
                                       json_params(temperature=0.8, n=2, seed=5)], use_tqdm=False)
    for out in outs:
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            answer = answer_ids(llm, sample.token_ids, thinking=True)
            assert llm.engine.think_end_id not in answer
            check_json(llm.tokenizer.decode(answer, skip_special_tokens=True), SCHEMA)
    assert len(outs[2].outputs) == 2


def test_thinking_off_constrains_from_the_first_token(llm: LLM) -> None:
    spec = {"regex": "[0-9]{2,4}(-[a-z]{2})?"}
    outs = llm.generate(prompts(llm, thinking=False), SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec),
                        use_tqdm=False)
    for out in outs:
        sample = out.outputs[0]
        assert sample.finish_reason == "stop"
        assert grammar_accepts(llm, spec, sample.token_ids) == (True, True)


@pytest.mark.parametrize("spec", [{"choice": ["yes", "no", "maybe not"]},
                                  {"grammar": 'root ::= "answer: " [0-9] [0-9]? "."'},
                                  {"json_object": True}])
def test_choice_grammar_and_json_object(llm: LLM, spec: dict) -> None:
    out = llm.generate(prompts(llm, thinking=False)[:1], SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    prefix, whole = grammar_accepts(llm, spec, out.token_ids)
    assert prefix and (whole or out.finish_reason == "length")
    if "choice" in spec:
        assert out.text in spec["choice"]


def test_max_tokens_too_small_ends_with_length_and_a_valid_prefix(llm: LLM) -> None:
    for thinking in (False, True):
        params = SamplingParams(temperature=0, max_tokens=40 if thinking else 6, structured_outputs={"json": SCHEMA})
        out = llm.generate(prompts(llm, thinking)[:1], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length"
        answer = answer_ids(llm, out.token_ids, thinking) if llm.engine.think_end_id in out.token_ids else []
        assert grammar_accepts(llm, {"json": SCHEMA}, answer) == (True, False)


def test_thinking_budget_hands_over_to_the_grammar(llm: LLM) -> None:
    out = llm.generate(prompts(llm)[:1], json_params(temperature=0, thinking_token_budget=4), use_tqdm=False)[0].outputs[0]
    end = out.token_ids.index(llm.engine.think_end_id)
    assert end == 4 and out.finish_reason == "stop"
    check_json(llm.tokenizer.decode(out.token_ids[end + 1:], skip_special_tokens=True), SCHEMA)


def test_speculation_matches_plain_greedy(llm: LLM) -> None:
    spec_llm = LLM(max_model_len=256, adaptive=False,  # static lengths: every draft verified
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    questions = QUESTIONS + ["Give the JSON again", "Repeat: name, level, tags"]
    params = [json_params(temperature=0), SamplingParams(temperature=0, max_tokens=40,
                                                         structured_outputs={"regex": "(ab|abc|[0-9]){1,12}"})]
    drafted = accepted = 0
    for p in params:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts(llm, questions=questions), p, use_tqdm=False)]
        outs = spec_llm.generate(prompts(llm, questions=questions), p, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        drafted += sum(o.spec_draft_tokens for o in outs)
        accepted += sum(o.spec_accepted_tokens for o in outs)
    assert 0 < accepted < drafted  # drafts were verified, and some of their tokens rejected
    sampled = spec_llm.generate(prompts(llm, questions=questions), json_params(temperature=1.0, seed=11), use_tqdm=False)
    for out in sampled:
        sample = out.outputs[0]
        assert sample.finish_reason == "stop"
        check_json(llm.tokenizer.decode(answer_ids(llm, sample.token_ids, True), skip_special_tokens=True), SCHEMA)


def test_preemption_keeps_matcher_state(llm: LLM) -> None:
    tight = LLM(max_model_len=256, block_size=4, kv_cache_blocks=72, max_num_batched_tokens=64)
    params = [json_params(temperature=0), json_params(temperature=0.9, seed=7), json_params(temperature=0.9, n=2, seed=2)]
    roomy = LLM(max_model_len=256, block_size=4, kv_cache_blocks=512)
    want = [[s.token_ids for s in o.outputs] for o in roomy.generate(prompts(llm), params, use_tqdm=False)]
    got = tight.generate(prompts(llm), params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    assert [[s.token_ids for s in o.outputs] for o in got] == want
    for out in got:
        for sample in out.outputs:
            check_json(llm.tokenizer.decode(answer_ids(llm, sample.token_ids, True), skip_special_tokens=True), SCHEMA)
