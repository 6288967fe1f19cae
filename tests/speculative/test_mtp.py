"""MTP drafting (DeepSeek-V3's multi-token-prediction layers) in the engine: the drafts are what the checkpoint's MTP
layer predicts (checked against the training-time model of tiny/model.py, chained drafts included), and speculation
with them is lossless."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.speculative.decoder import HybridProposer
from reasoning_engine.speculative.draft import Draft
from reasoning_engine.tiny.model import TinyConfig, TinyDeepseekV3, rope_cos_sin, save_checkpoint
from char_models import mixed_prompts
from test_engine_verification import OracleTree, _two_sample_chi2_pvalue

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TinyDeepseekV3]:
    """A random DeepSeek-V3 checkpoint with one MTP layer, written by the bundled model's own trainer code, and that
    training-time model (the reference for what the MTP layer predicts)."""
    torch.manual_seed(0)
    cfg = TinyConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, initializer_range=0.1)
    model = TinyDeepseekV3(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_mtp")
    save_checkpoint(model, path)
    return path, model


@torch.no_grad()
def reference_chain(model: TinyDeepseekV3, ids: list[int], k: int) -> tuple[list[int], list[float]]:
    """The MTP layer's greedy chain after `ids` (the last one is the root), on the full sequence: position t pairs
    the final-normed hidden state h_t with token t + 1; chained positions take the MTP output and its argmax.
    Returns the k tokens and their probabilities under the MTP layer."""
    cfg = model.cfg
    mtp = model.model.layers[cfg.num_hidden_layers]
    x = torch.tensor([ids])
    cos, sin = rope_cos_sin(cfg, torch.arange(len(ids)))
    h = model.model.embed_tokens(x)
    for layer in model.model.layers[: cfg.num_hidden_layers]:
        h = layer(h, cos, sin, None)
    features, tokens = model.model.norm(h)[:, :-1], x[:, 1:]
    drafts: list[int] = []
    probs_of: list[float] = []
    for _ in range(k):
        cos, sin = rope_cos_sin(cfg, torch.arange(features.shape[1]))
        z = mtp.eh_proj(torch.cat([mtp.enorm(model.model.embed_tokens(tokens)), mtp.hnorm(features)], dim=-1))
        z = mtp(z, cos, sin, None)
        probs = model.lm_head(mtp.shared_head.norm(z[:, -1])).softmax(dim=-1)
        token = int(probs.argmax())
        probs_of.append(float(probs[0, token]))
        drafts.append(token)
        features, tokens = torch.cat([features, z[:, -1:]], dim=1), torch.cat([tokens, torch.tensor([[token]])], dim=1)
    return drafts, probs_of


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_drafts_are_what_the_mtp_layer_predicts(tiny_mtp: tuple[Path, TinyDeepseekV3]) -> None:
    """Across chunked prefill and verification steps whose accepted tree nodes move, the draft model's cache holds
    exactly the MTP layer's states: every chained draft equals the reference computed on the whole sequence."""
    path, model = tiny_mtp
    prompt = torch.randint(2, 128, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = _tokens(LLM(path, dtype="float32", device="cpu").generate([{"prompt_token_ids": prompt}], GREEDY))[0]
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=8, adaptive=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 8})  # static lengths: long drafts
    engine = llm.engine
    engine.spec.proposer = OracleTree({tuple(prompt): plain})  # verification with accepted nodes out of tree order
    drafter = engine.runner.worker.drafters["mtp"]
    request_id = engine.add_request(None, {"prompt_token_ids": prompt}, GREEDY)
    request = engine.groups[request_id][0]
    checked = 0
    while not request.is_finished:
        engine.step()
        if request.is_finished or request.is_prefilling:
            continue
        tokens = request.all_token_ids
        (draft,) = drafter.propose_batch([(request.seq_id, tokens, 3)])
        expected, probs = reference_chain(model, tokens, 3)
        assert draft.token_ids == expected
        # score: expected accepted length under the draft's own probabilities
        assert draft.score == pytest.approx(probs[0] + probs[0] * probs[1] + probs[0] * probs[1] * probs[2], rel=1e-4)
        checked += 1
    assert checked >= 5 and request.output_token_ids == plain
    assert engine.stats().spec_decode["accepted_tokens"] > 10


