import argparse
import json

import pytest

from reasoning_engine.speculative import build_proposer
from reasoning_engine.speculative.replay import ReplayItem, register_cli, replay


def run(method, items, k, **options):
    return replay(items, build_proposer({"method": method, **options}), k).summary()


def test_output_copied_from_the_prompt_gains_k_plus_one_per_step():
    out = list(range(1, 21))
    result = run("lookup", [ReplayItem(None, [100, *out, 100], out)], 4)
    assert result["steps"] == 4 and result["tokens"] == 20
    assert result["mean_accepted_tokens"] == 5.0 and result["acceptance_rate"] == 1.0
    assert result["accepted_per_position"] == [1.0, 1.0, 1.0, 1.0]


def test_novel_output_gains_nothing():
    result = run("ngram", [ReplayItem(None, [1, 2, 3], [10, 11, 12, 13])], 4)
    assert (result["steps"], result["tokens"], result["mean_accepted_tokens"]) == (4, 4, 1.0)
    assert result["draft_tokens"] == 0 and result["acceptance_rate"] == 0.0


def test_trajectory_context_includes_earlier_turns():
    items = [ReplayItem("t", [1, 2, 3], [4, 5, 6, 7, 8, 9]), ReplayItem("t", [3], [4, 5, 6, 7, 8, 9])]
    result = run("lookup", items, 8)
    # Turn 1: six plain steps. Turn 2 sees 1..9 then 3: one step drafts 4..9,3 and accepts the six that exist.
    assert (result["steps"], result["tokens"]) == (7, 12)
    assert (result["draft_tokens"], result["accepted_draft_tokens"]) == (7, 6)
    # Without the trajectory, turn 2 has nothing to copy from.
    alone = run("lookup", [ReplayItem(None, i.prompt, i.output) for i in items], 8)
    assert alone["steps"] == 12


def test_a_repeated_output_is_drafted_from_the_global_store():
    out = list(range(30, 50))
    items = [ReplayItem(None, [7, 8, 9], out), ReplayItem(None, [7, 8, 9], out)]
    result = run("suffix", items, 4)
    # The first output is novel (20 steps); the second is replayed at K + 1 = 5 tokens per step (4 steps).
    assert (result["steps"], result["tokens"]) == (24, 40)
    assert (result["draft_tokens"], result["accepted_draft_tokens"]) == (16, 16)


def test_tree_drafts_never_exceed_k():
    items = [ReplayItem(None, [1, 2], [(i * 7 + j) % 5 for j in range(40)]) for i in range(6)]
    for k in (1, 3, 8):
        result = run("suffix", items, k, min_token_prob=0.0)
        assert result["draft_tokens"] <= k * result["draft_steps"]
        assert result["tokens"] == 240


@pytest.fixture
def word_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate("[UNK] a b c d e f g h i".split())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "tok"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_cli_prints_the_result_as_the_last_line(tmp_path, word_tokenizer, capsys):
    traces = tmp_path / "traces.jsonl"
    rows = [{"prompt": "a b c", "output": "d e f g h i", "traj_id": "t", "dup_line_frac": 0.0},
            {"prompt": "c", "output": "d e f g h i", "traj_id": "t", "dup_line_frac": 0.0},
            {"prompt": "a", "output": "b b b b", "dup_line_frac": 0.9}]
    traces.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())

    def cli(*extra):
        args = parser.parse_args(["spec-replay", "--method", "lookup", "--input", str(traces), "--tokenizer",
                                  str(word_tokenizer), "--num-speculative-tokens", "8", "--json", *extra])
        assert args.func(args) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    filtered = cli("--max-dup-line-frac", "0.5")
    assert (filtered["steps"], filtered["tokens"], filtered["records"]) == (7, 12, 2)
    assert filtered["mean_accepted_tokens"] == pytest.approx(12 / 7)
    assert filtered["acceptance_rate"] == pytest.approx(6 / 7)
    assert cli()["records"] == 3


def test_cli_state_dir_carries_the_global_store(tmp_path, word_tokenizer, capsys):
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps({"prompt": "a", "output": "b c d e f g h i"}) + "\n")
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    state = tmp_path / "state"

    def cli():
        args = parser.parse_args(["spec-replay", "--method", "suffix", "--input", str(traces), "--tokenizer",
                                  str(word_tokenizer), "-k", "8", "--state-dir", str(state), "--json"])
        args.func(args)
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert cli()["steps"] == 8  # nothing learned yet
    assert cli()["steps"] == 1  # the saved output is replayed in one step
