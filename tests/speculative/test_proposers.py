import json
import random

import numpy as np
import pytest

from reasoning_engine.speculative import (LookupProposer, NgramProposer, Proposer, SuffixConfig, SuffixProposer,
                                          build_proposer)
from reasoning_engine.speculative.decoder import SpeculativeConfig, make_proposer


def propose_once(proposer, prompt, k):
    proposer.start_request("r", prompt)
    draft = proposer.propose("r", prompt, k)
    proposer.finish_request("r", learn=False)
    return draft


def test_all_methods_satisfy_the_protocol():
    for method in ("ngram", "lookup", "suffix"):
        proposer = build_proposer({"method": method, "num_speculative_tokens": 4})
        assert isinstance(proposer, Proposer) and proposer.method == method
    with pytest.raises(ValueError):
        build_proposer({"method": "medusa"})
    assert build_proposer({"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 2}).contexts.orders == (2, 3)


def test_ngram_prefers_the_longest_n_and_the_latest_occurrence():
    # "7 8" occurs twice (followed by 1 then 2); "6 7 8" once (followed by 3): n=3 wins.
    prompt = [7, 8, 1, 6, 7, 8, 3, 4, 7, 8, 2, 5, 6, 7, 8]
    assert propose_once(NgramProposer(max_n=3, min_n=1), prompt, 3).token_ids == [3, 4, 7]
    # With max_n=2 the latest "7 8" (followed by 2 5) wins.
    assert propose_once(NgramProposer(max_n=2, min_n=1), prompt, 2).token_ids == [2, 5]
    assert propose_once(NgramProposer(max_n=2, min_n=2), [1, 2, 3], 4).token_ids == []


def test_lookup_finds_the_exact_longest_match():
    # Suffix "9 1 2 3 4 5" (6 tokens) occurred once, long ago; "3 4 5" also occurs later, followed by 0.
    prompt = [9, 1, 2, 3, 4, 5, 60, 61, 8, 3, 4, 5, 0, 0, 7, 9, 1, 2, 3, 4, 5]
    assert propose_once(LookupProposer(), prompt, 3).token_ids == [60, 61, 8]
    # Orders 1, 2, 4: the 6-token match sits between indexed orders and is still found exactly.
    assert propose_once(LookupProposer(max_match=4), prompt, 2).token_ids == [60, 61]
    assert propose_once(LookupProposer(), [1, 2, 3], 4).token_ids == []


def test_ngram_and_lookup_follow_the_growing_output():
    for proposer in (NgramProposer(), LookupProposer()):
        proposer.start_request("r", [1, 2, 3, 4, 5])
        assert proposer.propose("r", [1, 2, 3, 4, 5], 4).token_ids == []
        proposer.on_tokens_accepted("r", [1, 2])
        assert proposer.propose("r", [1, 2, 3, 4, 5, 1, 2], 3).token_ids == [3, 4, 5]
        # Catch-up from the full sequence without on_tokens_accepted.
        assert proposer.propose("r", [1, 2, 3, 4, 5, 1, 2, 3], 2).token_ids == [4, 5]
        proposer.finish_request("r")


def test_suffix_proposes_from_the_request_itself():
    proposer = SuffixProposer()
    prompt = [50, 51, 52, 53, 54, 55, 56, 57, 1, 2, 3]
    proposer.start_request("r", prompt + [50, 51])
    draft = proposer.propose("r", prompt + [50, 51], 4)
    assert draft.match([52, 53, 54, 55]) == draft.path_to(draft.match([52, 53, 54, 55])[-1])
    assert len(draft.match([52, 53, 54, 55])) == 4


def test_suffix_learns_finished_outputs_into_the_global_store():
    proposer = SuffixProposer()
    output = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    proposer.start_request("a", [1, 2, 3])
    proposer.on_tokens_accepted("a", output)
    proposer.finish_request("a")
    assert proposer.global_tokens == 3 + len(output)  # the prompt tail (3 < prompt_tail) plus the output
    proposer.start_request("b", [9, 9, 1, 2, 3])
    draft = proposer.propose("b", [9, 9, 1, 2, 3], 5)
    assert draft.is_path() and draft.token_ids == [20, 21, 22, 23, 24]
    proposer.finish_request("b", learn=False)
    assert proposer.global_tokens == 12


def test_suffix_learns_the_whole_output_when_its_view_lags() -> None:
    """The engine reports only steps that verified a draft: the tokens decoded without one reach the global store
    through the sequence given at finish."""
    proposer = SuffixProposer()
    output = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    proposer.start_request("a", [1, 2, 3])
    proposer.on_tokens_accepted("a", output[:2])  # the one verified step; the rest decoded plain
    proposer.finish_request("a", token_ids=[1, 2, 3] + output)
    assert proposer.global_tokens == 3 + len(output)
    proposer.start_request("b", [9, 9, 1, 2, 3, 20, 21, 22])
    assert proposer.propose("b", [9, 9, 1, 2, 3, 20, 21, 22], 5).token_ids[:5] == [23, 24, 25, 26, 27]
    proposer.finish_request("b", learn=False, token_ids=[9, 9, 1, 2, 3, 20, 21, 22, 23])
    assert proposer.global_tokens == 12


@pytest.mark.parametrize("method", ["suffix", "ngram", "lookup"])
def test_text_proposers_index_at_most_their_budget_per_step(method: str) -> None:
    """A request whose context does not fit what is left of the step's indexing budget drafts at a later step; the
    first request of a step always goes, however long its context. The option comes through `--speculative-config`."""
    proposer = build_proposer({"method": method, "num_speculative_tokens": 4, "index_budget": 10})
    repeated = [50, 51, 52, 53] * 2
    prompts = {"a": repeated, "b": [60, 61, 62, 63] * 2, "c": [70 + i for i in range(30)] + repeated}
    for name, prompt in prompts.items():
        proposer.start_request(name, prompt)
    drafts = proposer.propose_batch([(name, prompt, 4) for name, prompt in prompts.items()])
    assert len(drafts[0]) > 0 and len(drafts[1]) == len(drafts[2]) == 0
    assert set(proposer.contexts.active) == {"a"}
    drafts = proposer.propose_batch([(name, prompt + prompt[:1], 4) for name, prompt in prompts.items()])
    assert len(drafts[1]) > 0 and set(proposer.contexts.active) == {"a", "b"}  # "a" needed one token, "b" nine
    drafts = proposer.propose_batch([("c", prompts["c"], 4), ("a", prompts["a"] + [50, 51], 4)])
    assert len(drafts[0]) > 0 and len(drafts[1]) == 0  # "c" (38 tokens) went first; "a" waits for its one token
    with pytest.raises(ValueError, match="index_budget"):
        build_proposer({"method": method, "index_budget": 0})


def test_suffix_scores_candidates_by_frequency():
    proposer = SuffixProposer(SuffixConfig(tree=False))
    for i, follow in enumerate([7, 8, 7, 7]):
        proposer.learn([1, 2, 3, follow, 40 + i])
    assert propose_once(proposer, [5, 2, 3], 1).token_ids == [7]
    tree = SuffixProposer(SuffixConfig(tree=True))
    for i, follow in enumerate([7, 8, 7, 7]):
        tree.learn([1, 2, 3, follow, 40 + i])
    draft = propose_once(tree, [5, 2, 3], 2)
    assert sorted(draft.token_ids) == [7, 8] and draft.parents == [-1, -1] and draft.token_ids[0] == 7


def _random_workload(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    phrases = [[rng.randrange(30) for _ in range(rng.randrange(3, 12))] for _ in range(8)]
    return [[t for _ in range(rng.randrange(3, 8)) for t in rng.choice(phrases)] for _ in range(n)]


@pytest.mark.parametrize("tree", [True, False])
def test_suffix_drafts_respect_the_budget(tree):
    proposer = SuffixProposer(SuffixConfig(tree=tree, min_token_prob=0.0))
    for sequence in _random_workload(0, 30):
        proposer.learn(sequence)
    for i, sequence in enumerate(_random_workload(1, 10)):
        proposer.start_request(str(i), sequence[:5])
        for cut in range(5, len(sequence)):
            for k in (1, 2, 3, 5, 8, 16):
                draft = proposer.propose(str(i), sequence[:cut], k)
                assert len(draft) <= k
                assert all(-1 <= p < j for j, p in enumerate(draft.parents))
                assert tree or draft.is_path()
                assert len({(p, t) for p, t in zip(draft.parents, draft.token_ids)}) == len(draft)
        proposer.finish_request(str(i))


@pytest.mark.parametrize("tree", [True, False])
def test_suffix_drafts_carry_each_nodes_path_probability(tree):
    """Each node's probability that the target accepts the path down to it: at most its parent's, never increasing
    in the draft's order (best first, so any prefix of the draft is its most probable part), summing to the score."""
    proposer = SuffixProposer(SuffixConfig(tree=tree, min_token_prob=0.0))
    for sequence in _random_workload(0, 30):
        proposer.learn(sequence)
    drafted = 0
    for sequence in _random_workload(1, 10):
        draft = propose_once(proposer, sequence[:8], 8)
        if not len(draft):
            continue
        drafted += 1
        probs = draft.probs
        assert probs is not None and len(probs) == len(draft)
        assert all(0.0 < p <= 1.0 for p in probs)
        assert all(a >= b for a, b in zip(probs, probs[1:]))
        assert all(parent < 0 or probs[parent] >= probs[i] for i, parent in enumerate(draft.parents))
        assert draft.score == pytest.approx(sum(probs))
        assert draft.truncated(2).probs == probs[:2]
    assert drafted >= 5


def test_suffix_tree_uses_the_budget_for_alternatives():
    proposer = SuffixProposer(SuffixConfig(min_token_prob=0.0))
    for sequence in _random_workload(2, 40):
        proposer.learn(sequence)
    sizes = [len(propose_once(proposer, sequence[:6], 16)) for sequence in _random_workload(3, 10)]
    assert max(sizes) == 16


def test_suffix_global_store_is_bounded():
    proposer = SuffixProposer(SuffixConfig(global_max_tokens=50, prompt_tail=0))
    for i in range(20):
        proposer.learn([i] * 10)
    assert proposer.global_tokens == 50
    assert len(proposer.global_index.segments) == 5
    assert propose_once(proposer, [50, 3], 4).token_ids == []  # evicted
    assert propose_once(proposer, [50, 19], 4).token_ids == [19, 19, 19, 19]


def test_suffix_state_round_trips(tmp_path):
    proposer = SuffixProposer()
    for sequence in _random_workload(4, 25):
        proposer.start_request("x", sequence[:4])
        proposer.propose("x", sequence[:4], 8)
        proposer.on_tokens_accepted("x", sequence[4:])
        proposer.finish_request("x")
    proposer.save(tmp_path)
    restored = SuffixProposer()
    assert restored.load(tmp_path) == 25
    assert restored.global_tokens == proposer.global_tokens
    assert restored.model.rates == proposer.model.rates and restored.model.accepted == proposer.model.accepted
    for sequence in _random_workload(5, 5):
        assert propose_once(restored, sequence[:6], 12) == propose_once(proposer, sequence[:6], 12)
    reloaded = build_proposer({"method": "suffix"}, state_dir=tmp_path)
    assert reloaded.global_tokens == proposer.global_tokens


@pytest.mark.parametrize("damage", ["truncated json", "not a zip", "files disagree", "tokens past the vocabulary",
                                    "rates not finite"])
def test_an_unusable_suffix_store_starts_the_proposer_empty_with_a_warning(tmp_path, caplog, damage):
    """The engine's path (`make_proposer` with the state directory): a damaged store, or one learned for a model
    with a smaller vocabulary, is a warning and an empty store, never a failed start."""
    proposer = SuffixProposer()
    for sequence in _random_workload(6, 10):
        proposer.learn(sequence)
    proposer.save(tmp_path)
    config = SpeculativeConfig.from_dict({"method": "suffix", "state_dir": str(tmp_path)})
    assert make_proposer(config, vocab_size=30).global_tokens == proposer.global_tokens  # tokens are < 30
    vocab_size = 30
    if damage == "truncated json":
        meta = tmp_path / "suffix_state.json"
        meta.write_text(meta.read_text()[:40])
    elif damage == "not a zip":
        (tmp_path / "suffix_state.npz").write_bytes(b"not a zip file")
    elif damage == "files disagree":  # another store's outputs beside this one's listing
        other = SuffixProposer()
        other.learn([1, 2, 3, 4])
        other.save(tmp_path / "other")
        (tmp_path / "other" / "suffix_state.npz").replace(tmp_path / "suffix_state.npz")
    elif damage == "rates not finite":
        meta = tmp_path / "suffix_state.json"
        data = json.loads(meta.read_text())
        data["acceptance"]["drafted"][0] = float("nan")
        meta.write_text(json.dumps(data))
    else:
        vocab_size = 20
    with caplog.at_level("WARNING"):
        restored = make_proposer(config, vocab_size=vocab_size)
    assert restored.global_tokens == 0 and "unusable" in caplog.text
    assert propose_once(restored, [1, 2, 3], 4).token_ids == []


def test_two_servers_saving_into_one_directory_at_once_both_succeed(tmp_path, monkeypatch):
    """Each save writes temporary files of its own: a save that another server's save interleaves with (here, all of
    it between this one writing its token file and moving it into place) succeeds and leaves a store that loads."""
    first, second = SuffixProposer(), SuffixProposer()
    for sequence in _random_workload(7, 6):
        first.learn(sequence)
    second.learn([1, 2, 3, 4])
    savez = np.savez
    interleaved = []

    def savez_then_the_other_server_saves(*args, **kwargs):
        savez(*args, **kwargs)
        if not interleaved:
            interleaved.append(True)
            second.save(tmp_path)

    monkeypatch.setattr(np, "savez", savez_then_the_other_server_saves)
    first.save(tmp_path)
    assert interleaved
    restored = SuffixProposer()
    assert restored.load(tmp_path) == 6 and restored.global_tokens == first.global_tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suffix_state.json", "suffix_state.npz"]


def test_suffix_learns_acceptance_rates_from_outcomes():
    proposer = SuffixProposer()
    proposer.learn([1, 2, 3, 4, 5, 6])
    before = propose_once(proposer, [9, 1, 2], 4).score
    for i in range(30):
        proposer.start_request(str(i), [9, 1, 2])
        draft = proposer.propose(str(i), [9, 1, 2], 4)
        assert draft.token_ids == [3, 4, 5, 6]
        proposer.on_tokens_accepted(str(i), [77])  # the target disagrees at once
        proposer.finish_request(str(i), learn=False)
    assert propose_once(proposer, [9, 1, 2], 4).score < before / 2


def test_suffix_config_rejects_a_negative_reuse_cap() -> None:
    with pytest.raises(ValueError, match="reuse_max_tokens"):
        SuffixConfig(reuse_max_tokens=-1)
