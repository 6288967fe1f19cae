"""EAGLE-3 draft heads (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv:2503.01840) as a draft model.

An EAGLE-3 head reads the target's features from three layers (low, middle, high), fuses them with `fc`, and runs one
Llama decoder layer whose attention input is the concatenation of the token embedding and those features; its LM head
covers a reduced draft vocabulary. Training-time test teaches it to take its own output features in place of the
target's, which is how a draft longer than one token is chained. For position t:

    f_t = fc([a_t; b_t; c_t])                                  (target layers' outputs at t)
    x   = [input_layernorm(embed(x_{t+1})); hidden_norm(f_t)]  (2 * hidden wide)
    r   = f_t + attn(x);  r = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(r)) over draft ids -> x_{t+2} = d + d2t[d];   r is carried to position t + 1

The published checkpoint layout (`LlamaForCausalLMEagle3`, as the heads for Llama 3 and Kimi K2.5 are released):
config.json with `draft_vocab_size`, optionally `target_hidden_size`, `norm_before_residual` and
`eagle_config.eagle_aux_hidden_state_layer_ids`; tensors `fc.weight` [hidden, 3 * target_hidden], `midlayer.*` (q/k/v
read 2 * hidden), `norm.weight`, `lm_head.weight` [draft_vocab, hidden], `d2t` [draft_vocab] int64 offsets, `t2d`
[target_vocab] bool, and optionally `embed_tokens.weight` (else the target's embedding is used).

Layer ids: a listed id names the output of that target layer (SGLang's convention, which the Kimi K2.5 head's
[1, 29, 57] for 61 layers follows); without a list the head reads the inputs of layers 2, L // 2 and L - 3, i.e. the
outputs of layers 1, L // 2 - 1 and L - 4, the same features.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import EngineConfig, ModelConfig, load_model_config
from reasoning_engine.layers import use_kernel_backend
from reasoning_engine.layers.attention import GQAttention
from reasoning_engine.layers.linear import can_pack, pack_linears
from reasoning_engine.layers.moe import GatedMLP
from reasoning_engine.layers.norm import RMSNorm
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import CausalLM, DecoderLayer, gqa_target, load_parameters, materialize
from reasoning_engine.models.weights import checkpoint_files, iter_checkpoint_weights

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Layer(DecoderLayer):
    """The head's decoder layer: a Llama layer whose q/k/v read [embedding; features], plus the features' norm."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        hidden = config.hidden_size
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = bool(config.get("attention_bias", False))
        attn = GQAttention(hidden, heads, kv_heads, head_dim, rotary, bias=bias)
        attn.qkv_proj = nn.Linear(2 * hidden, (heads + 2 * kv_heads) * head_dim, bias=bias)  # 2 * hidden wide input
        mlp = GatedMLP(hidden, config.raw["intermediate_size"], bias=bool(config.get("mlp_bias", False)))
        super().__init__(attn, mlp, hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)


