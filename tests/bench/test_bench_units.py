"""Client-side pieces of the benchmark without a server: exact-length synthetic prompts, token accounting,
percentiles, presets, dataset loading."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import pytest

from reasoning_engine.bench import datasets
from reasoning_engine.bench.cli import PRESETS, _resolve, register_cli
from reasoning_engine.bench.report import stats
from reasoning_engine.bench.serve import RequestRecord, StreamResult, api_root, fill_tokens
from reasoning_engine.bench.tokens import TokenCounter

from .checkpoint import build_checkpoint


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A byte-level BPE with real merges (trained on the shared workloads' text when present), where decode ->
    encode is not the identity: the case the fixed-point loop exists for."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    source = datasets.default_workloads_dir() / "reasoning" / "skyt1_27b_math.jsonl"
    if source.is_file():
        text = [json.loads(line)["output"] for line in source.read_text(encoding="utf-8").splitlines()[:40]]
    else:
        text = ["the quick brown fox jumps over the lazy dog " * 50, "Let's compute the answer step by step. " * 50]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("length", [1, 17, 300])
def test_synthetic_prompts_have_exact_length(bpe_tokenizer: Any, length: int) -> None:
    counter = TokenCounter(bpe_tokenizer, "trained bpe")
    maker = datasets.SyntheticPrompts(counter)
    rng = random.Random(0)
    texts = [maker.make(length, rng) for _ in range(5)]
    assert all(len(bpe_tokenizer.encode(t, add_special_tokens=False)) == length for t in texts)
    assert len(set(texts)) == 5


def test_synthetic_levels_are_fresh_and_seeded(bpe_tokenizer: Any) -> None:
    counter = TokenCounter(bpe_tokenizer, "trained bpe")
    first = datasets.synthetic(counter, 32, [3, 3], seed=1)
    again = datasets.synthetic(counter, 32, [3, 3], seed=1)
    other = datasets.synthetic(counter, 32, [3, 3], seed=2)
    texts = [s.turns[0][0]["content"] for level in first.levels for s in level]
    assert len(set(texts)) == 6, "no prompt repeats across levels"
    assert texts == [s.turns[0][0]["content"] for level in again.levels for s in level]
    assert not set(texts) & {s.turns[0][0]["content"] for level in other.levels for s in level}


def test_estimate_without_tokenizer_is_labelled() -> None:
    counter = TokenCounter(None, "estimate")
    workload = datasets.synthetic(counter, 20, [2], seed=0)
    assert "estimated" in workload.description
    assert len(workload.levels[0][0].turns[0][0]["content"].split()) == 20


def test_fill_tokens_prefers_usage_then_counts(bpe_tokenizer: Any) -> None:
    counter = TokenCounter(bpe_tokenizer, "trained bpe")
    result = StreamResult(reasoning="Let me think.", content="The answer is 5.", ttft_s=0.1, ttfa_s=0.2, e2e_s=0.6)
    messages = [{"role": "user", "content": "2+3?"}]
    record = RequestRecord(1, "s", 0, 0.0)
    result.usage = {"prompt_tokens": 9, "completion_tokens": 10,
                    "completion_tokens_details": {"reasoning_tokens": 4}, "prompt_tokens_details": {"cached_tokens": 0}}
    fill_tokens(record, result, messages, counter)
    assert (record.output_tokens, record.reasoning_tokens, record.answer_tokens, record.prompt_tokens) == (10, 4, 6, 9)
    assert record.token_source == "usage" and record.output_speed_tps == pytest.approx(10 / 0.5)

    counted = RequestRecord(1, "s", 0, 0.0)
    result.usage = None
    fill_tokens(counted, result, messages, counter)
    assert counted.token_source == "counted"
    assert counted.reasoning_tokens == len(bpe_tokenizer.encode("Let me think.", add_special_tokens=False))
    assert counted.answer_tokens == len(bpe_tokenizer.encode("The answer is 5.", add_special_tokens=False))
    assert counted.cached_tokens is None


def test_stats_percentiles() -> None:
    s = stats([float(v) for v in range(1, 101)])
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    return parser.parse_args(["bench", "serve", *argv])


def test_presets_and_overrides() -> None:
    settings = _resolve(_parse("--preset", "aa-10k"))
    assert (settings["input_tokens"], settings["output_tokens"], settings["concurrency"]) == (10_000, 1_500, [1, 10])
    settings = _resolve(_parse("--preset", "aa-100k", "--output-tokens", "64", "--concurrency", "4"))
    assert (settings["input_tokens"], settings["output_tokens"], settings["concurrency"]) == (100_000, 64, [4])
    assert set(PRESETS) == {"aa-1k", "aa-10k", "aa-100k"}
    with pytest.raises(ValueError, match="concurrency"):
        _resolve(_parse("--concurrency", "1,0"))
    with pytest.raises(ValueError, match="extra-body"):
        _resolve(_parse("--extra-body", "[1]"))


def test_api_root() -> None:
    assert api_root("http://h:1") == "http://h:1/v1"
    assert api_root("http://h:1/v1/") == "http://h:1/v1"
    assert api_root("https://api.example.com/openai/v1") == "https://api.example.com/openai/v1"


def test_jsonl_prompts_messages_and_sessions(tmp_path: Path) -> None:
    counter = TokenCounter(None, "estimate")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "yo"}]})
                     + "\n", encoding="utf-8")
    workload = datasets.from_dataset(str(plain), counter, [2], 0, tmp_path, None)
    assert not workload.multi_turn
    assert sorted(s.turns[0][-1]["content"] for s in workload.levels[0]) == ["hi", "yo"]
    sessions = tmp_path / "sessions.jsonl"
    sessions.write_text("".join(json.dumps({"traj_id": t, "step": s, "prompt": f"{t}-{s}"}) + "\n"
                                for t in ("a", "b") for s in (1, 0, 2)), encoding="utf-8")
    workload = datasets.from_dataset(str(sessions), counter, [1, 1], 0, tmp_path, None)
    assert workload.multi_turn
    replayed = [[turn[0]["content"] for turn in level[0].turns] for level in workload.levels]
    assert sorted(replayed) == [["a-0", "a-1", "a-2"], ["b-0", "b-1", "b-2"]], "disjoint sessions, turns in step order"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="prompt"):
        datasets.from_dataset(str(bad), counter, [1], 0, tmp_path, None)


@pytest.mark.skipif(not (datasets.default_workloads_dir() / "agentic").is_dir(), reason="shared workloads absent")
def test_shared_workloads_load() -> None:
    counter = TokenCounter(None, "estimate")
    agentic = datasets.from_dataset("agentic", counter, [3], 0, datasets.default_workloads_dir(), 50)
    assert agentic.multi_turn and all(len(s.turns) > 1 for s in agentic.levels[0])
    assert all(len(m["content"]) <= 200 for s in agentic.levels[0] for turn in s.turns for m in turn)
    reasoning = datasets.from_dataset("reasoning", counter, [4], 0, datasets.default_workloads_dir(), None)
    assert not reasoning.multi_turn and len(reasoning.levels[0]) == 4


def test_throughput_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reasoning_engine.cli import main

    model = build_checkpoint(tmp_path / "model")
    out = tmp_path / "tput.json"
    assert main(["bench", "throughput", str(model), "--input-tokens", "8", "--output-tokens", "4", "--num-prompts", "2",
                 "--concurrency", "2", "--device", "cpu", "--compare", "transformers", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert [r["engine"] for r in summary["results"]] == ["reasoning-engine", "transformers"]
    assert all(r["output_tokens"] == 2 * 4 and r["prompt_tokens"] == 2 * 8 for r in summary["results"])
    assert summary["speedup_output_tps"] > 0
    assert "reasoning-engine / transformers" in capsys.readouterr().out
