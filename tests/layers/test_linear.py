"""PackedLinear (oneDNN's blocked weight layout on CPU) computes what nn.Linear computes, and loading a model on CPU
in float32 packs every linear layer except an LM head tied to the embedding table."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from reasoning_engine.config import load_model_config
from reasoning_engine.layers.linear import PackedLinear, can_pack, pack_linears
from reasoning_engine.models.registry import build_model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (2, 5, 48)])
def test_packed_linear_matches_nn_linear(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-6)
    strided = torch.randn(48, shape[0]).t()  # rows not contiguous, as after a split or transpose
    torch.testing.assert_close(packed(strided), linear(strided), rtol=1e-5, atol=1e-6)
    assert torch.equal(packed.dense_weight(), linear.weight)
    assert packed.weight.shape == linear.weight.shape


def test_shared_linear_is_packed_once_and_stays_shared() -> None:
    shared = nn.Linear(8, 8)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared), "c": nn.Linear(8, 4)})
    assert pack_linears(model) == 2
    assert isinstance(model["a"][0], PackedLinear) and model["a"][0] is model["b"][0]
    assert pack_linears(model) == 0  # nothing left to pack


def test_dense_weights_are_freed_as_layers_are_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading must not hold the dense and the packed copy of every layer at once (benchmarks/load_memory.py): when
    a layer is packed, those packed before it have already been freed."""
    import reasoning_engine.layers.linear as linear_module

    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    dense = [weakref.ref(layer.weight) for layer in model]
    alive: list[int] = []

    class CountingPackedLinear(PackedLinear):
        def __init__(self, linear: nn.Linear, keep_plain: bool = False) -> None:
            gc.collect()
            alive.append(sum(ref() is not None for ref in dense))
            super().__init__(linear, keep_plain)

    monkeypatch.setattr(linear_module, "PackedLinear", CountingPackedLinear)
    assert pack_linears(model) == 4
    gc.collect()
    assert alive == [4, 3, 2, 1] and all(ref() is None for ref in dense)

    # for compiled decode graphs the plain weights stay, shared with the packed layers rather than copied
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    weights = [(layer.weight.data_ptr(), layer.weight.detach().clone()) for layer in model]
    assert pack_linears(model, keep_plain=True) == 4
    assert all(layer.plain_weight.data_ptr() == ptr and torch.equal(layer.plain_weight, w)
               for (ptr, w), layer in zip(weights, model))


def test_tied_head_stays_dense() -> None:
    embed = nn.Embedding(16, 8)
    head = nn.Linear(8, 16, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    assert pack_linears(model) == 0
    assert model["head"] is head and head.weight is embed.weight


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cpu_model_linears_are_packed_with_the_checkpoint_values(tiny_checkpoint, family: str) -> None:
    path = tiny_checkpoint(family).path
    config = load_model_config(path)
    model = build_model(config, torch.float32, torch.device("cpu"), 64)
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    if config.tie_word_embeddings:
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed_tokens.weight
    else:
        assert isinstance(model.lm_head, PackedLinear)
        assert torch.equal(model.lm_head.dense_weight(), stored["lm_head.weight"])
    o_proj = model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, PackedLinear)
    assert torch.equal(o_proj.dense_weight(), stored["model.layers.0.self_attn.o_proj.weight"])


def test_float32_cpu_is_packed_and_bfloat16_or_other_devices_are_not() -> None:
    assert can_pack(torch.float32, torch.device("cpu"))  # torch's CPU wheels ship oneDNN
    assert not can_pack(torch.bfloat16, torch.device("cpu"))
    assert not can_pack(torch.float32, torch.device("meta"))
