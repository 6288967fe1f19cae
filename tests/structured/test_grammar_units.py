"""reasoning_engine/structured without an engine: spec validation, the compile cache, the matcher (accept, rollback,
fork, termination), packed bitmasks, and the verifier's walk of a draft tree."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from reasoning_engine import SamplingParams
from reasoning_engine.engine.model_runner import ModelRunner
from reasoning_engine.speculative.draft import Draft
from reasoning_engine.structured.compiler import GrammarCompiler
from reasoning_engine.structured.matcher import allocate_bitmask, unpack_bitmask
from reasoning_engine.structured.params import StructuredOutputsParams
from reasoning_engine.tiny import BUNDLED_MODEL_DIR

EOS = 1  # the bundled tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED_MODEL_DIR))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 921, [EOS], max_cached=3)


def _walk(compiler: GrammarCompiler, spec: StructuredOutputsParams, text: str, tokenizer) -> tuple[int, int, bool]:
    """(tokens accepted, tokens in text, terminated after EOS)."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    matcher = compiler.matcher(spec)
    accepted = matcher.accept_prefix(tokens)
    return accepted, len(tokens), accepted == len(tokens) and matcher.accept(EOS) and matcher.is_terminated


@pytest.mark.parametrize("spec,good,bad", [
    (dict(json={"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}, "required": ["a"]}),
     '{"a":3}', '{"a":"x"}'),
    (dict(json='{"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}'), '["x","y"]', '["x","y","x"]'),
    (dict(regex=r"[0-9]{3}-[a-z]{2}"), "123-ab", "12-ab"),
    (dict(choice=["yes", 'no "way"']), 'no "way"', "maybe"),
    (dict(grammar='root ::= "ab" [c-d]+'), "abcdc", "abe"),
    (dict(json_object=True), '{"k":[1,{"z":null}]}', "[1]"),
])
def test_each_kind_accepts_matches_and_rejects_others(compiler, tokenizer, spec, good, bad) -> None:
    params = StructuredOutputsParams(**spec)
    accepted, total, terminated = _walk(compiler, params, good, tokenizer)
    assert accepted == total and terminated
    accepted, total, terminated = _walk(compiler, params, bad, tokenizer)
    assert not terminated


@pytest.mark.parametrize("spec,field", [
    (dict(json='{"type": "objectx"}'), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json={"type": "string", "pattern": "(["}), "structured_outputs.json"),
    (dict(regex="(["), "structured_outputs.regex"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (dict(json_object=False), "structured_outputs: exactly one"),
    (dict(regex="a", choice=["b"]), "structured_outputs: exactly one"),
    (dict(regexp="a"), "structured_outputs.regexp"),
])
def test_invalid_specs_name_the_field(spec, field) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SamplingParams(structured_outputs=spec)


def test_sampling_params_constraint_fields_validate() -> None:
    params = SamplingParams(logit_bias={"7": 2, 9: -100}, allowed_token_ids=[3, 4], bad_words=["x"],
                            structured_outputs={"regex": "a+"})
    assert params.logit_bias == {7: 2.0, 9: -100.0}
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    for kwargs, field in [(dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias={1: 101}), "logit_bias"),
                          (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
                          (dict(bad_words=[""]), "bad_words")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_cache_is_keyed_by_spec_and_bounded(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, 921, [EOS], max_cached=2)
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}}
    first = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(schema))) is first  # dict and text: one key
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(StructuredOutputsParams(regex="a"))
    compiler.compile(StructuredOutputsParams(regex="b"))
    assert len(compiler) == 2
    assert compiler.compile(StructuredOutputsParams(json=schema)) is not first  # evicted, least recently used


def test_matcher_rollback_and_fork(compiler, tokenizer) -> None:
    spec = StructuredOutputsParams(choice=["abc", "abd"])
    matcher = compiler.matcher(spec)
    tokens = tokenizer.encode("abc", add_special_tokens=False)
    assert matcher.accept_prefix(tokens) == len(tokens)
    fork = matcher.fork()
    matcher.rollback(len(tokens))
    assert matcher.num_accepted == 0 and fork.num_accepted == len(tokens)
    assert matcher.accept_prefix(tokenizer.encode("abd", add_special_tokens=False)) > 0
    assert fork.allowed().nonzero().flatten().tolist() == [EOS]  # the fork is complete: only EOS follows
    assert fork.accept(EOS) and fork.is_terminated and not matcher.is_terminated
    assert not fork.accept(5) and not matcher.accept(10_000)


def test_bitmask_unpacks_to_allowed_tokens() -> None:
    bitmask = allocate_bitmask(2, 70)
    bitmask[1] = 0
    bitmask[1, 0] = 1 - (1 << 31)  # bits 0 and 31 (int32: bit 31 is the sign)
    bitmask[1, 2] = 1 << 5
    allowed = unpack_bitmask(bitmask, 70)
    assert allowed.shape == (2, 70) and bool(allowed[0].all())
    assert allowed[1].nonzero().flatten().tolist() == [0, 31, 69]


def test_draft_walk_masks_grammar_rejected_nodes(compiler, tokenizer) -> None:
    """Verification rows: the root row allows only what the grammar allows; a child the grammar rejects is masked
    out in its parent's row; thinking rows are free and `</think>` in the draft starts the constraint."""
    spec = StructuredOutputsParams(regex="[0-9]+")
    digit, letter = tokenizer.convert_tokens_to_ids(["7", "x"])
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    runner = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(vocab_size=921, think_end_token_id=think_end)))
    # root -> 7 -> 7, root -> x
    draft = Draft([digit, digit, letter], [-1, 0, -1])
    request = SimpleNamespace(grammar=compiler.matcher(spec), thinking=False)
    rows = unpack_bitmask(ModelRunner._draft_bitmask(runner, request, draft), 921)
    assert rows[0, digit] and not rows[0, letter]
    assert rows[1, digit] and rows[1, EOS]  # after "7": more digits or the end
    assert bool(rows[3].all())  # below the rejected "x": unreachable, unconstrained
    assert request.grammar.num_accepted == 0  # the walk leaves the matcher where it was
    keep = request.grammar.walk_draft(draft.token_ids, draft.parents, False, think_end)
    assert keep == [True, True, False]
    assert draft.subset(keep) == Draft([digit, digit], [-1, 0], 0.0)  # what the engine verifies
    assert Draft([letter, digit, digit], [-1, 0, -1]).subset([False, True, True]) == Draft([digit], [-1])
    # thinking at the root: free until the drafted </think>
    draft = Draft([letter, think_end, digit], [-1, 0, 1])
    request = SimpleNamespace(grammar=compiler.matcher(spec), thinking=True)
    rows = unpack_bitmask(ModelRunner._draft_bitmask(runner, request, draft), 921)
    assert bool(rows[0].all()) and bool(rows[1].all())
    assert rows[2, digit] and not rows[2, letter] and not rows[2, EOS]
    assert rows[3, EOS]