class Eagle3DraftModel(nn.Module):
    """An EAGLE-3 head as a `DraftModel`. `embed_tokens` is the head's own, or the target's (attached after loading)."""

    def __init__(self, config: ModelConfig, aux_layers: tuple[int, ...], target_hidden: int, draft_vocab: int,
                 own_embedding: bool, max_positions: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                 config.max_position_embeddings, max_positions)
        self.aux_layers = aux_layers
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.fc = nn.Linear(len(aux_layers) * target_hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config, rotary)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.embed_tokens: nn.Embedding | None = (
            nn.Embedding(config.vocab_size, hidden, _weight=torch.empty(config.vocab_size, hidden)) if own_embedding else None)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]

    def target_features(self, hidden: torch.Tensor, aux_hidden: Mapping[int, torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat([aux_hidden[i] for i in self.aux_layers], dim=-1))

    def forward(self, batch: ForwardBatch, features: torch.Tensor,
                input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[0]
        embeds = layer.input_layernorm(self.embed_tokens(input_ids))
        normed = layer.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        residual = residual + layer.self_attn(batch.positions, torch.cat([embeds, normed], dim=-1), batch)
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return self.norm(residual), residual

    def greedy(self, head_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm_head(head_input).float()
        top, draft_ids = logits.max(dim=-1)
        return draft_ids + self.d2t[draft_ids], (top - logits.logsumexp(dim=-1)).exp()


def aux_layer_ids(draft: ModelConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs the head reads (see the module docstring for the convention)."""
    eagle = draft.get("eagle_config") or {}
    listed = eagle.get("eagle_aux_hidden_state_layer_ids") or draft.get("eagle_aux_hidden_state_layer_ids")
    n = num_target_layers
    ids = tuple(int(i) for i in listed) if listed else (1, n // 2 - 1, n - 4)
    if any(not 0 <= i < n for i in ids):
        raise ValueError(f"speculative_config.model: the EAGLE-3 head reads target layers {list(ids)}, but the target "
                         f"has {n} layers (list eagle_config.eagle_aux_hidden_state_layer_ids for a small target)")
    return ids


def _head_weights(weights: Iterable[tuple[str, torch.Tensor]],
                  maps: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names in our module's terms: `midlayer.` is layer 0 of `layers`; d2t / t2d are set aside in `maps`."""
    for name, tensor in weights:
        name = name[len("model."):] if name.startswith("model.") else name
        if name in ("d2t", "t2d"):
            maps[name] = tensor
        else:
            yield (f"layers.0.{name[len('midlayer.'):]}" if name.startswith("midlayer.") else name), tensor


def _set_vocab_maps(model: Eagle3DraftModel, maps: dict[str, torch.Tensor], vocab: int, path: Path) -> None:
    """Install d2t (draft id -> target id offsets) and check it against t2d (which target ids the head can draft)."""
    draft_vocab = model.lm_head.weight.shape[0]
    if "d2t" not in maps:
        if draft_vocab != vocab:
            raise ValueError(f"EAGLE-3 head {path}: draft_vocab_size {draft_vocab} != {vocab} but the checkpoint has no d2t")
        return
    d2t = maps["d2t"].long()
    targets = torch.arange(draft_vocab) + d2t
    if tuple(d2t.shape) != (draft_vocab,) or bool(((targets < 0) | (targets >= vocab)).any()):
        raise ValueError(f"EAGLE-3 head {path}: d2t must map each of {draft_vocab} draft ids into [0, {vocab})")
    if "t2d" in maps:
        t2d = maps["t2d"].bool()
        if tuple(t2d.shape) != (vocab,) or not bool(t2d[targets].all()):
            raise ValueError(f"EAGLE-3 head {path}: t2d [{vocab}] must mark every target id that d2t maps to")
    model.d2t.copy_(d2t)


def load_eagle3(path: str | Path, target: CausalLM, engine_config: EngineConfig) -> Eagle3DraftModel:
    """Load an EAGLE-3 head for `target` from its checkpoint folder (config.json + safetensors)."""
    folder = Path(path)
    draft = load_model_config(folder)
    architectures = draft.raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in architectures):
        raise ValueError(f"speculative_config.model: {folder} is not an EAGLE-3 head (architectures {architectures}, "
                         f"expected one of {', '.join(ARCHITECTURES)})")
    if draft.num_hidden_layers != 1:
        raise ValueError(f"speculative_config.model: EAGLE-3 heads with one decoder layer are supported, "
                         f"{folder} has {draft.num_hidden_layers}")
    tcfg = target.config
    if draft.vocab_size != tcfg.vocab_size:
        raise ValueError(f"speculative_config.model: the head's vocab_size {draft.vocab_size} differs from the "
                         f"target's {tcfg.vocab_size}")
    target_hidden = int(draft.get("target_hidden_size", tcfg.hidden_size))
    if target_hidden != tcfg.hidden_size:
        raise ValueError(f"speculative_config.model: the head expects target_hidden_size {target_hidden}, the target "
                         f"has {tcfg.hidden_size}")
    names = {n[len("model."):] if n.startswith("model.") else n for n in checkpoint_files(folder)}
    own_embedding = "embed_tokens.weight" in names
    if not own_embedding and draft.hidden_size != tcfg.hidden_size:
        raise ValueError(f"speculative_config.model: {folder} has no embed_tokens and its hidden size "
                         f"{draft.hidden_size} differs from the target's {tcfg.hidden_size}")
    aux = aux_layer_ids(draft, tcfg.num_hidden_layers)
    draft_vocab = int(draft.get("draft_vocab_size", draft.vocab_size))
    with torch.device("meta"):
        model = Eagle3DraftModel(draft, aux, target_hidden, draft_vocab, own_embedding, engine_config.max_model_len)
    model = materialize(model, engine_config.dtype, engine_config.device)
    if not own_embedding:
        model.embed_tokens = target.embed_tokens  # shared after materialize, which would otherwise re-allocate it
    maps: dict[str, torch.Tensor] = {}
    weights = _head_weights(iter_checkpoint_weights(folder, None, engine_config.dtype, progress=False), maps)
    c = draft
    load_parameters(model, weights, lambda n: gqa_target(n, c.num_attention_heads, c.num_key_value_heads, c.head_dim),
                    folder, tied=() if own_embedding else ("embed_tokens.weight",))
    _set_vocab_maps(model, maps, tcfg.vocab_size, folder)
    if can_pack(engine_config.dtype, engine_config.device):
        pack_linears(model)
    use_kernel_backend(model, engine_config.kernel_backend)
    return model.eval()
