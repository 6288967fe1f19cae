"""Routed experts of quantized checkpoints stay quantized in the engine (INT4 pack-quantized as Kimi K2 ships them,
block FP8 as DeepSeek-V3 does): the stacked parameters hold exactly the stored tensors, the fused-MoE kernels (torch
reference and Triton, interpreted on CPU) dequantize on the fly to the outputs of the same checkpoint dequantized at
load, and the experts take a fraction of their dense bytes."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reasoning_engine.layers.moe import Experts

from .checkpoints import TinyCheckpoint, prompts
from .st_files import read_tensors, write_tensors

# variant -> (routed experts' parameter dtypes and shapes: 8 experts, H x I = 64 x 32 for INT4, 192 x 160 for FP8)
PACKED = {
    "kimi_k2_int4": {"w13": (torch.int32, (8, 64, 8)), "w13_scale": (torch.bfloat16, (8, 64, 2)),
                     "w2": (torch.int32, (8, 64, 4)), "w2_scale": (torch.bfloat16, (8, 64, 1))},
    # 128 x 128 blocks: gate and up of 160 rows take 2 block rows each; partial edge blocks
    "deepseek_v3_fp8": {"w13": (torch.float8_e4m3fn, (8, 320, 192)), "w13_scale": (torch.float32, (8, 4, 2)),
                        "w2": (torch.float8_e4m3fn, (8, 192, 160)), "w2_scale": (torch.float32, (8, 2, 2))},
    # GLM-4.5's per-channel FP8 (bf16 scales stored): blocks of one output channel by 128 input channels
    "glm4_moe_fp8": {"w13": (torch.float8_e4m3fn, (8, 64, 64)), "w13_scale": (torch.float32, (8, 64, 1)),
                     "w2": (torch.float8_e4m3fn, (8, 64, 32)), "w2_scale": (torch.float32, (8, 64, 1))},
}
STORED_PARTS = {"kimi_k2_int4": ("weight_packed", "weight_scale"), "deepseek_v3_fp8": ("weight", "weight_scale_inv"),
                "glm4_moe_fp8": ("weight", "weight_scale")}
GREEDY = dict(temperature=0.0, ignore_eos=True)


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # slow: packed experts of every format


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> Callable[[str, str], object]:
    """LLM per (folder, kernel backend), once: folder is a variant's checkpoint or "<variant>-dense", the same
    weights dequantized (no quantization_config)."""
    cache: dict[tuple[str, str], object] = {}

    def get(folder: str, backend: str) -> object:
        if (folder, backend) not in cache:
            from reasoning_engine import LLM

            ckpt = tiny_checkpoint(folder.removesuffix("-dense"))
            path = ckpt.reference_path if folder.endswith("-dense") else ckpt.path
            cache[folder, backend] = LLM(str(path), dtype="float32", device="cpu", kernel_backend=backend)
        return cache[folder, backend]

    return get


def _moe_layers(llm: object) -> dict[int, Experts]:
    return {i: block.mlp.experts for i, block in enumerate(llm.engine.model.layers) if hasattr(block.mlp, "experts")}


@pytest.mark.parametrize("name", list(PACKED))
def test_experts_keep_the_stored_quantized_tensors(engines, tiny_checkpoint, name: str) -> None:
    layers = _moe_layers(engines(name, "torch"))
    assert sorted(layers) == ([1] if name == "deepseek_v3_fp8" else [1, 2])  # all but the first, dense, layer
    for experts in layers.values():
        got = {n: (p.dtype, tuple(p.shape)) for n, p in experts.named_parameters()}
        assert got == PACKED[name], got
    # expert 5 of the last MoE layer holds the stored tensors bit for bit: gate rows, then up rows, in w13
    index, experts = max(layers.items())
    stored = read_tensors(tiny_checkpoint(name).path)
    weight, scale = STORED_PARTS[name]
    prefix = f"model.layers.{index}.mlp.experts.5"
    w13, s13 = experts.w13[5], experts.w13_scale[5]
    parts = {"gate": (w13[: w13.shape[0] // 2], s13[: s13.shape[0] // 2]),
             "up": (w13[w13.shape[0] // 2 :], s13[s13.shape[0] // 2 :]),
             "down": (experts.w2[5], experts.w2_scale[5])}
    for proj, (values, scales) in parts.items():
        assert torch.equal(values.view(torch.uint8), stored[f"{prefix}.{proj}_proj.{weight}"].view(torch.uint8)), proj
        assert torch.equal(scales, stored[f"{prefix}.{proj}_proj.{scale}"].to(scales.dtype)), proj  # bf16 -> f32: exact


def test_packed_parts_are_never_cast(tiny_checkpoint, tmp_path) -> None:
    """INT4 scales are kept in bf16, as published: scales stored otherwise are refused rather than rounded."""
    from reasoning_engine import LLM

    path = Path(shutil.copytree(tiny_checkpoint("kimi_k2_int4").path, tmp_path / "int4"))
    tensors = read_tensors(path)
    name = "model.layers.2.mlp.experts.3.up_proj.weight_scale"
    tensors[name] = tensors[name].float()
    write_tensors(path, tensors)
    with pytest.raises(ValueError, match=rf"{name}' is stored as torch.float32, but 'layers.2.mlp.experts.w13_scale' keeps torch.bfloat16"):
        LLM(str(path), dtype="float32", device="cpu")


def test_only_routed_experts_stay_quantized(engines) -> None:
    """FP8 quantizes every linear layer; attention, dense MLP and shared experts are dequantized at load."""
    model = engines("deepseek_v3_fp8", "torch").engine.model
    dense = {n: p.dtype for n, p in model.named_parameters() if ".experts." not in n}
    assert set(dense.values()) == {torch.float32}, dense


@pytest.mark.parametrize("name", list(PACKED))
def test_torch_kernels_match_the_dequantized_checkpoint(engines, name: str) -> None:
    from reasoning_engine import SamplingParams

    packed, dense = engines(name, "torch"), engines(f"{name}-dense", "torch")
    batch = prompts()
    for got, want in zip(packed.compute_logits(batch), dense.compute_logits(batch)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    params = SamplingParams(max_tokens=12, **GREEDY)
    requests = [{"prompt_token_ids": ids} for ids in batch]
    got = [o.outputs[0].token_ids for o in packed.generate(requests, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in dense.generate(requests, params, use_tqdm=False)]


@pytest.mark.parametrize("name", list(PACKED))
def test_triton_kernels_match_the_dequantized_checkpoint(engines, name: str) -> None:
    """Interpreted Triton is slow on CPU: two short prompts, three tokens, against the torch path on dense weights."""
    from reasoning_engine import SamplingParams

    packed, dense = engines(name, "triton"), engines(f"{name}-dense", "torch")
    batch = [[3, 17, 9, 42, 5], [7, 30]]
    (got,), (want,) = packed.compute_logits(batch[:1]), dense.compute_logits(batch[:1])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    params = SamplingParams(max_tokens=3, **GREEDY)
    requests = [{"prompt_token_ids": ids} for ids in batch]
    tokens = [o.outputs[0].token_ids for o in packed.generate(requests, params, use_tqdm=False)]
    assert tokens == [o.outputs[0].token_ids for o in dense.generate(requests, params, use_tqdm=False)]


def test_mtp_draft_layer_keeps_its_experts_packed(tiny_checkpoint) -> None:
    """The MTP layer loads its FP8 experts packed too and drafts exactly what the dequantized one drafts (static
    draft lengths: the adaptive engine's depend on measured step times)."""
    from reasoning_engine import LLM, SamplingParams

    ckpt = tiny_checkpoint("deepseek_v3_fp8_mtp")
    requests = [{"prompt_token_ids": ids} for ids in prompts()[:2]]
    results = []
    for path in (ckpt.path, ckpt.reference_path):
        llm = LLM(str(path), dtype="float32", device="cpu", adaptive=False,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        outs = llm.generate(requests, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
        experts = llm.engine.runner.worker.drafters["mtp"].model.layers[0].mlp.experts
        results.append(([o.outputs[0].token_ids for o in outs], llm.engine.stats().spec_decode, experts.w13.dtype))
    assert results[0][2] == torch.float8_e4m3fn and results[1][2] == torch.float32
    assert results[0][:2] == results[1][:2]


def _param_bytes(model: torch.nn.Module, experts_only: bool = False) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not experts_only or ".experts." in n)


@pytest.mark.parametrize("name, expert_ratio", [("kimi_k2_int4", (0.5 + 2 / 32) / 2), ("deepseek_v3_fp8", 0.5),
                                                ("glm4_moe_fp8", 0.5 + 1 / 24)])  # a float32 scale per row of 64 / 32
def test_packed_experts_take_a_fraction_of_the_dense_bytes(tiny_checkpoint, name: str, expert_ratio: float) -> None:
    """In bf16: INT4 experts take 4 bits plus a bf16 scale per 32 weights (0.28 of bf16); FP8 one byte plus one
    float32 scale per 128x128 block (just over 0.5). The whole model is smaller by the experts' savings."""
    from reasoning_engine.config import load_model_config
    from reasoning_engine.models.registry import build_model

    ckpt = tiny_checkpoint(name)
    packed, dense = (build_model(load_model_config(path), torch.bfloat16, torch.device("cpu"), 64)
                     for path in (ckpt.path, ckpt.reference_path))
    ratio = _param_bytes(packed, experts_only=True) / _param_bytes(dense, experts_only=True)
    assert expert_ratio <= ratio < expert_ratio + 0.02, ratio
    saved = _param_bytes(dense, experts_only=True) - _param_bytes(packed, experts_only=True)
    assert _param_bytes(packed) == _param_bytes(dense) - saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak device memory needs a GPU")
def test_peak_device_memory_while_loading_packed_experts(tiny_checkpoint) -> None:
    """The loader never holds dense copies of the packed experts: peak allocation stays below the dense model's."""
    from reasoning_engine.config import load_model_config
    from reasoning_engine.models.registry import build_model

    ckpt = tiny_checkpoint("kimi_k2_int4")
    peaks = []
    for path in (ckpt.path, ckpt.reference_path):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = build_model(load_model_config(path), torch.bfloat16, torch.device("cuda"), 64, "triton")
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del model
    assert peaks[0] < peaks[1], peaks
