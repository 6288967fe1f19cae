"""DeepSeek-V4 against transformers 5.25 on a tiny random checkpoint written by its save_pretrained (the
official tensor names): every attention kind (sliding, compressed sparse with its lightning indexer, heavily
compressed), hash-routed and sqrtsoftplus MoE layers, four hyper-connection streams, YaRN on the compressed
layers. Prompts cross many rate-4 and rate-16 row boundaries and the 8-token window, prefilled in chunks that end
mid-window and mid-block."""

from __future__ import annotations

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.kernels.fused_moe import dequantize_mxfp4
from reasoning_engine.models.deepseek_v4 import canonical_name

from .st_files import read_tensors

from .test_parity import reference_greedy, reference_logits

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # slow: a whole family against transformers

LENGTHS = (3, 17, 40, 70)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def v4(tiny_checkpoint):
    ckpt = tiny_checkpoint("deepseek_v4")
    return ckpt, ckpt.reference()


def test_long_prompts_in_chunks_match_transformers(v4) -> None:
    """Last-position logits within 1e-4 and identical 32-token greedy continuations of the mixed-length batch,
    prefilled 20 tokens per step in blocks of 8."""
    ckpt, reference = v4
    prompts = _prompts(ckpt.vocab_size)
    llm = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=20)
    for ids, got in zip(prompts, llm.compute_logits(prompts)):
        want = reference_logits(reference, ids)
        torch.testing.assert_close(got.float().cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == reference_greedy(reference, ids, 32)[0], f"prompt of {len(ids)}"


def test_sliding_group_gives_back_blocks_behind_the_compressors(v4) -> None:
    """Two cache groups: the compressed rows in the full group (one block per 8 tokens, as every full group), the
    per-token rows in a sliding group that keeps 16 tokens (what a rate-16 row reads), so a long decode holds only
    the window's blocks there."""
    ckpt, _ = v4
    llm = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=8)
    engine = llm.engine
    groups = engine.block_manager.groups
    assert [(g.kind, g.window) for g in groups] == [("full", None), ("sliding", 16)]
    prompt = _prompts(ckpt.vocab_size)[3]
    engine.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            if request.num_computed_tokens > len(prompt) + 1:  # decoding (the prefill step holds its chunk's blocks)
                most = max(most, sum(b != engine.block_manager.null_of(1) for b in request.block_tables[1]))
    assert 0 < most <= 16 // 8 + 2  # the window's blocks, the one it starts in, the step's
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_official_and_transformers_names_map_to_the_same_parameters() -> None:
    pairs = {
        "layers.1.attn.wq_a.weight": "layers.1.self_attn.q_a_proj.weight",
        "layers.1.attn.q_norm.weight": "layers.1.self_attn.q_a_norm.weight",
        "layers.1.attn.norm.weight": "layers.1.self_attn.kv_norm.weight",
        "layers.1.attn.attn_sink": "layers.1.self_attn.sinks",
        "layers.1.attn.compressor.ape": "layers.1.self_attn.compressor.position_bias",
        "layers.1.attn.indexer.compressor.wgate.weight": "layers.1.self_attn.indexer.compressor.gate_proj.weight",
        "layers.1.attn.indexer.wq_b.weight": "layers.1.self_attn.indexer.q_b_proj.weight",
        "layers.1.self_attn.compressor.indexer.kv_proj.weight": "layers.1.self_attn.indexer.compressor.kv_proj.weight",
        "layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight": "layers.1.self_attn.indexer.weights_proj.weight",
        "layers.1.self_attn.compressor.indexer.q_b_proj.weight": "layers.1.self_attn.indexer.q_b_proj.weight",
        "layers.2.ffn.gate.bias": "layers.2.mlp.gate.e_score_correction_bias",
        "layers.2.ffn.experts.5.w3.weight": "layers.2.mlp.experts.5.up_proj.weight",
        "layers.2.ffn.shared_experts.w2.weight": "layers.2.mlp.shared_experts.down_proj.weight",
        "layers.0.hc_attn_fn": "layers.0.attn_hc.fn", "layers.0.ffn_norm.weight": "layers.0.post_attention_layernorm.weight",
        "hc_head_scale": "hc_head.hc_scale", "embed.weight": "embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "norm.weight",
    }
    assert {name: canonical_name(name) for name in pairs} == pairs


