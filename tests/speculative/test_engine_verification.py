"""Speculative decoding inside the engine: lossless for greedy and sampled decoding, tree drafts, no leaked blocks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.speculative.draft import Draft
from char_models import mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _repetitive_prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(5, 100, (12,), generator=gen).tolist()
    return [{"prompt_token_ids": base * 4}, {"prompt_token_ids": base[:5] * 6 + [7, 8]}, {"prompt_token_ids": [9, 10, 11]}]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["llama_dir", "deepseek_dir"])
@pytest.mark.parametrize("method", ["ngram", "lookup", "suffix"])
def test_greedy_output_equals_plain_decoding(family: str, method: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family)
    prompts = _repetitive_prompts()
    plain = _tokens(LLM(path, dtype="float32", device="cpu").generate(prompts, GREEDY))
    llm = LLM(path, dtype="float32", device="cpu", adaptive=False,  # static lengths: drafts verified every step
              speculative_config={"method": method, "num_speculative_tokens": 6})
    assert _tokens(llm.generate(prompts, GREEDY)) == plain
    stats = llm.engine.stats().spec_decode
    assert stats["accepted_tokens"] > 0 and stats["mean_acceptance_length"] > 1.0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


class OracleTree:
    """Proposes a tree whose first sibling at every level is wrong and whose second is the known continuation, so
    verification must walk siblings and move accepted K/V out of tree order."""

    method = "oracle"

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers
        self.prompts: dict[str, tuple[int, ...]] = {}

    def start_request(self, request_id: str, prompt_token_ids) -> None:
        self.prompts[request_id] = tuple(prompt_token_ids)

    def propose(self, request_id: str, token_ids, max_draft_tokens: int) -> Draft:
        prompt = self.prompts[request_id]
        done = len(token_ids) - len(prompt)
        truth = self.answers[prompt][done : done + 3]
        tokens, parents, parent = [], [], -1
        for depth, token in enumerate(truth):
            if len(tokens) + 2 > max_draft_tokens:
                break
            tokens += [(token + 1) % 100, token]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return Draft(tokens, parents)

    def on_tokens_accepted(self, request_id: str, new_token_ids) -> None:
        pass

    def finish_request(self, request_id: str, learn: bool = True, token_ids=None) -> None:
        self.prompts.pop(request_id, None)


@pytest.mark.parametrize("family", ["llama_dir", "deepseek_dir"])
def test_tree_drafts_verify_losslessly_inside_a_mixed_batch(family: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(8, seed=11, low=3, high=40)]
    plain = _tokens(LLM(path, dtype="float32", device="cpu").generate(prompts, GREEDY))
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, adaptive=False,  # static lengths: whole trees
              speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    llm.engine.spec.proposer = OracleTree({tuple(p["prompt_token_ids"]): out for p, out in zip(prompts, plain)})
    assert _tokens(llm.generate(prompts, GREEDY)) == plain
    stats = llm.engine.stats().spec_decode
    assert stats["mean_acceptance_length"] > 2.0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def _two_sample_chi2_pvalue(a: Counter, b: Counter) -> float:
    """Two-sample chi-square homogeneity test over the categories seen (sparse ones pooled)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    categories = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    pooled: list[tuple[int, int]] = []
    rest = [0, 0]
    for key in categories:
        if a[key] + b[key] >= 10:
            pooled.append((a[key], b[key]))
        else:
            rest[0] += a[key]
            rest[1] += b[key]
    if sum(rest):
        pooled.append((rest[0], rest[1]))
    stat = 0.0
    for x, y in pooled:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    dof = len(pooled) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_outputs_follow_the_target_distribution(llama_dir: Path) -> None:
    """Per-position token frequencies with speculation match plain sampling (chi-square over many unseeded samples:
    a seeded request's tokens are the same with and without drafts). The drafts are trees whose first sibling is
    wrong and second is the greedy continuation, so both acceptance and the residual after a rejected sibling are
    exercised."""
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    count = 600

    def sample(llm: LLM) -> list[list[int]]:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4, ignore_eos=True)
        return _tokens(llm.generate([prompt] * count, params))

    plain = sample(LLM(llama_dir, dtype="float32", device="cpu", max_num_seqs=128))
    spec_llm = LLM(llama_dir, dtype="float32", device="cpu", max_num_seqs=128, adaptive=False,  # verify every step
                   speculative_config={"method": "ngram", "num_speculative_tokens": 6, "max_batch_size": 1000})
    greedy = _tokens(LLM(llama_dir, dtype="float32", device="cpu").generate([prompt], GREEDY))[0]
    spec_llm.engine.spec.proposer = OracleTree({tuple(prompt["prompt_token_ids"]): greedy})
    spec = sample(spec_llm)
    stats = spec_llm.engine.stats().spec_decode
    assert stats["accepted_tokens"] > 20 and stats["draft_tokens"] > 2 * stats["accepted_tokens"]
    for position in range(1, 4):
        p_value = _two_sample_chi2_pvalue(Counter(t[position] for t in plain), Counter(t[position] for t in spec))
        assert p_value > 1e-3, f"position {position}: p = {p_value}"


