"""Per-request sampling through the engine: seeds, stop strings, stop ids, min_tokens, logprobs, thinking budget."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import GenerationConfig

from reasoning_engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(llama_dir, dtype="float32", device="cpu")


def test_seed_reproduces_regardless_of_batch_and_other_seed_differs(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=123, max_tokens=30, ignore_eos=True)
    alone = llm.generate("The answer is", params)[0].outputs[0].token_ids
    crowd = llm.generate(["abc", "The answer is", "xyz 123"],
                         [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True), params,
                          SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True)])
    assert crowd[1].outputs[0].token_ids == alone
    other = llm.generate("The answer is", SamplingParams(temperature=1.0, top_p=0.95, seed=124, max_tokens=30, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_stop_string_split_across_tokens(llm: LLM) -> None:
    free = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop = free.text[10:13]  # three characters = three tokens
    assert len(stop) == 3
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    kept = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=stop,
                                                include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + 3]


def test_stop_token_ids_min_tokens_and_max_tokens(llm: LLM) -> None:
    free = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[5]
    out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
    first = free.token_ids.index(stop_id)
    assert out.token_ids == free.token_ids[: first + 1] and out.stop_reason == stop_id
    late = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id],
                                             min_tokens=first + 2))[0].outputs[0]
    assert stop_id not in late.token_ids[: first + 2]
    assert len(late.token_ids) >= first + 2


def test_the_token_that_ends_the_output_is_not_in_its_text(llm: LLM, llama_dir: Path, tmp_path: Path) -> None:
    """A stop token id, or an end-of-sequence id, that is a plain character: its id ends the token ids, its text is
    left out of the text (as vLLM), unless include_stop_str_in_output (was: the character ended every answer)."""
    free = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    tokenizer = llm.engine.tokenizer
    cut = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                            stop_token_ids=[stop_id]))[0].outputs[0]
    assert tokenizer.decode([stop_id]).strip()  # a visible character
    assert cut.token_ids == free.token_ids[: first + 1]
    assert cut.text == tokenizer.decode(free.token_ids[:first]) != tokenizer.decode(free.token_ids[: first + 1])
    kept = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id],
                                             include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == tokenizer.decode(free.token_ids[: first + 1])
    # the same with the id as the checkpoint's end of sequence
    folder = tmp_path / "plain_eos"
    shutil.copytree(llama_dir, folder)
    GenerationConfig(eos_token_id=stop_id).save_pretrained(folder)
    ended = LLM(folder, dtype="float32", device="cpu").generate("Hi", SamplingParams(temperature=0.0, max_tokens=20))
    assert ended[0].outputs[0].token_ids == free.token_ids[: first + 1]
    assert ended[0].outputs[0].text == cut.text and ended[0].outputs[0].finish_reason == "stop"


def test_stop_strings_wait_for_min_tokens(llm: LLM) -> None:
    """A stop string, like EOS and stop_token_ids, ends the output only from min_tokens on; one completed earlier
    is plain text (as in vLLM)."""
    text = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    stop = next(text[i : i + 2] for i in range(6) if text.find(text[i : i + 2], 20) != -1)  # early and again late
    out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                            min_tokens=12))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) >= 12
    assert stop in out.text  # the early match did not end it
    assert text.startswith(out.text) and text[len(out.text) :].startswith(stop)


def test_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    out = llm.generate("Count: 1 2 3", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                                                       prompt_logprobs=2))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 6
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token].rank == 1  # greedy picks the top token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[:3] == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in entry


def test_repetition_penalty_changes_greedy_output(llm: LLM) -> None:
    base = llm.generate("aaaa", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[0].token_ids
    penalised = llm.generate("aaaa", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                    repetition_penalty=5.0, frequency_penalty=1.0))[0].outputs[0].token_ids
    assert penalised != base
    assert len(set(penalised)) >= len(set(base))


def test_thinking_budget_forces_end_of_thinking(llm: LLM) -> None:
    think, end = llm.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = {"prompt_token_ids": llm.tokenizer.encode("Question?") + [think]}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, thinking_token_budget=5))[0]
    tokens = out.outputs[0].token_ids
    assert end in tokens and tokens.index(end) <= 5
    zero = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, thinking_token_budget=0))[0]
    assert zero.outputs[0].token_ids[0] == end


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
                                          ("max_tokens", 0), ("n", 0), ("presence_penalty", 3.0),
                                          ("repetition_penalty", 0.0), ("logprobs", 100), ("stop", [""]),
                                          ("thinking_token_budget", -1), ("seed", "x")])
def test_invalid_sampling_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_stop_string_completed_before_min_tokens_is_not_found_later(llm: LLM) -> None:
    """With stop strings of different lengths, each is looked for only len(stop) - 1 characters back: a short one
    that was complete while stop checks were off (before min_tokens) does not end the output later, and text and
    token ids stay consistent."""
    from reasoning_engine.engine.detokenizer import IncrementalDetokenizer

    tok = llm.tokenizer
    detok = IncrementalDetokenizer(tok, tok.encode("Q"), True, ["=", "\x0b" * 4], False)
    ids = tok.encode("ab=cdefgh=ij", add_special_tokens=False)
    found = [detok.append([t], check_stop=i + 1 >= 6) for i, t in enumerate(ids)]
    assert found == [None] * 9 + ["=", None, None] and detok.text == "ab=cdefgh"  # the second "=", not the first

    free = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    early = next(c for c in free.text[:3] if c not in free.text[3:])  # complete before min_tokens, never again
    for stop in ([early], [early, "\x0b" * 4]):
        out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=stop,
                                                min_tokens=6))[0].outputs[0]
        assert (out.finish_reason, out.token_ids, out.text) == ("length", free.token_ids, free.text), stop
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
