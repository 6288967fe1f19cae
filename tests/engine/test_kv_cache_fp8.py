"""kv_cache_dtype="fp8" through the engine: the bundled model's answers with an FP8 cache, the capacity one memory
budget gains, prefix hits, speculative decoding and preemption over FP8 rows, the server's flag, and clear errors
for what it does not take."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.engine.arguments import build_engine_config
from reasoning_engine.engine.worker import ModelWorker, check_fp8_kernels
from reasoning_engine.kernels.fp8_cache import key_rotation
from reasoning_engine.tiny.data import EVAL_SEED, check_answer, eval_samples
from reasoning_engine.tiny.eval import parse_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def bundled_fp8() -> LLM:
    return LLM(kv_cache_dtype="fp8", kv_cache_memory="16MiB")


def test_bundled_model_answers_alike_with_an_fp8_cache(bundled_fp8: LLM) -> None:
    """Greedy chats on fresh eval problems: the FP8 cache's completions match the model-dtype cache's on nearly
    every problem and are right as often."""
    samples = [s for s in eval_samples(3, EVAL_SEED, True) if not s.tools][:16]
    params = SamplingParams(temperature=0.0, max_tokens=120, skip_special_tokens=False)
    plain = LLM(kv_cache_memory="16MiB")
    texts = {name: [r.outputs[0].text for r in llm.chat([s.messages for s in samples], params)]
             for name, llm in (("auto", plain), ("fp8", bundled_fp8))}
    same = sum(a == b for a, b in zip(texts["auto"], texts["fp8"]))
    right = {name: sum(check_answer(s, parse_completion(t).content, parse_completion(t).tool_calls)
                       for s, t in zip(samples, out)) for name, out in texts.items()}
    assert same >= len(samples) - 2, (same, texts)
    assert abs(right["fp8"] - right["auto"]) <= 1 and right["auto"] >= len(samples) - 3, right
    assert bundled_fp8.engine.config.kv_cache_dtype == "fp8"
    layer = bundled_fp8.engine.runner.worker.model.attention_layers()[0]
    assert layer.kv_cache.dtype == torch.uint8 and layer.kv_cache.shape[-1] == 64 + 2 + 2 * 16  # latent, scale, rope


def test_prefix_hits_speculation_and_preemption_keep_fp8_outputs(bundled_fp8: LLM) -> None:
    """The same FP8 rows whether a prompt's prefix is recomputed or hit in the cache, drafted and verified (accepted
    nodes moved into place), or preempted and recomputed in a cache too small for the batch; nothing leaks."""
    prompts = [[5 + (i * 7 + j) % 300 for j in range(40 + 9 * i)] for i in range(4)]
    want = [o.outputs[0].token_ids for o in bundled_fp8.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    again = bundled_fp8.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == want
    assert bundled_fp8.engine.stats().prefix_cache_hits > 0
    drafted = LLM(kv_cache_dtype="fp8", kv_cache_memory="16MiB", adaptive=False,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in drafted.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)] == want
    small = LLM(kv_cache_dtype="fp8", kv_cache_blocks=12, max_model_len=96, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in small.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)] == want
    assert small.engine.stats().num_preemptions > 0
    sampled = bundled_fp8.generate([{"prompt_token_ids": prompts[3]}],
                                   SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))
    assert len(sampled[0].outputs) == 3
    for llm in (bundled_fp8, drafted, small):
        assert llm.engine.stats().kv_cache_usage == 0.0


@pytest.mark.slow
def test_triton_kernels_read_the_fp8_cache_as_torch_does(llama_dir: Path) -> None:
    """The engine on the Triton kernels (the interpreter without a GPU) gives the torch path's greedy tokens over
    FP8 caches: MLA (the bundled model) with suffix drafts and chunks past 16 tokens in the same steps, so the latent
    split, prefill and decode kernels all read it; GQA (the tiny Llama)."""
    prompts = [[3, 17, 9, 42] * 3, [7, 1, 30], [5 + (i * 7) % 40 for i in range(40)]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for model, extra in ((None, {"speculative_config": {"method": "suffix", "num_speculative_tokens": 4}}),
                         (str(llama_dir), {})):
        outs = {}
        for backend in ("torch", "triton"):
            llm = LLM(model, dtype="float32", kernel_backend=backend, block_size=4, kv_cache_dtype="fp8",
                      kv_cache_memory="8MiB", adaptive=False, max_num_batched_tokens=24, **extra)
            outs[backend] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                          params)]
        assert outs["triton"] == outs["torch"], model


@pytest.mark.parametrize("head_dim", [64, 96, 80, 16])
def test_key_rotation_is_orthonormal(head_dim: int) -> None:
    rotation = key_rotation(head_dim).double()
    assert torch.allclose(rotation @ rotation.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-6)
    assert rotation.abs().min() > 0 or head_dim & (head_dim - 1)  # a power of two: every entry +-1/sqrt(d)


def test_gqa_fp8_cache_scores_the_prompt_as_the_float_cache_does(llama_dir: Path) -> None:
    """Prompt logprobs and greedy tokens of a GQA model with an FP8 cache stay within e4m3's rounding of the float32
    cache's, through prefill chunks and decodes."""
    prompt = {"prompt_token_ids": [3 + (i * 11) % 60 for i in range(90)]}
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0, logprobs=0)
    outs = {kv: LLM(str(llama_dir), dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=32,
                    kv_cache_memory="8MiB").generate([prompt], params)[0] for kv in ("auto", "fp8")}
    want = torch.tensor([next(iter(e.values())).logprob for e in outs["auto"].prompt_logprobs[1:]])
    got = torch.tensor([next(iter(e.values())).logprob for e in outs["fp8"].prompt_logprobs[1:]])
    assert (got - want).abs().max() < 0.05 * want.abs().max(), (got - want).abs().max()
    assert outs["fp8"].outputs[0].token_ids == outs["auto"].outputs[0].token_ids