@pytest.mark.parametrize("name", ["deepseek_v4", "deepseek_v4_fp4"])
def test_triton_kernels_give_the_torch_tokens(tiny_checkpoint, name: str) -> None:
    """kernel_backend="triton" (the interpreter on CPU): the experts' clamped SwiGLU in the grouped GEMMs' epilogue
    (dense experts, or the release's FP4 experts dequantized in registers), Triton norms; the logits of the torch
    path and its greedy tokens."""
    ckpt = tiny_checkpoint(name)
    prompts = _prompts(ckpt.vocab_size)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=8, kernel_backend=backend)
        logits = llm.compute_logits(prompts)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[backend] = (logits, [list(o.outputs[0].token_ids) for o in outs])
    for got, want in zip(runs["triton"][0], runs["torch"][0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert runs["triton"][1] == runs["torch"][1]


def test_released_weights_stay_packed_and_dequantise_as_transformers(tiny_checkpoint, monkeypatch) -> None:
    """A checkpoint as DeepSeek-V4 is released (block FP8 with e8m0 scales under `X.scale`, FP4 routed experts,
    `expert_dtype` beside quantization_config, int32 tid2eid), loaded by transformers itself (on CPU it dequantizes):
    the engine keeps the experts packed (codes and scales as stored, a quarter of the bf16 bytes plus a scale per 32)
    and every dequantized weight, FP8 linears and FP4 experts alike, is bit-identical to transformers'."""
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoint("deepseek_v4_fp4")
    stored = read_tensors(ckpt.path)
    assert stored["model.layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    assert stored["model.layers.1.ffn.experts.3.w2.weight"].dtype == torch.int8
    assert stored["model.layers.1.ffn.experts.3.w2.scale"].shape == (64, 2)  # [hidden, intermediate / 32]
    assert stored["model.layers.1.ffn.gate.tid2eid"].dtype == torch.int32
    monkeypatch.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)  # its dequantizing load needs none
    reference = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).state_dict()
    llm = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=8)
    ours = dict(llm.engine.model.named_parameters())
    ours.update({f"{path}.weight": sub.dense_weight() for path, sub in llm.engine.model.named_modules()
                 if hasattr(sub, "dense_weight")})  # linears packed for oneDNN
    for layer in range(4):
        ref = {k[len(f"model.layers.{layer}."):]: v for k, v in reference.items() if k.startswith(f"model.layers.{layer}.")}
        mine = {k[len(f"layers.{layer}."):]: v for k, v in ours.items() if k.startswith(f"layers.{layer}.")}
        for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"):
            assert torch.equal(mine[f"self_attn.{name}.weight"], ref[f"self_attn.{name}.weight"]), (layer, name)
        if "self_attn.indexer.q_b_proj.weight" in mine:
            assert torch.equal(mine["self_attn.indexer.q_b_proj.weight"], ref["self_attn.compressor.indexer.q_b_proj.weight"])
        shared = torch.cat([ref["mlp.shared_experts.gate_proj.weight"], ref["mlp.shared_experts.up_proj.weight"]])
        assert torch.equal(mine["mlp.shared_experts.gate_up_proj.weight"], shared)
        assert mine["mlp.experts.w13"].dtype == torch.uint8 and mine["mlp.experts.w13"].shape == (8, 128, 32)
        assert mine["mlp.experts.w13_scale"].dtype == torch.uint8 and mine["mlp.experts.w13_scale"].shape == (8, 128, 2)
        for expert in range(8):
            w13 = dequantize_mxfp4(mine["mlp.experts.w13"][expert], mine["mlp.experts.w13_scale"][expert])
            w2 = dequantize_mxfp4(mine["mlp.experts.w2"][expert], mine["mlp.experts.w2_scale"][expert])
            assert torch.equal(w13, ref["mlp.experts.gate_up_proj"][expert]), (layer, expert)
            assert torch.equal(w2, ref["mlp.experts.down_proj"][expert]), (layer, expert)
        if "mlp.gate.tid2eid" in ref:
            assert mine["mlp.gate.tid2eid"].dtype == torch.long
            assert torch.equal(mine["mlp.gate.tid2eid"], ref["mlp.gate.tid2eid"].long())


def test_bad_released_tensors_are_refused_by_name(tiny_checkpoint, tmp_path) -> None:
    """A hash-routing table naming an expert the layer lacks, and FP4 scales that do not fit their codes, fail the
    load with a ValueError naming the tensor (rather than an index error mid-step or wrong weights)."""
    import shutil

    from .st_files import write_tensors

    ckpt = tiny_checkpoint("deepseek_v4_fp4")
    for name, change, message in [
        ("model.layers.0.ffn.gate.tid2eid", lambda t: t.masked_fill(t == t.max(), 8), "tid2eid: expert ids must lie in"),
        ("model.layers.2.ffn.experts.1.w1.scale", lambda t: t[:, :1].contiguous(), "experts.1.w1.weight"),
    ]:
        folder = tmp_path / name.split(".")[-2]
        shutil.copytree(ckpt.path, folder)
        tensors = read_tensors(folder)
        tensors[name] = change(tensors[name])
        write_tensors(folder, tensors, 1)
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), dtype="float32", device="cpu", block_size=8)
