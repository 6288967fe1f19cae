"""Structured output and token constraints on a tiny random Llama (character tokenizer, no thinking in its prompts:
the constraint applies from the first token): every kind of spec, logit_bias, allowed_token_ids, bad_words, and the
errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from reasoning_engine import LLM, SamplingParams

from .helpers import check_json, grammar_accepts

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
                         "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                         "items": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1},
                                   "maxItems": 2}}}


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(llama_dir, dtype="float32", device="cpu")


def prompt(llm: LLM, text: str = "Answer: ") -> dict:
    return {"prompt_token_ids": llm.tokenizer.encode(text)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("spec", [{"json": SCHEMA}, {"regex": r"[a-c]{2,5}@[0-9]{1,4}\.(com|org)"},
                                  {"choice": ["alpha", "beta", "gamma delta"]},
                                  {"grammar": 'root ::= item ("," item){0,3}\nitem ::= [xyz] [0-9]'}])
def test_outputs_match_their_spec(llm: LLM, spec: dict, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=1, n=2, max_tokens=120, structured_outputs=spec)
    outs = llm.generate([prompt(llm), prompt(llm, "Q? ")], params, use_tqdm=False)
    for sample in [s for out in outs for s in out.outputs]:
        assert sample.finish_reason == "stop", sample.text
        assert grammar_accepts(llm, spec, sample.token_ids) == (True, True)
        if "json" in spec:
            check_json(sample.text, SCHEMA)
        if "choice" in spec:
            assert sample.text in spec["choice"]


def test_max_tokens_too_small(llm: LLM) -> None:
    out = llm.generate(prompt(llm), SamplingParams(temperature=0, max_tokens=4, structured_outputs={"json": SCHEMA}),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert grammar_accepts(llm, {"json": SCHEMA}, out.token_ids) == (True, False)


def test_speculation_and_preemption_match_plain_greedy(llm: LLM, llama_dir: Path) -> None:
    prompts = [prompt(llm, t) for t in ("abcabcabc ", "xyz xyz ", "0101 ")]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": "(ab|abc|[0-9]){1,20}"})
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec_llm = LLM(llama_dir, dtype="float32", device="cpu",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)] == want
    tight = LLM(llama_dir, dtype="float32", device="cpu", block_size=4, kv_cache_blocks=14, max_model_len=56,
                max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == want
    assert tight.engine.num_preemptions > 0


def test_logit_bias_allowed_token_ids_and_bad_words(llm: LLM) -> None:
    tok = llm.tokenizer
    z = tok.convert_tokens_to_ids("z")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = llm.generate(prompt(llm), greedy, use_tqdm=False)[0].outputs[0].token_ids
    biased = llm.generate(prompt(llm), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      logit_bias={str(z): 100}), use_tqdm=False)[0].outputs[0]
    assert biased.token_ids == [z] * 12
    only = tok.convert_tokens_to_ids(["q", "r", "s"])
    for temperature in (0.0, 1.0):
        out = llm.generate(prompt(llm), SamplingParams(temperature=temperature, seed=0, max_tokens=12, ignore_eos=True,
                                                       allowed_token_ids=only), use_tqdm=False)[0].outputs[0]
        assert set(out.token_ids) <= set(only)
    # ban the first token greedy picks, and the first two-character pair it writes
    pair = tok.decode(base[1:3])
    banned = llm.generate(prompt(llm), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      bad_words=[tok.decode(base[:1]), pair]), use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != base[0] and pair not in banned.text and base[0] not in banned.token_ids


def test_constraints_combine_with_a_grammar(llm: LLM) -> None:
    """allowed_token_ids narrows the grammar's choices; where they leave nothing, the grammar wins."""
    digits = llm.tokenizer.convert_tokens_to_ids(list("0123456789"))
    out = llm.generate(prompt(llm), SamplingParams(temperature=0, max_tokens=10, structured_outputs={"regex": "[0-9a-z]{4}"},
                                                   allowed_token_ids=digits[:3]), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids[:4]) <= set(digits[:3])
    out = llm.generate(prompt(llm), SamplingParams(temperature=0, max_tokens=10, structured_outputs={"regex": "[a-z]{4}"},
                                                   allowed_token_ids=digits[:3]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.text) == 4 and out.text.isalpha()


@pytest.mark.parametrize("kwargs,field", [
    (dict(logit_bias={100: 1.0}), "logit_bias: token id 100 is outside the vocabulary"),
    (dict(allowed_token_ids=[5, 1000]), "allowed_token_ids: token id 1000 is outside the vocabulary"),
])
def test_ids_outside_the_vocabulary_name_the_field(llm: LLM, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt(llm), SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_invalid_schema_names_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        llm.generate(prompt(llm), SamplingParams(structured_outputs={"json": {"type": "objectx"}}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        SamplingParams(structured_outputs={"regex": "a{2,1}"})
