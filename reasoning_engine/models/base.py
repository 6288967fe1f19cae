"""What every decoder-only model shares: embedding, a stack of pre-norm decoder layers, final norm, LM head, and the
mapping of checkpoint tensors into our fused layouts (QKV, gate-up, stacked experts).

A family module builds its layers and names, for each checkpoint tensor, the parameter and the slice of it the tensor
fills (`WeightTarget`); loading then checks every shape and that every parameter was filled. Under tensor or expert
parallelism a target also names the part of the checkpoint tensor this rank reads (`Split`): column-parallel
projections take their rows, row-parallel ones their columns, vocabulary tables their row block, and an
expert-parallel rank reads only its own experts, so a rank reads and holds only its share.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.cache_groups import CacheGroup, single_group
from reasoning_engine.config import ModelConfig
from reasoning_engine.layers.hyper_connection import HyperConnection
from reasoning_engine.layers.linear import lm_head, vocab_embedding
from reasoning_engine.layers.moe import Experts, HashRouter, Router
from reasoning_engine.layers.norm import RMSNorm
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.weights import Index, LazyTensor
from reasoning_engine.parallel import Group, Parallel

Slicer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Split:
    """This rank's part of one dimension of a checkpoint tensor: an even share over `group`, or with `padded` the
    row block of a vocabulary padded to a multiple of the group (cut at the tensor's end), or with `blocks` an even
    share of each of consecutive blocks (a fused q, k, v: each rank's heads of each), read apart and joined. A
    dimension of one is shared whole (a per-channel scale's input dimension: the one scale of every input channel)."""

    dim: int
    group: Group
    padded: bool = False
    blocks: tuple[int, ...] = ()  # sizes of the consecutive blocks along `dim`; () for one

    def index(self, shape: list[int] | torch.Size, name: str) -> Index:
        size = shape[self.dim]
        if size == 1 and not self.padded:
            return (slice(None),) * (self.dim + 1)
        if self.padded:
            part = self.group.padded_part(size)
            part = range(min(part.start, size), min(part.stop, size))
        else:
            part = self.group.part(size, f"dimension {self.dim} of tensor {name!r}")
        return (slice(None),) * self.dim + (slice(part.start, part.stop),)

    def indices(self, shape: list[int] | torch.Size, name: str) -> list[Index]:
        """The parts to read and join along `dim`: one, or with `blocks` this rank's share of each block."""
        if not self.blocks:
            return [self.index(shape, name)]
        if sum(self.blocks) != shape[self.dim]:
            raise ValueError(f"dimension {self.dim} of tensor {name!r} has {shape[self.dim]} entries, expected the "
                             f"blocks {list(self.blocks)}")
        out, start = [], 0
        for size in self.blocks:
            part = self.group.part(size, f"a block of dimension {self.dim} of tensor {name!r}")
            out.append((slice(None),) * self.dim + (slice(start + part.start, start + part.stop),))
            start += size
        return out


@dataclass
class WeightTarget:
    param: str
    slicer: Slicer | None = None  # view of the parameter this tensor fills; None = the whole parameter
    source: Split | None = None  # the part of the checkpoint tensor this rank reads; None = all of it


def column_split(tp: Group) -> Split | None:
    """The output rows of a column-parallel projection (None: nothing to split)."""
    return Split(0, tp) if tp.size > 1 else None


def row_split(tp: Group) -> Split | None:
    """The input columns of a row-parallel projection."""
    return Split(1, tp) if tp.size > 1 else None


def rows(start: int, stop: int) -> Slicer:
    return lambda t: t[start:stop]


def half(which: str) -> Slicer:
    """Gate (first) or up (second) half of a fused gate_up projection, whatever its size."""
    return (lambda t: t[: t.shape[0] // 2]) if which == "gate" else (lambda t: t[t.shape[0] // 2 :])


def expert_half(expert: int, which: str) -> Slicer:
    return (lambda t: t[expert, : t.shape[1] // 2]) if which == "gate" else (lambda t: t[expert, t.shape[1] // 2 :])


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). With `split` the residual stream is carried apart from
    the last sublayer's output, so each residual add is done inside the next norm (`RMSNorm.add_and_norm`: one
    kernel on the Triton path) instead of as an add of its own."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, residual: torch.Tensor | None = None,
                *, split: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after the layer; with `split`, (mlp output, residual stream before it), whose sum is
        that stream, given `x` the previous layer's mlp output and `residual` its stream (None: `x` is the stream)."""
        if not split:
            x = x + self.self_attn(positions, self.input_layernorm(x), batch)
            return x + self.mlp(self.post_attention_layernorm(x), batch)
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            normed, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn(positions, normed, batch)
        if getattr(self.mlp, "float_router_input", False):  # the router's float32 input from the norm's kernel
            normed, residual, widened = self.post_attention_layernorm.add_and_norm_with_float(attn, residual)
            return self.mlp(normed, batch, router_input=widened), residual
        normed, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp(normed, batch), residual


class HyperDecoderLayer(nn.Module):
    """DecoderLayer's two pre-norm blocks between the mixings of `hc_mult` residual streams [T, n, D]
    (layers/hyper_connection.py: manifold-constrained hyper-connections) instead of one residual (DeepSeek-V4,
    GLM-5.3-Flash). `attn_args`: what the attention takes after (positions, x, batch)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, hc_mult: int,
                 sinkhorn_iters: int, hc_eps: float) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.attn_hc = HyperConnection(hidden_size, hc_mult, sinkhorn_iters, hc_eps, eps)
        self.ffn_hc = HyperConnection(hidden_size, hc_mult, sinkhorn_iters, hc_eps, eps)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, batch: ForwardBatch, *attn_args) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(positions, self.input_layernorm(x), batch, *attn_args)
        streams = HyperConnection.merge(post, comb, out, streams)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(post, comb, self.mlp(self.post_attention_layernorm(x), batch), streams)


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> norm -> LM head. Families subclass to build layers and map tensor names."""

    draft_trees = True  # whether verification may branch (False: drafts are cut to their first path, engine.py)
    # checkpoint tensors that are not part of the model and are ignored (buffers some exporters save)
    ignored = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.|\.attn\.bias$|\.masked_bias$)")

    def __init__(self, config: ModelConfig, layers: list[nn.Module], parallel: Parallel = Parallel()) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, parallel.tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, parallel.tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]

    def linear_layers(self) -> list[nn.Module]:
        """Layers whose memory is a fixed-size state per sequence (linear attention), not paged K/V."""
        return []

    def cache_groups(self) -> list[CacheGroup]:
        """Which KV cache group each attention layer is in (cache_groups.py): one full group unless a family
        mixes layer kinds."""
        return single_group(len(self.attention_layers()))

    def forward(self, batch: ForwardBatch, aux_hidden: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the step.

        `aux_hidden` serves draft heads that read intermediate features (EAGLE-3, Li et al., 2025, arXiv:2503.01840):
        for each layer index that is a key of it, the residual stream that layer outputs is stored under that key.
        Without it (the usual case) nothing is kept.
        """
        x = self.embed(batch)
        if not self.layers or not all(isinstance(layer, DecoderLayer) for layer in self.layers):
            for index, layer in enumerate(self.layers):
                x = layer(batch.positions, x, batch)
                if aux_hidden is not None and index in aux_hidden:
                    aux_hidden[index] = x
            return self.norm(x)
        residual = None  # the stream is x + residual from the first layer on: each add rides in the next norm
        for index, layer in enumerate(self.layers):
            x, residual = layer(batch.positions, x, batch, residual, split=True)
            if aux_hidden is not None and index in aux_hidden:
                aux_hidden[index] = x + residual
        return self.norm.add_and_norm(x, residual)[0]

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's input embeddings [T, hidden], the vision encoder's rows at media placeholders."""
        if batch.media_rows is None:
            return self.embed_tokens(batch.input_ids)
        # placeholder ids (a video's lies past the vocabulary) are looked up as 0, then replaced
        x = self.embed_tokens(batch.input_ids.index_fill(0, batch.media_rows, 0))
        return x.index_copy(0, batch.media_rows, batch.media_embeds.to(x.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- weights ----
    def map_weight(self, name: str) -> WeightTarget | None:
        """Family-specific: where a checkpoint tensor (name without the 'model.' prefix) goes; None to skip it."""
        return WeightTarget(name)

    def packed_weights(self) -> Callable[[str], bool]:
        """`keep_packed` for `weights.iter_checkpoint_weights`: whether a quantized checkpoint tensor (name as stored)
        fills a routed-expert parameter kept quantized, so it is read as its stored parts instead of dequantized."""
        packed = packed_targets(self, self._map_checkpoint_name)

        def keep(stored: str) -> bool:
            name = self.config.text_weight_name(stored)
            return name is not None and packed(name)

        return keep

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        load_parameters(self, self._text_model_weights(weights), self._map_checkpoint_name, self.config.path, tied)

    def _text_model_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The text model's tensors, named without the checkpoint's text-model prefix; vision tower and buffers skipped."""
        for stored, tensor in weights:
            name = self.config.text_weight_name(stored)
            if name is not None and not self.ignored.search(name):
                yield name, tensor

    def _map_checkpoint_name(self, name: str) -> WeightTarget | None:
        name = name[len("model."):] if name.startswith("model.") else name
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return vocab_target(name, self.config.vocab_size, self.parallel.tp)
        return self.map_weight(name)


def vocab_target(param: str, vocab_size: int, tp: Group) -> WeightTarget:
    """An embedding table or LM head: this rank's row block (layers/linear.py `VocabParallelEmbedding`), whose padding
    rows past the vocabulary no tensor fills."""
    if tp.size == 1:
        return WeightTarget(param)
    rows = tp.padded_part(vocab_size)
    return WeightTarget(param, lambda t: t[: max(0, min(rows.stop, vocab_size) - rows.start)], Split(0, tp, padded=True))


def load_parameters(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]],
                    map_weight: Callable[[str], WeightTarget | None], source: object, tied: Collection[str] = ()) -> None:
    """Copy each checkpoint tensor (or the part of it its target's `source` names, read alone from a `LazyTensor`)
    into the parameter slice `map_weight` names for it (None: skip the tensor, unread).

    Shared by the models and the draft models (MTP layers, EAGLE-3 heads), so every loader checks the same things:
    each tensor fits its slice (in dtype too where a module keeps `fixed_dtypes`: packed codes and scales are never
    cast), and at the end every parameter but the `tied` ones was filled completely, but for a vocabulary shard's
    padding rows (`source` names the checkpoint in that error). Then modules derive what they precompute from their
    weights.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    fixed = {f"{path}.{name}".lstrip(".") for path, sub in module.named_modules() for name in getattr(sub, "fixed_dtypes", ())}
    padding = {f"{path}.weight".lstrip("."): sub.padding_rows * sub.weight.shape[1]
               for path, sub in module.named_modules() if getattr(sub, "padding_rows", 0)}
    filled: dict[str, int] = {}
    for name, value in weights:
        target = map_weight(name)
        if target is None:
            continue
        if target.param not in params:
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint: the model has no parameter {target.param!r}")
        parts = target.source.indices(value.shape, name) if target.source is not None else [None]
        read = [(value[index] if index is not None else value) if isinstance(value, torch.Tensor) else value.read(index)
                for index in parts]
        tensor = read[0] if len(read) == 1 else torch.cat(read, dim=target.source.dim)
        param = params[target.param]
        dest = target.slicer(param.data) if target.slicer else param.data
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        if target.param in fixed and tensor.dtype != dest.dtype:  # packed codes and their scales are never cast
            raise ValueError(f"tensor {name!r} is stored as {tensor.dtype}, but {target.param!r} keeps {dest.dtype}")
        dest.copy_(tensor)
        filled[target.param] = filled.get(target.param, 0) + tensor.numel()
    missing = [p for p, t in params.items()
               if p not in tied and filled.get(p, 0) < t.numel() - padding.get(p, 0)]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {source} is missing tensors for: {shown}")
    process_weights_after_loading(module)


def process_weights_after_loading(module: nn.Module) -> None:
    """Let modules derive what they precompute from their weights, once these are final (loaded or dummy)."""
    for sub in module.modules():
        if hasattr(sub, "process_weights_after_loading"):
            sub.process_weights_after_loading()


def packed_targets(module: nn.Module, map_weight: Callable[[str], WeightTarget | None]) -> Callable[[str], bool]:
    """Whether the checkpoint tensor `name` maps (through `map_weight`) into the weights of an `Experts` that keeps
    them quantized."""
    packed = {f"{path}.{param}" for path, sub in module.named_modules()
              if isinstance(sub, Experts) and sub.quant is not None for param in ("w13", "w2")}

    def keep(name: str) -> bool:
        target = map_weight(name) if packed else None
        return target is not None and target.param in packed

    return keep


def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Real, uninitialised storage in `dtype` on `device` for a module built on the meta device (every parameter is
    then loaded, so random init would be wasted work). Parameters a module lists in `fixed_dtypes` (packed quantized
    experts and their scales) and integer ones (index tables) keep the dtype they were built with; routers stay float32, as the published models
    compute routing; rotary tables (plain tensors, not cast with the weights) move to the device."""
    for sub in module.modules():
        fixed = getattr(sub, "fixed_dtypes", frozenset())
        for name, param in list(sub.named_parameters(recurse=False)):
            # plain torch.empty per parameter: nn.Module.to_empty pulls in sympy (~500 modules, ~140 MiB) via meta shapes
            keep = name in fixed or not param.is_floating_point()
            storage = torch.empty(param.shape, dtype=param.dtype if keep else dtype, device=device)
            setattr(sub, name, nn.Parameter(storage, requires_grad=False))
        for name, buffer in list(sub.named_buffers(recurse=False)):
            sub.register_buffer(name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
    for sub in module.modules():
        if isinstance(sub, (Router, HashRouter)):
            sub.float()
        elif isinstance(sub, RotaryEmbedding):
            sub.to_device(device)
    return module


def gqa_target(name: str, num_heads: int, num_kv_heads: int, head_dim: int, parallel: Parallel = Parallel(),
               num_experts: int = 0) -> WeightTarget | None:
    """Map a Llama/Qwen-style tensor into fused qkv_proj and gate_up_proj (this rank's heads and channels), routed
    experts (`num_experts`) into the stacked ones; other names map to themselves. Head counts are the model's."""
    tp = parallel.tp
    q, kv = num_heads // tp.size * head_dim, num_kv_heads // tp.size * head_dim
    match = re.fullmatch(r"(layers\.\d+\.self_attn)\.([qkv])_proj\.(weight|bias)", name)
    if match:
        start = {"q": 0, "k": q, "v": q + kv}[match.group(2)]
        size = q if match.group(2) == "q" else kv
        return WeightTarget(f"{match.group(1)}.qkv_proj.{match.group(3)}", rows(start, start + size), column_split(tp))
    if re.fullmatch(r"layers\.\d+\.self_attn\.o_proj\.weight", name):
        return WeightTarget(name, source=row_split(tp))
    return mlp_target(name, parallel, num_experts)


def mlp_target(name: str, parallel: Parallel = Parallel(), num_experts: int = 0) -> WeightTarget | None:
    """Dense and shared-expert gate/up into gate_up_proj, down_proj as is (this rank's intermediate channels of
    each); routed experts (`num_experts` of them) into the stacked w13 / w2."""
    tp = parallel.tp
    match = re.fullmatch(r"(layers\.\d+\.mlp(?:\.shared_experts)?)\.(gate|up)_proj\.(weight|bias)", name)
    if match:
        return WeightTarget(f"{match.group(1)}.gate_up_proj.{match.group(3)}", half(match.group(2)), column_split(tp))
    if re.fullmatch(r"layers\.\d+\.mlp(?:\.shared_experts)?\.down_proj\.weight", name):
        return WeightTarget(name, source=row_split(tp))
    return expert_target(name, parallel, num_experts)


def expert_target(name: str, parallel: Parallel = Parallel(), num_experts: int = 0) -> WeightTarget | None:
    """`layers.N.mlp.experts.E.{gate,up,down}_proj.weight` -> a slice of the stacked w13 / w2; for experts kept
    quantized, `weight_packed` (INT4) goes there too and `weight_scale` / `weight_scale_inv` into w13_scale / w2_scale
    (the gate's scale rows, then the up's). Under expert parallelism another rank's expert is skipped (None, never
    read); under tensor parallelism each expert's intermediate channels are split: rows of gate/up, columns of down,
    and the same share of their packed words and scale groups (the configuration was checked to split evenly).
    Any other name maps to itself."""
    match = re.fullmatch(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_packed|weight_scale|weight_scale_inv)", name)
    if not match:
        return WeightTarget(name)
    expert, kind = int(match.group(2)), match.group(3)
    suffix = "_scale" if match.group(4).startswith("weight_scale") else ""
    split: Split | None = None
    if parallel.ep is not None:
        local = parallel.ep.part(num_experts, "n_routed_experts")
        if expert not in local:
            return None
        expert -= local.start
    else:
        split = row_split(parallel.tp) if kind == "down" else column_split(parallel.tp)
    if kind == "down":
        return WeightTarget(f"{match.group(1)}.w2{suffix}", lambda t: t[expert], split)
    return WeightTarget(f"{match.group(1)}.w13{suffix}", expert_half(expert, kind), split)
