"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) in the engine, beyond the parity tests: with `index_topk` covering
the context it is dense MLA; chunked prefill and prefix-cache hits (the indexer's keys read from cached blocks) give
the outputs of one-shot prefill; the indexer's key cache is counted in the cache size."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from .checkpoints import TinyCheckpoint, prompts
from .st_files import read_tensors, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}


def _variant_of(ckpt: TinyCheckpoint, folder: Path, edit: Callable[[dict], dict], keep: Callable[[str], bool]) -> Path:
    """A copy of the checkpoint with its config.json edited and only the tensors `keep` accepts."""
    shutil.copytree(ckpt.path, folder)
    config = edit(json.loads((folder / "config.json").read_text()))
    (folder / "config.json").write_text(json.dumps(config))
    write_tensors(folder, {k: v for k, v in read_tensors(folder).items() if keep(k)})
    return folder


def _generate(llm, batch: list[list[int]]) -> list[list[int]]:
    from reasoning_engine import SamplingParams

    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], SamplingParams(**GREEDY))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_index_topk_covering_the_context_is_dense_mla(tiny_checkpoint: Callable[[str], TinyCheckpoint],
                                                      tmp_path: Path) -> None:
    """Same weights three ways: DeepSeek-V3.2 with index_topk 4096 (past every context here), the same tensors minus
    the indexers as a plain DeepSeek-V3 checkpoint, and the variant's index_topk of 8, which must differ."""
    from reasoning_engine import LLM

    ckpt = tiny_checkpoint("deepseek_v32")
    wide = _variant_of(ckpt, tmp_path / "wide", lambda c: {**c, "index_topk": 4096}, lambda k: True)
    dense_keys = ("index_topk", "index_n_heads", "index_head_dim", "indexer_types", "layer_types", "mlp_layer_types")
    dense = _variant_of(
        ckpt, tmp_path / "dense",
        lambda c: {**{k: v for k, v in c.items() if k not in dense_keys}, "model_type": "deepseek_v3",
                   "architectures": ["DeepseekV3ForCausalLM"], "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
        lambda k: ".indexer." not in k)
    batch = prompts(ckpt.vocab_size)
    runs = {name: LLM(str(path), dtype="float32", device="cpu") for name, path in
            (("wide", wide), ("dense", dense), ("sparse", ckpt.path))}
    logits = {name: llm.compute_logits(batch) for name, llm in runs.items()}
    for got, want in zip(logits["wide"], logits["dense"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert _generate(runs["wide"], batch) == _generate(runs["dense"], batch)
    # prompts past 8 tokens attend sparsely at index_topk 8, so the longest prompt's logits move
    assert not torch.allclose(logits["sparse"][-1], logits["dense"][-1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_chunked_prefill_and_prefix_cache_match_one_shot(tiny_checkpoint: Callable[[str], TinyCheckpoint],
                                                         name: str) -> None:
    """Prompts of 3 to 5 blocks (16 tokens), well past index_topk 8: cut into chunks of 13 tokens (mid-block), then
    served again from the prefix cache with a new last token, against one-shot prefill without a prefix cache."""
    from reasoning_engine import LLM

    ckpt = tiny_checkpoint(name)
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(2, ckpt.vocab_size, (n,), generator=gen).tolist() for n in (41, 57, 70)]
    again = [ids[:-1] + [(ids[-1] + 1) % ckpt.vocab_size or 2] for ids in batch]
    one_shot = LLM(str(ckpt.path), dtype="float32", device="cpu", enable_prefix_caching=False)
    want, want_again = _generate(one_shot, batch), _generate(one_shot, again)
    chunked = LLM(str(ckpt.path), dtype="float32", device="cpu", max_num_batched_tokens=13)
    assert _generate(chunked, batch) == want
    from reasoning_engine import SamplingParams

    outs = chunked.generate([{"prompt_token_ids": ids} for ids in again], SamplingParams(**GREEDY))
    assert all(o.num_cached_tokens >= 32 for o in outs)
    assert [list(o.outputs[0].token_ids) for o in outs] == want_again


@pytest.mark.parametrize("name, indexed_layers", [("deepseek_v32", 3), ("glm_moe_dsa", 2)])
def test_cache_bytes_count_the_indexer_keys(tiny_checkpoint: Callable[[str], TinyCheckpoint], name: str,
                                            indexed_layers: int) -> None:
    """Per layer the latent (32) and rope key (8); per layer with an indexer (GLM-5's "shared" layer has none) its
    16-channel key."""
    from reasoning_engine.cache_groups import cache_bytes
    from reasoning_engine.config import load_model_config
    from reasoning_engine.models.registry import build_model

    config = load_model_config(tiny_checkpoint(name).path)
    model = build_model(config, torch.float32, torch.device("cpu"), max_positions=64)
    assert cache_bytes(model.attention_layers(), torch.float32) == ((32 + 8) * 3 + 16 * indexed_layers) * 4


def test_speculative_decoding_matches_plain_greedy(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> None:
    """Suffix-tree drafts are verified in one pass under the draft-tree mask (the indexer sees only a node's
    ancestors among the step's tokens) and accepted nodes' latent and index keys move into place together."""
    from reasoning_engine import LLM, SamplingParams

    ckpt = tiny_checkpoint("glm_moe_dsa")
    gen = torch.Generator().manual_seed(2)
    motif = torch.randint(2, ckpt.vocab_size, (6,), generator=gen).tolist()
    batch = [motif * 5, torch.randint(2, ckpt.vocab_size, (20,), generator=gen).tolist() + motif * 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(ckpt.path), dtype="float32", device="cpu", enable_prefix_caching=False)
    want = [list(o.outputs[0].token_ids) for o in plain.generate([{"prompt_token_ids": p} for p in batch], params)]
    spec = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=4, adaptive=False,
               speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    outs = spec.generate([{"prompt_token_ids": p} for p in batch], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert sum(o.spec_draft_tokens for o in outs) > 0


def test_glm5_shared_layers_from_the_frequency_fields(tiny_checkpoint: Callable[[str], TinyCheckpoint],
                                                      tmp_path: Path) -> None:
    """A config giving GLM-5's indexer schedule as `index_topk_freq` / `index_skip_topk_offset` (transformers derives
    `indexer_types` from them) reads as the variant's explicit full / shared / full."""
    from reasoning_engine import LLM

    ckpt = tiny_checkpoint("glm_moe_dsa")
    folder = _variant_of(ckpt, tmp_path / "freq", lambda c: {**{k: v for k, v in c.items() if k != "indexer_types"},
                                                             "index_topk_freq": 2, "index_skip_topk_offset": 1},
                         lambda k: True)
    llm = LLM(str(folder), dtype="float32", device="cpu")
    layers = llm.engine.model.layers
    assert [layer.self_attn.indexer is not None for layer in layers] == [True, False, True]
    assert layers[1].self_attn.shared_indexer == (layers[0].self_attn.indexer,)
    batch = prompts(ckpt.vocab_size)
    explicit = LLM(str(ckpt.path), dtype="float32", device="cpu")
    for got, want in zip(llm.compute_logits(batch), explicit.compute_logits(batch)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_mtp_drafts_match_plain_greedy(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> None:
    """DeepSeek-V3.2's MTP layer is an MLA layer with its own indexer (and index-key cache) drafting for the target."""
    from reasoning_engine import LLM, SamplingParams

    path = tiny_checkpoint("deepseek_v32_mtp").path
    batch = [{"prompt_token_ids": p} for p in prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [list(o.outputs[0].token_ids) for o in LLM(str(path), dtype="float32", device="cpu").generate(batch, params)]
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)] == plain
    assert llm.engine.stats().spec_decode["draft_tokens"] > 0
    drafter = llm.engine.runner.worker.drafters["mtp"].model
    assert all(attn.indexer is not None for attn in drafter.attention_layers())


def test_indexer_head_weights_in_the_dtype_transformers_uses(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> None:
    """In a bfloat16 model transformers runs `indexer.weights_proj` in bfloat16 (its `_keep_in_fp32_modules` apply
    to float16 only), and so do we: same dtype, same values, and the engine runs with them."""
    dtype = torch.bfloat16
    from transformers import AutoModelForCausalLM

    from reasoning_engine import LLM, SamplingParams
    from reasoning_engine.layers.indexer import Indexer

    ckpt = tiny_checkpoint("deepseek_v32")
    llm = LLM(str(ckpt.path), dtype=str(dtype).removeprefix("torch."), device="cpu")
    ours = [m.weights_proj.weight for m in llm.engine.model.modules() if isinstance(m, Indexer)]
    ref = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=dtype)
    theirs = [m.weights_proj.weight for name, m in ref.named_modules() if name.endswith("indexer")]
    assert ours and len(ours) == len(theirs)
    for got, want in zip(ours, theirs):
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    out = llm.generate([prompts(ckpt.vocab_size)[-1]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
