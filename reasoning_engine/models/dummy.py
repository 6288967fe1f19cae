"""`load_format="dummy"`: random weights instead of a checkpoint, to time and size a model whose weights are not at
hand (as vLLM's dummy format). Only config.json is read.

Values are drawn on the parameters' own device (a 16B-parameter model fills in seconds on a GPU) from one seeded
generator per device, so a given model, device and seed always gets the same weights. They are scaled for a working
forward pass: every projection ~ N(0, in_features^-1/2) keeps activations near unit scale, the residual stream is
renormalised before each layer, so logits stay finite in bf16 at any depth.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from reasoning_engine.layers.moe import Experts, HashRouter
from reasoning_engine.layers.norm import RMSNorm
from reasoning_engine.models.base import materialize, process_weights_after_loading

# root mean square of q = nibble - 8 for a uniform nibble in [0, 15]: sqrt(E[q^2]) = sqrt(21.5)
INT4_RMS = math.sqrt(21.5)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter and buffer of a materialized model in place: weights (embeddings and LM head included)
    N(0, shape[-1]^-1/2), RMSNorm weights 1, biases (routing correction bias included) and buffers 0, experts kept
    quantized random codes with scales of the same spread. Then modules derive their precomputed tensors."""
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    for module in model.modules():
        if isinstance(module, Experts) and module.quant is not None:
            _fill_quantized_experts(module, generator(module.w13.device))
            for name, param in module.named_parameters(recurse=False):
                if name not in module.fixed_dtypes:  # biases beside packed experts (gpt-oss)
                    param.zero_()
            continue
        for param in module.parameters(recurse=False):
            if not param.is_floating_point():  # DeepSeek-V4's hash-routing table: random expert ids
                param.random_(0, module.weight.shape[0] if isinstance(module, HashRouter) else 1,
                              generator=generator(param.device))
            elif isinstance(module, RMSNorm):
                param.fill_(1.0)
            elif param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator(param.device))
            else:
                param.zero_()
        for buffer in module.buffers(recurse=False):
            buffer.zero_()
    process_weights_after_loading(model)


def _fill_quantized_experts(experts: Experts, gen: torch.Generator) -> None:
    """Random codes and constant scales giving each dequantized weight a spread of in_features^-1/2."""
    assert experts.quant is not None
    for weight, scale in ((experts.w13, experts.w13_scale), (experts.w2, experts.w2_scale)):
        if experts.quant.method == "w4a16":
            weight.view(torch.uint8).random_(0, 256, generator=gen)  # eight uniform nibbles per int32
            scale.fill_(1.0 / (math.sqrt(weight.shape[-1] * 8) * INT4_RMS))
        elif experts.quant.method == "mxfp4":  # uniform e2m1 codes (RMS ~2.9), a power-of-two scale near the spread
            weight.random_(0, 256, generator=gen)
            scale.fill_(127 + round(math.log2(1.0 / (math.sqrt(weight.shape[-1] * 2) * 2.9))))
        else:
            for expert in weight:  # one expert at a time: the float temporary stays small
                expert.copy_(torch.randn(expert.shape, generator=gen, device=expert.device, dtype=torch.bfloat16))
            scale.fill_(weight.shape[-1] ** -0.5)


def build_loaded(make: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device | str, load_format: str,
                 load: Callable[[nn.Module], None]) -> nn.Module:
    """A module built by `make` on the meta device, materialized on `device` in `dtype`, its weights loaded by
    `load` (random ones with load_format "dummy", as the text model gets), in eval mode: the vision towers."""
    with torch.device("meta"):
        module = make()
    module = materialize(module, dtype, torch.device(device))
    if load_format == "dummy":
        init_dummy_weights(module)
    else:
        load(module)
    return module.eval()
