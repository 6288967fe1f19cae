"""Training-time DeepSeek-V3 model for the bundled tiny reasoner.

A compact, full-sequence (no KV cache) re-implementation of Hugging Face's ``DeepseekV3ForCausalLM`` plus DeepSeek's
multi-token-prediction (MTP) module. Parameter names and shapes are exactly those of a DeepSeek-V3 checkpoint, so
``state_dict_for_checkpoint()`` can be written to safetensors and loaded by transformers and by our own engine; the
numerics (interleaved RoPE, softmax scale, sigmoid noaux_tc routing with group limits, RMSNorm) follow
transformers' implementation so logits agree to float32 rounding.

Experts are kept as separate ``gate_proj/up_proj/down_proj`` modules (the checkpoint layout) but computed densely:
every expert runs on every token and is weighted by its routing weight, which is zero for unselected experts. On a
small CPU this is faster than gathering tokens per expert, and the forward value and all gradients equal those of
sparse dispatch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn


@dataclass
class TinyConfig:
    """The architecture hyper-parameters, named as in DeepSeek-V3's config.json."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 4
    n_shared_experts: int = 1
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int = 1
    pad_token_id: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_hf_config(self) -> dict:
        """The config.json of the checkpoint (DeepSeek-V3's field names and fixed choices)."""
        fields = asdict(self)
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            **fields,
            "num_key_value_heads": self.num_attention_heads,
            "hidden_act": "silu",
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "moe_layer_freq": 1,
            "ep_size": 1,
            "aux_loss_alpha": 0.0,
            "seq_aux": True,
            "rope_scaling": None,
            "rope_interleave": True,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_cache": True,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_config(cls, config: dict) -> TinyConfig:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in config.items() if k in names})


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied after casting back (transformers' order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: TinyConfig) -> torch.Tensor:
    """RoPE's angle per position for each rotated pair [rope_dim / 2]."""
    dim = cfg.qk_rope_head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_cos_sin(cfg: TinyConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair angles for interleaved RoPE: cos/sin of shape [T, rope_dim / 2]."""
    freqs = positions.float()[:, None] * rope_inv_freq(cfg)[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); like transformers, the result is laid out as [rotated evens, rotated odds]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention with a low-rank query (q_lora_rank), expanded form for full-sequence training."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.num_attention_heads
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.qk_head_dim**-0.5

    def _qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head queries, keys and values [B, H, T, dim] with RoPE applied."""
        cfg = self.cfg
        b, t, _ = x.shape
        h = cfg.num_attention_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, h, cfg.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_nope)).view(b, t, h, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        q_rot = apply_rope_interleaved(q_rot, cos, sin)
        k_rot = apply_rope_interleaved(k_rot.view(b, 1, t, cfg.qk_rope_head_dim), cos, sin).expand(b, h, t, -1)
        return torch.cat([q_nope, q_rot], dim=-1), torch.cat([k_nope, k_rot], dim=-1), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def attention_weights(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal attention probabilities [B, H, T, T] (for inspecting heads; forward uses fused SDPA)."""
        q, k, _ = self._qkv(x, cos, sin)
        t = x.shape[1]
        scores = (q @ k.transpose(-1, -2)) * self.scale
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        return scores.masked_fill(~causal, float("-inf")).softmax(-1)


class MLP(nn.Module):
    """SwiGLU feed-forward (dense layer, shared expert and each routed expert)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """noaux_tc routing: sigmoid affinities, bias only for selection, group-limited top-k (DeepSeek-V3 sec. 2.1.2)."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (top-k expert indices [N, k], their combine weights [N, k]) for flattened tokens x [N, d]."""
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = cfg.n_routed_experts // cfg.n_group
        group_scores = choice.view(-1, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, cfg.n_group, per_group).reshape(-1, cfg.n_routed_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        idx = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.routed_scaling_factor


class MoE(nn.Module):
    """Routed experts plus a shared expert; records per-expert token counts for aux-loss-free balancing."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.last_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, weights = self.gate(flat)
        dense_w = torch.zeros(flat.shape[0], self.cfg.n_routed_experts, dtype=weights.dtype, device=x.device)
        dense_w = dense_w.scatter(1, idx, weights)
        with torch.no_grad():
            hits = torch.zeros_like(dense_w).scatter_(1, idx, 1.0)
            if token_mask is not None:
                hits = hits * token_mask.reshape(-1, 1).to(hits.dtype)
            self.last_counts = hits.sum(0)
        e, inter = self.cfg.n_routed_experts, self.cfg.moe_intermediate_size
        w_gate = torch.cat([m.gate_proj.weight for m in self.experts], dim=0)
        w_up = torch.cat([m.up_proj.weight for m in self.experts], dim=0)
        w_down = torch.cat([m.down_proj.weight for m in self.experts], dim=1)
        act = F.silu(F.linear(flat, w_gate)) * F.linear(flat, w_up)
        act = (act.view(-1, e, inter) * dense_w.to(act.dtype).unsqueeze(-1)).view(-1, e * inter)
        routed = F.linear(act, w_down)
        return (routed + self.shared_experts(flat)).view(shape)


class DecoderLayer(nn.Module):
    """Pre-norm block: MLA attention then a dense MLP (first_k_dense_replace layers) or the MoE."""

    def __init__(self, cfg: TinyConfig, moe: bool) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg)
        self.mlp: nn.Module = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, token_mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, token_mask) if isinstance(self.mlp, MoE) else self.mlp(h))


class SharedHead(nn.Module):
    """The MTP module's output norm; its head is the main lm_head (shared, stored as a copy in the checkpoint)."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 MTP module: h' = eh_proj([enorm(emb(t+1)); hnorm(h_t)]) then a full MoE decoder block."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__(cfg, moe=True)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)


class TinyModel(nn.Module):
    """Backbone: embeddings, decoder layers, final norm; the MTP layer sits at index num_hidden_layers."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [
            DecoderLayer(cfg, moe=i >= cfg.first_k_dense_replace) for i in range(cfg.num_hidden_layers)
        ]
        layers += [MTPLayer(cfg) for _ in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyDeepseekV3(nn.Module):
    """DeepseekV3ForCausalLM with its MTP head, for training and as the reference for checkpoint checks."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TinyModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init)

    def _init(self, module: nn.Module) -> None:
        std = self.cfg.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, Router):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, MLP):
            # Scale residual-branch outputs by depth (GPT-2 style) so the small model starts near identity.
            nn.init.normal_(module.down_proj.weight, std=std / math.sqrt(2 * (self.cfg.num_hidden_layers + 1)))

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(
        self, input_ids: torch.Tensor, token_mask: torch.Tensor | None = None, with_mtp: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Main logits [B, T, V]; with_mtp adds MTP logits [B, T-1, V], row t predicting token t+2 from (h_t, x_{t+1}).

        The MTP input h_t is the final-normed hidden state (what the lm_head reads), as transformers and vLLM feed it.
        inputs_embeds replaces the token embeddings (image features in place of the media placeholders).
        """
        cfg = self.cfg
        t = input_ids.shape[1]
        cos, sin = rope_cos_sin(cfg, torch.arange(t, device=input_ids.device))
        emb = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = emb
        for layer in self.model.layers[: cfg.num_hidden_layers]:
            x = layer(x, cos, sin, token_mask)
        h = self.model.norm(x)
        logits = self.lm_head(h)
        if not with_mtp:
            return logits, None
        mtp: MTPLayer = self.model.layers[cfg.num_hidden_layers]
        z = mtp.eh_proj(torch.cat([mtp.enorm(emb[:, 1:]), mtp.hnorm(h[:, :-1])], dim=-1))
        mask = token_mask[:, 1:] if token_mask is not None else None
        z = mtp(z, cos[: t - 1], sin[: t - 1], mask)
        return logits, self.lm_head(mtp.shared_head.norm(z))

    def state_dict_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """DeepSeek-V3 checkpoint tensors: adds the MTP layer's copies of the shared embedding and output head."""
        sd = {k: v.detach().contiguous().clone() for k, v in self.state_dict().items()}
        mtp = f"model.layers.{self.cfg.num_hidden_layers}"
        sd[f"{mtp}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
        sd[f"{mtp}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
        return sd

    def load_checkpoint_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Inverse of state_dict_for_checkpoint (the MTP copies must equal the shared tensors)."""
        mtp = f"model.layers.{self.cfg.num_hidden_layers}"
        sd = dict(sd)
        sd.pop(f"{mtp}.embed_tokens.weight")
        sd.pop(f"{mtp}.shared_head.head.weight")
        self.load_state_dict(sd, strict=True)


def previous_token_amplitudes(inv_freq: torch.Tensor, span: int = 600, steps: int = 500) -> torch.Tensor:
    """Per-frequency amplitudes m_f of the attention score sum_f m_f cos(inv_freq_f (d - 1)) at key distance d, fitted
    so that a causal softmax puts most of its weight on d = 1 for queries up to `span` tokens in."""
    d = torch.arange(span, dtype=torch.float32)
    waves = torch.cos((d[:, None] - 1) * inv_freq[None, :])
    ends = [2, 5, 10, 30, 100, 300, span - 1]
    log_m = torch.zeros(len(inv_freq), requires_grad=True)
    opt = torch.optim.Adam([log_m], lr=0.05)
    with torch.enable_grad():
        for _ in range(steps):
            scores = waves @ log_m.exp()
            fit = -sum(scores[: e + 1].log_softmax(0)[1] for e in ends) / len(ends)
            loss = fit + 1e-3 * log_m.exp().square().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return log_m.detach().exp()


@torch.no_grad()
def install_previous_token_head(model: TinyDeepseekV3, generator: torch.Generator, head: int = 0) -> float:
    """Set head `head` of layer 0 to attend to the previous token from the first training step.

    Copying operands, the skill every task needs, takes an induction circuit: a previous-token head and a later head
    that matches on what it wrote (Olsson et al., 2022, "In-context Learning and Induction Heads"). From random weights
    the model first sits on a loss plateau until that circuit forms (about 2,500 of the ~5,500 steps of a 55-minute
    run); this builds its first half by hand. MLA sees positions only through the decoupled RoPE query and shared RoPE
    key, and those must not depend on the token, so every embedding gets a common direction u; the head's RoPE query
    and the RoPE key read u, with amplitudes and phases per frequency that make the score peak at distance 1. The
    other heads keep their random weights; the RoPE key, shared by all heads, becomes purely positional. Training does
    not keep the head clean (the embeddings' updates soon outweigh u); every run that started from it so far did better
    on the eval overall than the weights before it (docs/tiny-reasoner.md).
    Returns the head's mean attention on the previous token over random tokens (for the training log).
    """
    cfg = model.cfg
    layer = model.model.layers[0]
    attn: MLAttention = layer.self_attn
    emb = model.model.embed_tokens.weight
    u = torch.randn(cfg.hidden_size, generator=generator)
    u /= u.norm()
    # The RoPE key has no norm, so its size varies with each token's weight along u: make that weight the same.
    emb -= (emb @ u)[:, None] * u
    emb += 0.5 * emb.norm(dim=-1).mean() * u
    x = layer.input_layernorm(emb)
    along_u = (x @ u).mean()
    # The query reads u through a few latent dims that q_a_layernorm then normalises with the rest.
    n_read = 4
    attn.q_a_proj.weight[:n_read] = 0.15 * u
    latent = attn.q_a_layernorm(attn.q_a_proj(x))[:, :n_read].mean()
    rope = cfg.qk_rope_head_dim
    inv_freq = rope_inv_freq(cfg)
    amp = previous_token_amplitudes(inv_freq)
    # Interleaved RoPE rotates the pair (x[2i], x[2i+1]) like the complex number x[2i] + i x[2i+1], so the score is
    # sum_f Re(q_f conj(k_f) e^{i inv_freq_f d}): a real key k_f and q_f = (m_f / k_f) e^{-i inv_freq_f} peak at d = 1.
    key = 6.0
    k_rows = attn.kv_a_proj_with_mqa.weight[cfg.kv_lora_rank:]
    k_rows.zero_()
    k_rows[0::2] = (key / along_u) * u
    radius = amp / (key * attn.scale) / (n_read * latent)
    base = head * cfg.qk_head_dim + cfg.qk_nope_head_dim
    q_rows = attn.q_b_proj.weight[base: base + rope]
    q_rows.zero_()
    q_rows[0::2, :n_read] = (radius * inv_freq.cos())[:, None]
    q_rows[1::2, :n_read] = (-radius * inv_freq.sin())[:, None]
    ids = torch.randint(cfg.vocab_size, (2, 256), generator=generator)
    cos, sin = rope_cos_sin(cfg, torch.arange(ids.shape[1]))
    probs = attn.attention_weights(layer.input_layernorm(model.model.embed_tokens(ids)), cos, sin)[:, head]
    return probs.diagonal(offset=-1, dim1=-2, dim2=-1).mean().item()


def save_checkpoint(model: TinyDeepseekV3, out_dir: Path) -> None:
    """Write config.json and model.safetensors (float32) in DeepSeek-V3's Hugging Face layout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "config.json", "w") as f:
        json.dump(model.cfg.to_hf_config(), f, indent=2)
        f.write("\n")
    save_file(model.state_dict_for_checkpoint(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def load_checkpoint(model_dir: Path) -> TinyDeepseekV3:
    """Rebuild the training model from a saved checkpoint (float32, eval mode). A multimodal kimi_k25 checkpoint
    gives its language model (text_config, tensors under ``language_model.``); the vision tower is not read."""
    with open(model_dir / "config.json") as f:
        config = json.load(f)
    prefix = ""
    if config.get("model_type") == "kimi_k25":
        config, prefix = config["text_config"], "language_model."
    model = TinyDeepseekV3(TinyConfig.from_hf_config(config))
    tensors = load_file(str(model_dir / "model.safetensors"))
    model.load_checkpoint_state({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    return model.eval()