def test_aborts_with_speculation_leave_no_blocks(llama_dir: Path) -> None:
    llm = LLM(llama_dir, dtype="float32", device="cpu", speculative_config={"method": "suffix", "num_speculative_tokens": 8})
    engine = llm.engine
    ids = [engine.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
           for p in _repetitive_prompts()]
    for _ in range(6):
        engine.step()
    for request_id in ids:
        engine.abort_request(request_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_outputs_decoded_without_drafts_still_teach_the_suffix_store(llama_dir: Path) -> None:
    """Three requests above a batch cap of one never draft, so the proposer never hears of their tokens step by
    step; each finished output (with the prompt's tail) still reaches the global store."""
    prompts = _repetitive_prompts()
    llm = LLM(llama_dir, dtype="float32", device="cpu", adaptive=False,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4, "max_batch_size": 1})
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().spec_decode["drafts"] == 0
    proposer = llm.engine.spec.proposer
    tail = proposer.config.prompt_tail
    assert proposer.global_tokens == sum(len(o.outputs[0].token_ids) + min(tail, len(p["prompt_token_ids"]))
                                         for o, p in zip(outs, prompts))


def test_a_suffix_store_learned_for_a_larger_vocabulary_is_set_aside(llama_dir: Path, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A store in the state directory holding tokens past this model's vocabulary (learned for another model) would
    draft them into the verifying forward; it is set aside with a warning, and outputs equal plain decoding."""
    from reasoning_engine.speculative import SuffixProposer

    prompts = _repetitive_prompts()
    plain = _tokens(LLM(llama_dir, dtype="float32", device="cpu").generate(prompts, GREEDY))
    foreign = SuffixProposer()
    for prompt, output in zip(prompts, plain):  # each greedy answer's start, then ids past the embedding's rows
        foreign.learn(prompt["prompt_token_ids"] + output[:3] + [100_000 + i for i in range(8)])
    foreign.save(tmp_path)
    spec = {"method": "suffix", "num_speculative_tokens": 4, "state_dir": str(tmp_path)}
    with caplog.at_level("WARNING"):
        llm = LLM(llama_dir, dtype="float32", device="cpu", speculative_config=spec, adaptive=False)
    assert "vocabulary" in caplog.text and llm.engine.spec.proposer.global_tokens == 0
    assert _tokens(llm.generate(prompts, GREEDY)) == plain


def test_the_suffix_store_is_saved_while_serving_not_only_at_shutdown(llama_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A server killed without a shutdown keeps what its proposer learned up to the last periodic save."""
    from reasoning_engine.speculative import SuffixProposer, decoder

    monkeypatch.setattr(decoder, "SAVE_EVERY_S", 0.0)
    spec = {"method": "suffix", "num_speculative_tokens": 4, "state_dir": str(tmp_path)}
    llm = LLM(llama_dir, dtype="float32", device="cpu", speculative_config=spec, adaptive=False)
    llm.generate(_repetitive_prompts(), GREEDY)
    learned = llm.engine.spec.proposer.global_tokens
    saved = SuffixProposer()
    assert learned > 0 and saved.load(tmp_path) == 3 and saved.global_tokens == learned  # no shutdown yet


def test_invalid_speculative_config_names_the_field(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(llama_dir, dtype="float32", device="cpu", speculative_config={"method": "magic"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(llama_dir, dtype="float32", device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_a_seeded_request_draws_the_same_tokens_alone_in_any_batch_and_with_or_without_drafts(llama_dir: Path) -> None:
    """A seeded request's draw at output position t depends on (seed, sample, t) and the distribution there only:
    verifying a draft draws as a plain step does. So its tokens are the same without speculation, alone with ngram
    drafts verified, beside 16 greedy requests (above the batch cap: no drafts), under a one-token budget (every
    draft dropped), preempted on a small cache, and with the adaptive engine choosing the lengths. The two samples
    of n = 2 have streams of their own (seed + index gave sample 1 of seed s the stream of seed s + 1)."""
    prompt = {"prompt_token_ids": [20, 21, 22, 23, 24] * 6}  # repetitive: the ngram proposer drafts
    crowd = [{"prompt_token_ids": [30 + i, 40, 50 + i]} for i in range(16)]
    long = [{"prompt_token_ids": [30 + i, 40, 50 + i] * 10} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    engines = {
        "plain": LLM(llama_dir, dtype="float32", device="cpu", adaptive=False),
        "drafts": LLM(llama_dir, dtype="float32", device="cpu", adaptive=False, speculative_config=ngram),
        "budget": LLM(llama_dir, dtype="float32", device="cpu", adaptive=False, speculative_config=ngram,
                      max_num_batched_tokens=1),
        "preempted": LLM(llama_dir, dtype="float32", device="cpu", adaptive=False, speculative_config=ngram,
                         block_size=4, kv_cache_blocks=24, max_model_len=64),
        "adaptive": LLM(llama_dir, dtype="float32", device="cpu", speculative_config=ngram),
    }
    drafted = 0
    for seed in range(3):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, n=2, max_tokens=20, ignore_eos=True)
        want = [s.token_ids for s in engines["plain"].generate(prompt, params)[0].outputs]
        assert want[0] != want[1]
        alone = engines["drafts"].generate(prompt, params)[0]
        drafted += alone.spec_draft_tokens
        assert [s.token_ids for s in alone.outputs] == want, seed
        beside = engines["drafts"].generate([prompt] + crowd, [params] + [greedy] * 16)[0]
        assert beside.spec_draft_tokens == 0 and [s.token_ids for s in beside.outputs] == want, seed
        budget = engines["budget"].generate(prompt, params)[0]
        assert [s.token_ids for s in budget.outputs] == want, seed
        for name in ("preempted", "adaptive"):
            out = engines[name].generate([prompt] + long, [params] + [greedy] * 3)[0]
            assert [s.token_ids for s in out.outputs] == want, (name, seed)
        if seed:
            assert want[0] != previous[1]  # seed s sample 0 against seed s - 1 sample 1
        previous = want
    assert drafted > 0
    assert engines["preempted"].engine.num_preemptions > 0


def test_speculation_counters_count_only_verified_drafts(llama_dir: Path) -> None:
    """Drafts the scheduler drops (a one-token budget drops them all) or the grammar trims are not counted as
    drafted: the counters (and a hybrid's per method) agree with what verification saw, so the acceptance rate is
    that of verified tokens."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    prompts = _repetitive_prompts()[:2]
    budget = LLM(llama_dir, dtype="float32", device="cpu", adaptive=False, speculative_config=ngram,
                 max_num_batched_tokens=1)
    outs = budget.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stats = budget.engine.stats().spec_decode
    assert stats["drafts"] == stats["draft_tokens"] == stats["accepted_tokens"] == 0
    assert all(o.spec_draft_tokens == 0 for o in outs)

    llm = LLM(llama_dir, dtype="float32", device="cpu", adaptive=False,
              speculative_config={"method": "hybrid", "methods": ["ngram", "suffix"], "num_speculative_tokens": 4})
    proposed: list[int] = []
    propose_batch = llm.engine.spec.propose_batch

    def recording(items: list, keep=None) -> list[Draft]:
        drafts = propose_batch(items, keep)
        proposed.extend(len(d) for d in drafts)
        return drafts
    llm.engine.spec.propose_batch = recording
    text_prompts = [{"prompt_token_ids": llm.tokenizer.encode(t)} for t in ("abcabcabc ", "xyz xyz ", "0101 ")]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": "(ab|abc|[0-9]){1,20}"})
    outs = llm.generate(text_prompts, params)
    stats = llm.engine.stats().spec_decode
    verified = sum(o.spec_draft_tokens for o in outs)
    assert 0 < verified < sum(proposed)  # the grammar trimmed some drafts
    assert stats["draft_tokens"] == verified
    assert stats["accepted_tokens"] == sum(o.spec_accepted_tokens for o in outs)
    assert stats["acceptance_rate"] == pytest.approx(stats["accepted_tokens"] / verified)
    assert sum(m["draft_tokens"] for m in stats["per_method"].values()) == verified
