"""On CPU, wide linear weights are stored column-major (faster one-row products) with unchanged values and shapes."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from reasoning_engine.config import load_model_config
from reasoning_engine.models.registry import build_model


def test_wide_linears_are_column_major_with_the_checkpoint_values(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama").path
    config = load_model_config(path)
    model = build_model(config, torch.float32, torch.device("cpu"), 64)
    stored = {}
    for f in sorted(path.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    head = model.lm_head.weight
    assert head.shape[0] > head.shape[1] and head.stride() == (1, head.shape[0])
    assert torch.equal(head, stored["lm_head.weight"])
    wide = narrow = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            if w.shape[0] > w.shape[1]:
                wide += 1
                assert not w.is_contiguous() and w.t().is_contiguous()
            else:
                narrow += 1
                assert w.is_contiguous()
    assert wide and narrow
    assert model.embed_tokens.weight.is_contiguous()
