"""Checkpoint reading: every tiny variant (quantized ones included) reads back as exactly the weights the transformers
reference loads; sharded indexes; the language_model. prefix; clear errors; bounded memory."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reasoning_engine.quant_config import parse_quant_config
from reasoning_engine.models.weights import check_shape, count_checkpoint_tensors, iter_checkpoint_weights

from .checkpoints import VARIANTS, TinyCheckpoint
from .st_files import INDEX_FILE, read_tensors, write_tensors

Builder = Callable[[str], TinyCheckpoint]


def _quant(path: Path):
    return parse_quant_config(json.loads((path / "config.json").read_text()))


def _copy(ckpt: TinyCheckpoint, tmp_path: Path) -> Path:
    dest = tmp_path / ckpt.name
    shutil.copytree(ckpt.path, dest)
    return dest


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_reads_as_the_reference_weights(tiny_checkpoint: Builder, name: str) -> None:
    ckpt = tiny_checkpoint(name)
    ours = dict(iter_checkpoint_weights(ckpt.path, _quant(ckpt.path), torch.float32, progress=False))
    reference = read_tensors(ckpt.reference_path)
    assert sorted(ours) == sorted(reference)
    for key, tensor in ours.items():
        if tensor.is_floating_point():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[key].float()), key
        else:  # integer tensors (DeepSeek-V4's tid2eid: int32 as released, int64 as transformers saves it) as stored
            assert not reference[key].is_floating_point() and torch.equal(tensor.long(), reference[key].long()), key
    assert count_checkpoint_tensors(ckpt.path, _quant(ckpt.path)) == len(ours)


def test_published_layouts_are_what_the_variants_claim(tiny_checkpoint: Builder) -> None:
    """Guards the builders: the stored names and files are those of the published checkpoints."""
    names = set(read_tensors(tiny_checkpoint("deepseek_v3").path))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.3.eh_proj.weight" in set(read_tensors(tiny_checkpoint("deepseek_v3_mtp").path))
    sharded = tiny_checkpoint("deepseek_v3_sharded").path
    assert (sharded / INDEX_FILE).is_file() and len(list(sharded.glob("model-*-of-00004.safetensors"))) == 4
    k25 = set(read_tensors(tiny_checkpoint("kimi_k25_int4").path))
    assert {"language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed", "language_model.lm_head.weight",
            "mm_projector.proj.0.weight", "vision_tower.encoder.blocks.0.wqkv.weight"} <= k25
    assert "language_model.model.layers.1.mlp.experts.0.up_proj.weight" not in k25
    assert "language_model.model.layers.1.mlp.shared_experts.up_proj.weight" in k25
    fp8 = read_tensors(tiny_checkpoint("deepseek_v3_fp8").path)
    assert fp8["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape == (2, 1)  # 192 x 96
    assert fp8["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 2)  # 320 x 192: partial blocks
    assert fp8["model.layers.1.mlp.gate.weight"].dtype == torch.float32 and fp8["lm_head.weight"].dtype == torch.float32


def test_prefix_strip_yields_the_text_model_and_skips_the_vision_tower(tiny_checkpoint: Builder, caplog) -> None:
    path = tiny_checkpoint("kimi_k25").path
    with caplog.at_level(logging.INFO, logger="reasoning_engine.models.weights"):
        names = [n for n, _ in iter_checkpoint_weights(path, None, torch.float32, prefix_strip="language_model.", progress=False)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert not [n for n in names if n.startswith(("language_model.", "vision_tower", "mm_projector"))]
    assert "skipping 23 checkpoint tensors outside 'language_model.' (mm_projector, model, vision_tower)" in caplog.text
    assert count_checkpoint_tensors(path, None, prefix_strip="language_model.") == len(names)


def test_tensors_come_in_the_requested_dtype(tiny_checkpoint: Builder) -> None:
    path = tiny_checkpoint("kimi_k2_int4").path
    tensors = dict(iter_checkpoint_weights(path, _quant(path), torch.bfloat16, progress=False))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_missing_folder_config_and_weights(tiny_checkpoint: Builder, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_checkpoint_weights(tmp_path / "nowhere", None, torch.float32))
    path = _copy(tiny_checkpoint("llama"), tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        list(iter_checkpoint_weights(path, None, torch.float32))
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no weights in .*model\.safetensors.*found pytorch_model\.bin"):
        list(iter_checkpoint_weights(path, None, torch.float32))


def test_index_naming_a_missing_shard(tiny_checkpoint: Builder, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("deepseek_v3_sharded"), tmp_path)
    (path / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"to shard model-00003-of-00004\.safetensors, which is missing"):
        list(iter_checkpoint_weights(path, None, torch.float32))
    (path / INDEX_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="is not a safetensors index"):
        list(iter_checkpoint_weights(path, None, torch.float32))


def test_quantized_tensors_without_a_matching_quantization_config(tiny_checkpoint: Builder) -> None:
    int4, fp8 = tiny_checkpoint("kimi_k2_int4").path, tiny_checkpoint("deepseek_v3_fp8").path
    with pytest.raises(ValueError, match=r"weight_packed' is stored in compressed-tensors format but config.json has no quantization_config"):
        list(iter_checkpoint_weights(int4, None, torch.float32))
    with pytest.raises(ValueError, match=r"weight_scale_inv' is stored in fp8 format but config.json has quant_method 'compressed-tensors'"):
        list(iter_checkpoint_weights(fp8, _quant(int4), torch.float32))


def test_quantized_layer_with_a_missing_part(tiny_checkpoint: Builder, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("kimi_k2_int4"), tmp_path)
    tensors = read_tensors(path)
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight_scale"]
    write_tensors(path, tensors)
    with pytest.raises(ValueError, match=r"'model.layers.2.mlp.experts.5.down_proj.weight_packed' has no 'model.layers.2.mlp.experts.5.down_proj.weight_scale'"):
        list(iter_checkpoint_weights(path, _quant(path), torch.float32))


def test_fp8_weight_without_its_scale(tiny_checkpoint: Builder, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("deepseek_v3_fp8"), tmp_path)
    tensors = read_tensors(path)
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    write_tensors(path, tensors)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.o_proj.weight' is stored as float8_e4m3fn without a weight_scale_inv"):
        list(iter_checkpoint_weights(path, _quant(path), torch.float32))


def test_check_shape_names_the_tensor_and_both_shapes() -> None:
    check_shape("model.norm.weight", (64,), torch.Size([64]))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.o_proj.weight' has shape \[64, 48\] in the checkpoint, the model expects \[64, 64\]"):
        check_shape("model.layers.0.self_attn.o_proj.weight", (64, 64), torch.Size([64, 48]))


def test_peak_memory_stays_near_the_weights_size(tmp_path: Path) -> None:
    """Loading 96 MiB tensor by tensor into freshly allocated memory raises peak RSS by well under 1.3x of it
    (the file pages of the mapping are released as the reader goes)."""
    tensors = {f"w{i}": torch.randn(512, 1024) for i in range(48)}  # 48 x 2 MiB
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    script = textwrap.dedent(f"""
        import torch
        from reasoning_engine.models.weights import iter_checkpoint_weights
        def rss(field):
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) * 1024
        before = rss("VmRSS:")
        kept = dict(iter_checkpoint_weights({str(tmp_path)!r}, None, torch.float32, progress=False))
        print((rss("VmHWM:") - before) / sum(t.numel() * 4 for t in kept.values()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2])
    ratio = float(out.stdout.strip().splitlines()[-1])
    assert ratio < 1.2, ratio
