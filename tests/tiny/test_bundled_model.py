"""The bundled checkpoint: multimodal Kimi K2.5 layout whose language model is DeepSeek-V3-shaped with an MTP layer,
parity of that language model with transformers, and greedy answers. (Pictures: test_vision.py.)"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reasoning_engine.tiny import BUNDLED_MODEL_DIR
from reasoning_engine.tiny.data import GENERATORS, Sample, calculator_tool, check_answer
from reasoning_engine.tiny.eval import MAX_NEW_TOKENS, parse_completion
from reasoning_engine.tiny.model import load_checkpoint

SHIPPED = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
           "processor_config.json"]
TEXT = "language_model."


def _outer_config() -> dict:
    return json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())


def _config() -> dict:
    """The language model's config (kimi_k25's text_config)."""
    return _outer_config()["text_config"]


def test_shipped_files_and_size() -> None:
    assert sum((BUNDLED_MODEL_DIR / f).stat().st_size for f in SHIPPED) < 20 * 2**20


def test_config_is_kimi_k25_with_a_deepseek_v3_language_model() -> None:
    outer = _outer_config()
    assert outer["model_type"] == "kimi_k25" and outer["architectures"] == ["Kimi_K25ForConditionalGeneration"]
    assert outer["vision_config"]["num_hidden_layers"] >= 2 and outer["vision_config"]["merge_kernel_size"] == [2, 2]
    cfg = _config()
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["n_routed_experts"] >= 8 and cfg["n_shared_experts"] == 1 and cfg["first_k_dense_replace"] == 1
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid" and cfg["q_lora_rank"]
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["rope_interleave"] is True


def test_checkpoint_tensor_names() -> None:
    cfg = _config()
    mtp = f"model.layers.{cfg['num_hidden_layers']}"
    with safe_open(str(BUNDLED_MODEL_DIR / "model.safetensors"), "pt") as f:
        all_keys = set(f.keys())
        keys = {k.removeprefix(TEXT) for k in all_keys if k.startswith(TEXT)}
        assert torch.equal(f.get_tensor(f"{TEXT}{mtp}.embed_tokens.weight"),
                           f.get_tensor(f"{TEXT}model.embed_tokens.weight"))
        assert torch.equal(f.get_tensor(f"{TEXT}{mtp}.shared_head.head.weight"), f.get_tensor(f"{TEXT}lm_head.weight"))
    # The rest is the vision tower and projector, under Moonshot's names.
    assert all(k.startswith((TEXT, "vision_tower.", "mm_projector.")) for k in all_keys)
    for name in ["vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                 "vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.encoder.blocks.0.mlp.fc1.bias",
                 "vision_tower.encoder.final_layernorm.weight", "mm_projector.pre_norm.weight",
                 "mm_projector.proj.0.weight", "mm_projector.proj.2.weight"]:
        assert name in all_keys, name
    for name in ["eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "self_attn.q_a_proj.weight", "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight",
                 "mlp.shared_experts.up_proj.weight"]:
        assert f"{mtp}.{name}" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "model.layers.1.mlp.gate.weight" in keys
    for name in ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                 "o_proj"]:
        assert f"model.layers.1.self_attn.{name}.weight" in keys


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory):
    """transformers' DeepseekV3ForCausalLM on the bundled language model (its text_config and `language_model.`
    tensors written out as a DeepSeek-V3 checkpoint, so MtpModel can read the MTP layer too)."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    folder = tmp_path_factory.mktemp("bundled_text")
    (folder / "config.json").write_text(json.dumps(_config()))
    tensors = load_file(str(BUNDLED_MODEL_DIR / "model.safetensors"))
    save_file({k.removeprefix(TEXT): v for k, v in tensors.items() if k.startswith(TEXT)},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)


