"""GLM-4.5's and GLM-4.7-Flash's MTP layer (`num_nextn_predict_layers`, tensors at layer index num_hidden_layers,
DeepSeek's module around a block of the model's own stack) as the `mtp` draft: speculation is lossless, and a
checkpoint whose MTP layer is built to predict exactly what the target will say has every draft accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reasoning_engine import LLM, SamplingParams
from char_models import mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _exact_mtp_checkpoint(source: Path, target: Path) -> Path:
    """A copy of `source` (a GLM checkpoint with an MTP layer) in which every block adds nothing to the residual
    stream (zero output and down projections), so the target's next token is a function f of the current token only:
    argmax lm_head(norm(embed(x))). The MTP layer keeps just the embedding of the token after the hidden state
    (eh_proj = [I | 0], enorm = 1) and ends in the model's own final norm and LM head, so its prediction is
    f(x_{t+1}): exactly the target's token at t + 2."""
    shutil.copytree(source, target)
    config = json.loads((source / "config.json").read_text())
    mtp, hidden = config["num_hidden_layers"], config["hidden_size"]
    tensors = load_file(source / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    layer = f"model.layers.{mtp}."
    tensors[layer + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    tensors[layer + "enorm.weight"] = torch.ones(hidden)
    tensors[layer + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[layer + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors[layer + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


# GLM-4.5's GQA (bf16, and per-channel FP8 with the MTP layer quantized too), GLM-4.7-Flash's MLA
@pytest.mark.parametrize("name", ["glm4_moe_mtp", "glm4_moe_fp8_mtp", "glm4_moe_lite_mtp"])
def test_greedy_output_equals_plain_decoding(tiny_checkpoint, name: str) -> None:
    path = tiny_checkpoint(name).path
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(5, seed=3, low=3, high=30)]
    plain = _tokens(LLM(path, dtype="float32", device="cpu").generate(prompts, GREEDY))
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, speculative_config=MTP)
    assert _tokens(llm.generate(prompts, GREEDY)) == plain
    assert llm.engine.stats().spec_decode["draft_tokens"] > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_an_mtp_layer_that_predicts_the_target_is_accepted(tiny_checkpoint, tmp_path: Path) -> None:
    path = _exact_mtp_checkpoint(tiny_checkpoint("glm4_moe_mtp").path, tmp_path / "exact_mtp")
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(4, seed=5, low=3, high=30)]
    plain = _tokens(LLM(path, dtype="float32", device="cpu").generate(prompts, GREEDY))
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, adaptive=False, speculative_config=MTP)
    assert _tokens(llm.generate(prompts, GREEDY)) == plain
    stats = llm.engine.stats().spec_decode
    # every drafted token is accepted (drafts are shorter only where max_tokens leaves less room)
    assert stats["accepted_tokens"] == stats["draft_tokens"] > len(prompts) * GREEDY.max_tokens // 2, stats
    assert stats["mean_acceptance_length"] > 3.0, stats
