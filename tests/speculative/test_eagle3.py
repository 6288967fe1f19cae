"""EAGLE-3 draft heads in the published `LlamaForCausalLMEagle3` layout: a tiny random head written here loads, its
drafts are what the layout defines (checked against an independent plain-torch reading of it on the whole sequence,
chained drafts included), and speculation with it is lossless."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.config import load_model_config
from reasoning_engine.speculative.eagle3 import aux_layer_ids
from char_models import mixed_prompts
from test_engine_verification import OracleTree, _two_sample_chi2_pvalue

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, DRAFT_VOCAB = 128, 64, 4, 2, 16, 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama: enough layers for the default low / middle / high choice."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                         bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharp logits: distinct greedy paths
    path = tmp_path_factory.mktemp("eagle_target")
    model.save_pretrained(path)
    return path


def write_eagle3_head(folder: Path, seed: int, layer_ids: list[int] | None = None, own_embedding: bool = False) -> dict:
    """A random EAGLE-3 head as the published heads are laid out; returns its tensors."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=gen)

    def norm() -> torch.Tensor:
        return 1.0 + rand(HIDDEN, scale=0.1)

    drafted = torch.sort(torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB]).values  # target ids of the draft vocab
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[drafted] = True
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    tensors = {
        "fc.weight": rand(HIDDEN, 3 * HIDDEN, scale=0.1),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": rand(HIDDEN, q),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": rand(96, HIDDEN),
        "midlayer.mlp.up_proj.weight": rand(96, HIDDEN),
        "midlayer.mlp.down_proj.weight": rand(HIDDEN, 96),
        "norm.weight": norm(),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN, scale=1.0),
        "d2t": drafted - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(VOCAB, HIDDEN, scale=1.0)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 96, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": HIDDEN, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)[:, None, :]
    half = torch.cat([-x[..., HEAD_DIM // 2:], x[..., : HEAD_DIM // 2]], dim=-1)
    return x * angles.cos() + half * angles.sin()


def reference_head(t: dict, features: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over a whole sequence: features [T, hidden], tokens [T] (token t + 1 for position t). Returns the
    final-normed and the pre-norm output of every position."""
    n = len(tokens)
    x = torch.cat([_rms(embed[tokens], t["midlayer.input_layernorm.weight"]),
                   _rms(features, t["midlayer.hidden_norm.weight"])], dim=-1)
    positions = torch.arange(n).float()
    q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
    k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, dim=1), v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    r = features + attn @ t["midlayer.self_attn.o_proj.weight"].T
    h = _rms(r, t["midlayer.post_attention_layernorm.weight"])
    gate, up = h @ t["midlayer.mlp.gate_proj.weight"].T, h @ t["midlayer.mlp.up_proj.weight"].T
    r = r + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T
    return _rms(r, t["norm.weight"]), r


@torch.no_grad()
def reference_chain(target: torch.nn.Module, t: dict, layer_ids: list[int], ids: list[int], k: int) -> list[int]:
    """Greedy chain after `ids` (the last one is the root): target layer outputs fused by fc for the known positions,
    the head's own pre-norm output for chained ones; draft ids mapped to target ids with d2t."""
    hidden = target(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i + 1]: output of layer i
    features = torch.cat([hidden[i + 1][0, :-1] for i in layer_ids], dim=-1) @ t["fc.weight"].T
    tokens = torch.tensor(ids[1:])
    embed = t.get("embed_tokens.weight", target.model.embed_tokens.weight)
    drafts: list[int] = []
    for _ in range(k):
        normed, prenorm = reference_head(t, features, tokens, embed)
        draft_id = int((normed[-1] @ t["lm_head.weight"].T).argmax())
        token = draft_id + int(t["d2t"][draft_id])
        drafts.append(token)
        features, tokens = torch.cat([features, prenorm[-1:]]), torch.cat([tokens, torch.tensor([token])])
    return drafts


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("layer_ids,own_embedding", [(None, False), ([0, 2, 1], True)])
def test_head_drafts_what_the_published_layout_defines(target_dir: Path, tmp_path: Path, layer_ids, own_embedding) -> None:
    from transformers import LlamaForCausalLM

    tensors = write_eagle3_head(tmp_path / "head", seed=1, layer_ids=layer_ids, own_embedding=own_embedding)
    used_layers = layer_ids or [1, 4 // 2 - 1, 4 - 4]  # default: outputs of layers 1, L // 2 - 1, L - 4
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = torch.randint(2, VOCAB, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    plain = _tokens(LLM(target_dir, dtype="float32", device="cpu").generate([{"prompt_token_ids": prompt}], GREEDY))[0]
    llm = LLM(target_dir, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=8, adaptive=False,
              speculative_config={"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 8})
    engine = llm.engine
    engine.spec.proposer = OracleTree({tuple(prompt): plain})  # verification with accepted nodes out of tree order
    drafter = engine.runner.worker.drafters["eagle3"]
    request_id = engine.add_request(None, {"prompt_token_ids": prompt}, GREEDY)
    request = engine.groups[request_id][0]
    checked = 0
    while not request.is_finished:
        engine.step()
        if request.is_finished or request.is_prefilling:
            continue
        (draft,) = drafter.propose_batch([(request.seq_id, request.all_token_ids, 3)])
        assert draft.token_ids == reference_chain(target, tensors, used_layers, request.all_token_ids, 3)
        assert all(tensors["t2d"][token] for token in draft.token_ids)
        checked += 1
    assert checked >= 5 and request.output_token_ids == plain
    assert engine.stats().spec_decode["accepted_tokens"] > 10


@pytest.mark.parametrize("config", [{"method": "eagle3", "num_speculative_tokens": 4},
                                    {"method": "hybrid", "methods": ["eagle3", "ngram"], "num_speculative_tokens": 4}])
def test_greedy_output_equals_plain_decoding(target_dir: Path, tmp_path: Path, config: dict) -> None:
    write_eagle3_head(tmp_path / "head", seed=3)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(5, seed=4, low=3, high=30)]
    prompts.append({"prompt_token_ids": prompts[0]["prompt_token_ids"][:5] * 6})
    plain = _tokens(LLM(target_dir, dtype="float32", device="cpu").generate(prompts, GREEDY))
    llm = LLM(target_dir, dtype="float32", device="cpu", block_size=4,
              speculative_config={**config, "model": str(tmp_path / "head")})
    assert _tokens(llm.generate(prompts, GREEDY)) == plain
    stats = llm.engine.stats().spec_decode
    assert stats["draft_tokens"] > 0
    if config["method"] == "hybrid":
        assert set(stats["per_method"]) == {"eagle3", "ngram"}
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.slow
def test_tensor_parallel_output_equals_plain_decoding(target_dir: Path, tmp_path: Path) -> None:
    """The head whole on both ranks, beside a target split over two (it reads the target's split embedding and
    whole intermediate features); a cache small enough to preempt."""
    write_eagle3_head(tmp_path / "head", seed=3)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(6, seed=4, low=3, high=30)]
    plain = _tokens(LLM(target_dir, dtype="float32", device="cpu").generate(prompts, GREEDY))
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 4}
    with LLM(target_dir, dtype="float32", device="cpu", block_size=4, kv_cache_blocks=32, max_model_len=128,
             tensor_parallel_size=2, speculative_config=spec) as llm:
        assert _tokens(llm.generate(prompts, GREEDY)) == plain
        assert llm.engine.stats().spec_decode["draft_tokens"] > 0 and llm.engine.num_preemptions > 0


def test_aborts_leave_no_blocks(target_dir: Path, tmp_path: Path) -> None:
    write_eagle3_head(tmp_path / "head", seed=5)
    llm = LLM(target_dir, dtype="float32", device="cpu", block_size=4,
              speculative_config={"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 5})
    engine = llm.engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
           for p in mixed_prompts(4, seed=6, low=3, high=30)]
    for _ in range(6):
        engine.step()
    for request_id in ids:
        engine.abort_request(request_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.runner.worker.drafters["eagle3"].states


def test_sampled_outputs_follow_the_target_distribution(target_dir: Path, tmp_path: Path) -> None:
    write_eagle3_head(tmp_path / "head", seed=7)
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    count = 400

    def sample(config: dict | None) -> tuple[list[list[int]], dict]:
        llm = LLM(target_dir, dtype="float32", device="cpu", max_num_seqs=128, speculative_config=config,
                  adaptive=False)  # static lengths: drafts verified every step
        # unseeded: a seeded request draws the very same tokens with drafts as without
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4, ignore_eos=True)
        return _tokens(llm.generate([prompt] * count, params)), llm.engine.stats().spec_decode

    plain, _ = sample(None)
    spec, stats = sample({"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3,
                          "max_batch_size": 1000})
    assert stats["draft_tokens"] > count
    for position in range(1, 4):
        p_value = _two_sample_chi2_pvalue(Counter(t[position] for t in plain), Counter(t[position] for t in spec))
        assert p_value > 1e-3, f"position {position}: p = {p_value}"


def test_bad_configs_name_the_field(target_dir: Path, llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(target_dir, dtype="float32", device="cpu", speculative_config={"method": "eagle3"})
    with pytest.raises(ValueError, match="speculative_config.model"):  # a plain Llama is not a head
        LLM(target_dir, dtype="float32", device="cpu", speculative_config={"method": "eagle3", "model": str(llama_dir)})
    write_eagle3_head(tmp_path / "head", seed=8)
    with pytest.raises(ValueError, match="speculative_config.model: the EAGLE-3 head reads target layers"):
        aux_layer_ids(load_model_config(tmp_path / "head"), 2)  # 2 layers: no default low / middle / high
    with pytest.raises(ValueError, match="speculative_config.model: the head's vocab_size"):
        LLM(llama_dir, dtype="float32", device="cpu", speculative_config={"method": "eagle3", "model": str(tmp_path / "head")})
    with pytest.raises(ValueError, match="speculative_config.methods"):
        LLM(target_dir, dtype="float32", device="cpu", speculative_config={"method": "hybrid", "methods": ["ngram"]})