def test_transformers_reproduces_the_training_model(hf_model, tokenizer) -> None:
    """Main logits and MTP logits of transformers' implementation equal our training model's (1e-4 relative)."""
    from transformers.modeling_layers import MtpModel

    ours = load_checkpoint(BUNDLED_MODEL_DIR)
    rng = random.Random(0)
    texts = [GENERATORS[t](rng) for t in ("addition", "sorting", "calculator_result")]
    for s in texts:
        ids = torch.tensor([tokenizer(s.prompt() + s.completion()).input_ids])
        with torch.no_grad():
            logits, mtp_logits = ours(ids, with_mtp=True)
            hf = hf_model(ids).logits
        assert (hf - logits).abs().max() <= 1e-4 * hf.abs().max()
    n = _config()["num_hidden_layers"]
    hf_model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    mtp = MtpModel.from_pretrained(hf_model)
    with torch.no_grad():
        hidden = hf_model.model(ids).last_hidden_state
        pos = torch.arange(1, ids.shape[1])[None]
        ref = mtp._project_to_logits(mtp.forward_layer(0, hidden[:, :-1], pos, None, input_ids=ids[:, 1:]))
    assert (ref - mtp_logits).abs().max() <= 1e-4 * ref.abs().max()


PROBLEMS = [
    ("addition", "What is 347 + 589?", 936),
    ("subtraction", "What is 903 - 458?", 445),
    ("multiplication", "What is 47 * 6?", 282),
    ("sorting", "Sort these numbers: 42, 7, 19, 88", [7, 19, 42, 88]),
    ("letters", "How many times does the letter 'r' appear in 'strawberry'?", 3),
    ("comparison", "Which is larger, 481 or 418?", 481),
]


def _samples() -> list[Sample]:
    out = [Sample(task, [{"role": "user", "content": q}], "", "", expected) for task, q, expected in PROBLEMS]
    out.append(Sample("calculator", [{"role": "user", "content": "What is 4821 * 377?"}], "", "", "4821 * 377",
                      tools=[calculator_tool()]))
    return out


# Tasks the eval finds right at least 95% of the time (docs/tiny-reasoner.md: addition, multiplication and calculator
# 100%, subtraction and comparison 98%): these answers must be right. The others must still think first and answer
# in the right form.
EXACT = {"addition", "subtraction", "multiplication", "comparison", "calculator"}


def _check(samples: list[Sample], texts: list[str]) -> None:
    """Every reply thinks first, then answers (or, with the tool offered, makes one calculator call); the tasks in
    EXACT answer correctly."""
    for s, text in zip(samples, texts):
        parsed = parse_completion(text)
        assert parsed.has_thinking, text
        if s.task == "calculator":
            assert [c["name"] for c in parsed.tool_calls] == ["calculator"], text
            assert json.loads(parsed.tool_calls[0]["arguments"]) == {"expression": "4821 * 377"}, text
        else:
            assert parsed.content.strip() and not parsed.tool_calls, text
        if s.task in EXACT:
            assert check_answer(s, parsed.content, parsed.tool_calls), text


def test_greedy_replies_think_then_answer_with_transformers(hf_model, tokenizer) -> None:
    samples = _samples()
    for s in samples:
        ids = tokenizer.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        with torch.no_grad():
            out = hf_model.generate(**ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        _check([s], [tokenizer.decode(out[0, ids["input_ids"].shape[1]:])])


def test_greedy_replies_think_then_answer_with_our_engine() -> None:
    from reasoning_engine import LLM, SamplingParams

    llm = LLM()
    samples = _samples()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    texts = [out.outputs[0].text for out in llm.chat([s.messages for s in samples[:-1]], params)]
    texts += [llm.chat(samples[-1].messages, params, tools=samples[-1].tools)[0].outputs[0].text]
    _check(samples, texts)
    off = llm.chat(samples[0].messages, params, chat_template_kwargs={"thinking": False})[0].outputs[0].text
    assert "</think>" not in off
    assert "digits 936" in off and off.strip().endswith("347 + 589 = 936."), "thinking off: working, then answer"


def test_bundled_dir_is_a_path() -> None:
    assert isinstance(BUNDLED_MODEL_DIR, Path) and BUNDLED_MODEL_DIR.name == "assets"