@pytest.mark.parametrize("config", [MTP, {"method": "hybrid", "methods": ["suffix", "mtp"], "num_speculative_tokens": 4}])
def test_greedy_output_equals_plain_decoding(config: dict, tiny_checkpoint, tiny_mtp) -> None:
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(5, seed=3, low=3, high=30)]
    base = prompts[0]["prompt_token_ids"][:6]
    prompts.append({"prompt_token_ids": base * 5})  # repetitive: the suffix proposer has something to offer
    for path in (tiny_checkpoint("deepseek_v3_mtp").path, tiny_mtp[0]):
        plain = _tokens(LLM(path, dtype="float32", device="cpu").generate(prompts, GREEDY))
        # static lengths: the per-method counts below check the hybrid's dispatch, not the adaptive chooser's
        # timing-dependent choices
        llm = LLM(path, dtype="float32", device="cpu", block_size=4, speculative_config=config, adaptive=False)
        assert _tokens(llm.generate(prompts, GREEDY)) == plain
        stats = llm.engine.stats().spec_decode
        assert stats["draft_tokens"] > 0
        if config["method"] == "hybrid":
            assert set(stats["per_method"]) == {"suffix", "mtp"} and stats["per_method"]["suffix"]["drafts"] > 0
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_aborts_leave_no_blocks_and_no_draft_state(tiny_mtp) -> None:
    llm = LLM(tiny_mtp[0], dtype="float32", device="cpu", block_size=4, speculative_config=MTP)
    engine = llm.engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
           for p in mixed_prompts(4, seed=5, low=3, high=30)]
    for _ in range(5):
        engine.step()
    for request_id in ids[:2]:
        engine.abort_request(request_id)
    for _ in range(3):
        engine.step()
    assert engine.runner.worker.drafters["mtp"].states  # the running requests have draft states
    for request_id in ids[2:]:
        engine.abort_request(request_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.runner.worker.drafters["mtp"].states


def test_sampled_outputs_follow_the_target_distribution(tiny_mtp) -> None:
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    count = 400

    def sample(config: dict | None) -> tuple[list[list[int]], dict]:
        llm = LLM(tiny_mtp[0], dtype="float32", device="cpu", max_num_seqs=128, speculative_config=config,
                  adaptive=False)  # static lengths: drafts verified every step
        # unseeded: a seeded request draws the very same tokens with drafts as without
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4, ignore_eos=True)
        return _tokens(llm.generate([prompt] * count, params)), llm.engine.stats().spec_decode

    plain, _ = sample(None)
    spec, stats = sample({**MTP, "max_batch_size": 1000})
    assert stats["draft_tokens"] > count
    for position in range(1, 4):
        p_value = _two_sample_chi2_pvalue(Counter(t[position] for t in plain), Counter(t[position] for t in spec))
        assert p_value > 1e-3, f"position {position}: p = {p_value}"


class FixedProposer:
    """Always proposes the same path draft with the same score."""

    def __init__(self, tokens: list[int], score: float) -> None:
        self.tokens, self.score = tokens, score
        self.seen: list[list[int]] = []

    def start_request(self, request_id: str, prompt_token_ids) -> None:
        pass

    def propose(self, request_id: str, token_ids, max_draft_tokens: int) -> Draft:
        return Draft.path(self.tokens[:max_draft_tokens], self.score)

    def on_tokens_accepted(self, request_id: str, new_token_ids) -> None:
        self.seen.append(list(new_token_ids))

    def finish_request(self, request_id: str, learn: bool = True, token_ids=None) -> None:
        pass


def test_hybrid_keeps_the_draft_expected_to_gain_most() -> None:
    """Scores are calibrated per method by what the target accepted: a confident method that keeps missing loses out
    to a modest one that is right, and every method sees every accepted token."""
    confident, modest = FixedProposer([1, 2, 3], score=2.5), FixedProposer([7, 8], score=1.0)
    hybrid = HybridProposer({"mtp": confident, "suffix": modest})
    hybrid.start_request("r", [0])
    assert hybrid.propose("r", [0], 3).token_ids == [1, 2, 3]
    for _ in range(5):
        assert len(hybrid.propose_batch([("r", [0], 3)])[0])
        hybrid.on_tokens_accepted("r", [])  # the confident draft is rejected outright
    assert hybrid.propose("r", [0], 3).token_ids == [7, 8]
    hybrid.on_tokens_accepted("r", [7, 8])
    assert hybrid.estimates["suffix"].accepted_tokens == 2 and confident.seen[-1] == [7, 8]
    mtp = hybrid.method_stats()["mtp"]
    assert mtp["accepted_tokens"] == 0 and 1 <= mtp["drafts"] < 5  # it stopped being chosen after a few misses


def test_a_checkpoint_without_mtp_layers_is_rejected(deepseek_dir: Path, llama_dir: Path) -> None:
    for path in (deepseek_dir, llama_dir):
        with pytest.raises(ValueError, match="speculative_config.method"):
            LLM(path, dtype="float32", device="cpu", speculative_config=MTP)


def test_bundled_model_drafts_with_its_trained_mtp_layer() -> None:
    from reasoning_engine.tiny.data import eval_samples

    llm = LLM(None, speculative_config={"method": "mtp", "num_speculative_tokens": 4})
    plain_llm = LLM(None)
    samples = eval_samples(per_task=1)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    conversations = [s.messages for s in samples]
    spec = _tokens(llm.chat(conversations, params, chat_template_kwargs={"thinking": True}))
    assert spec == _tokens(plain_llm.chat(conversations, params, chat_template_kwargs={"thinking": True}))
    stats = llm.engine.stats().spec_decode
    print(f"bundled model, mtp k=4: mean acceptance length {stats['mean_acceptance_length']:.2f}")
    assert stats["mean_acceptance_length"] > 1.5
