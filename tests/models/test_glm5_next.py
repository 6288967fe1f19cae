"""GLM-5.3-Flash against transformers 5.25 on a tiny random checkpoint written by its save_pretrained (the
image-text wrapper, official tensor names): KDA layers with the lower-bounded forget gate, NoPE DSA layers whose
indexer scores pools of 4 tokens (keeping 2 and the query's unfinished pool) with a second layer sharing the first's
choice, four hyper-connection streams, clamped SwiGLU experts. Prompts cross many pools and blocks and attend
sparsely, prefilled in chunks that end mid-pool and mid-block; the torch and Triton (interpreter) paths. Images:
tests/multimodal/test_glm5_media.py."""

from __future__ import annotations

import json

import pytest
import torch

from reasoning_engine import LLM, SamplingParams

from .st_files import read_tensors, write_tensors
from .test_parity import reference_greedy, reference_logits

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # slow: a whole family against transformers

LENGTHS = (3, 17, 40, 70)
STEPS = 32
GLM = dict(dtype="float32", device="cpu", block_size=8)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def glm(tiny_checkpoint):
    """The checkpoint, and transformers' last-position logits and greedy continuation of each prompt."""
    ckpt = tiny_checkpoint("glm5_next")
    reference = ckpt.reference()
    prompts = _prompts(ckpt.vocab_size)
    want = [(reference_logits(reference, ids), reference_greedy(reference, ids, STEPS)[0]) for ids in prompts]
    return ckpt, prompts, want


def _assert_matches(llm: LLM, prompts: list[list[int]], want) -> None:
    for ids, got, (logits, _) in zip(prompts, llm.compute_logits(prompts), want):
        torch.testing.assert_close(got.float().cpu(), logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item(),
                                   msg=lambda m, n=len(ids): f"prompt of {n} tokens: {m}")
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out, (_, tokens) in zip(prompts, outs, want):
        assert list(out.outputs[0].token_ids) == tokens, f"prompt of {len(ids)} tokens"


def test_long_prompts_in_chunks_match_transformers(glm) -> None:
    """Last-position logits within 1e-4 and identical 32-token greedy continuations of the mixed-length batch,
    prefilled 18 tokens per step (chunks end mid-pool) in blocks of 8."""
    ckpt, prompts, want = glm
    _assert_matches(LLM(str(ckpt.path), max_num_batched_tokens=18, **GLM), prompts, want)


def test_triton_kernels_match_transformers(glm) -> None:
    """kernel_backend="triton" (the interpreter on CPU): the latent and sparse MLA kernels with no rotary channels,
    the experts' clamped SwiGLU in the grouped GEMMs' epilogue, Triton norms; a short and a long prompt."""
    ckpt, prompts, want = glm
    _assert_matches(LLM(str(ckpt.path), kernel_backend="triton", **GLM), prompts[1::2], want[1::2])


def test_transformers_module_names_and_a_text_only_config_load_the_same_model(glm, tmp_path) -> None:
    """The tensors under transformers' module names (`forget_gate.`, `attn_hc.fn`, one fused `conv1d` per KDA layer)
    and a text-only config (the text model's fields at the top level, `model.` prefix) load the same weights; without
    a vision tower, an image in a prompt is a clear error."""
    ckpt, prompts, want = glm
    renamed = {}
    for name, tensor in read_tensors(ckpt.path).items():
        if name.startswith("model.visual."):
            continue
        name = name.replace("model.language_model.", "model.")
        for part in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
            name = name.replace(f".self_attn.{part}", f".self_attn.forget_gate.{part}")
        for which in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                name = name.replace(f".hc_{which}_{part}", f".{which}_hc.{part}")
        renamed[name] = tensor
    for name in [n for n in renamed if n.endswith(".q_conv1d.weight")]:
        stem = name[: -len("q_conv1d.weight")]
        renamed[f"{stem}conv1d.weight"] = torch.cat([renamed.pop(f"{stem}{x}_conv1d.weight") for x in "qkv"])
    outer = json.loads((ckpt.path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**outer.pop("text_config"), "model_type": "glm5_next"}))
    write_tensors(tmp_path, renamed, 1)
    llm = LLM(str(tmp_path), **GLM)
    for got, (logits, _) in zip(llm.compute_logits(prompts[2:]), want[2:]):
        torch.testing.assert_close(got.float().cpu(), logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item())
    with pytest.raises(ValueError, match="no vision tower"):
        llm.generate([{"prompt_token_ids": prompts[0], "multi_modal_data": {"image": [object()]}}],
                     SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize(("change", "field"), [
    (dict(indexer_types=["full", "shared", "full", "full"]), r"indexer_types\[1\]"),  # after a KDA layer
    (dict(index_kpool_always_select_tail=False), "index_kpool_always_select_tail"),
])
def test_configs_transformers_cannot_run_are_refused(glm, tmp_path, change: dict, field: str) -> None:
    ckpt, _, _ = glm
    outer = json.loads((ckpt.path / "config.json").read_text())
    outer["text_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(outer))
    for file in ckpt.path.glob("*.safetensors"):
        (tmp_path / file.name).symlink_to(file)
    with pytest.raises(ValueError, match=field):
        LLM(str(tmp_path), **GLM)