def _gqa_config(tmp_path: Path, llama_dir: Path, head_dim: int) -> Path:
    """The tiny Llama's config with wider heads (weights: load_format="dummy")."""
    config = json.loads((llama_dir / "config.json").read_text())
    config.update(head_dim=head_dim, hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_memory_budget_admits_nearly_twice_the_tokens_in_fp8(tmp_path: Path, llama_dir: Path, head_dim: int) -> None:
    """The worker sizes its block pool from the budget by bytes per token, scales included: GQA rows of head_dim
    bytes and a 2-byte scale against 2 * head_dim bytes of bfloat16, so >= 1.9x the tokens at head_dim 64 and up."""
    folder = _gqa_config(tmp_path, llama_dir, head_dim)
    blocks = {kv: ModelWorker(build_engine_config(str(folder), dtype="bfloat16", load_format="dummy", max_model_len=64,
                                                  kv_cache_memory="4MiB", kv_cache_dtype=kv)).available_blocks()[0]
              for kv in ("auto", "fp8")}
    assert blocks["fp8"] / blocks["auto"] >= 1.9
    assert blocks["fp8"] == pytest.approx(blocks["auto"] * 2 * head_dim / (head_dim + 2), rel=0.01)


def test_mla_keeps_its_rotary_key_in_bfloat16_and_counts_it(bundled_fp8: LLM) -> None:
    """The bundled model's latent (64) in e4m3 with its scale, its 16 rotary channels in bfloat16: 98 bytes a layer
    and token against 160 in bfloat16, and the pool holds blocks in that ratio."""
    worker = bundled_fp8.engine.runner.worker
    plain = ModelWorker(build_engine_config(dtype="bfloat16", kv_cache_memory="16MiB"))
    fp8 = ModelWorker(build_engine_config(dtype="bfloat16", kv_cache_memory="16MiB", kv_cache_dtype="fp8"))
    assert fp8.available_blocks()[0] == pytest.approx(plain.available_blocks()[0] * 160 / 98, rel=0.01)
    assert worker.pool_bytes_per_block()[0] == 4 * 98 * worker.block_size


def test_kv_cache_dtype_names_and_refusals(tiny_checkpoint) -> None:
    assert build_engine_config(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    assert build_engine_config().kv_cache_dtype == "auto"
    for bad in ("int8", "fp8_e5m2", "bfloat16", ""):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            build_engine_config(kv_cache_dtype=bad)
    v4 = str(tiny_checkpoint("deepseek_v4").path)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported by .* use kv_cache_dtype='auto'"):
        LLM(v4, dtype="float32", block_size=8, kv_cache_dtype="fp8")


def test_triton_fp8_needs_hardware_e4m3(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU older than compute capability 8.9 the Triton kernels cannot convert e4m3: refused up front."""
    config = build_engine_config(kv_cache_dtype="fp8")
    on_gpu = SimpleNamespace(kernel_backend="triton", device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' with kernel_backend='triton' needs .* 8.9"):
        check_fp8_kernels(on_gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_kernels(on_gpu)
    check_fp8_kernels(config)  # the torch kernels on CPU: nothing to check


def test_server_flag_reaches_the_engine() -> None:
    from reasoning_engine.cli import build_parser
    from reasoning_engine.server.cli import _engine_kwargs

    for flag in ("fp8", "fp8_e4m3"):
        kwargs = _engine_kwargs(build_parser().parse_args(["serve", "--kv-cache-dtype", flag]))
        assert kwargs["kv_cache_dtype"] == flag
        assert build_engine_config(**kwargs).kv_cache_dtype == "fp8"
    assert "kv_cache_dtype" not in _engine_kwargs(build_parser().parse_args(["serve"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
