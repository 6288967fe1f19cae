"""Model and engine configuration.

A checkpoint's config.json is normalised into one ModelConfig whatever the family or the transformers version that
wrote it (`rope_scaling` vs `rope_parameters`, Kimi K2.5's `text_config` wrapper), so model code reads one shape.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reasoning_engine.quant_config import parse_quant_config

# the tiny reasoning model shipped inside the package (tiny/assets): the model when none is given
BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "tiny" / "assets"
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v2", "qwen3", "qwen3_moe", "llama", "glm4_moe",
                         "minimax_m2", "deepseek_v32", "glm_moe_dsa", "gpt_oss", "glm4_moe_lite",
                         "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear",
                         "deepseek_v4", "glm5_next")
# Qwen3.5's checkpoints wrap the text model (with a vision tower beside it); the text config class reads its fields
_TEXT_CONFIG_CLASS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))}, got {value!r}")
    return _DTYPES[value]


@dataclass
class ModelConfig:
    """The text model's hyper-parameters, family-independent names; `raw` keeps the whole text config."""

    path: Path
    model_type: str  # as written in config.json (kimi_k2, kimi_k25, deepseek_v3, ...)
    family: str  # which implementation runs it: deepseek_v3 | deepseek_v2 | qwen3 | qwen3_moe | llama
    raw: dict[str, Any]
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    torch_dtype: torch.dtype
    eos_token_ids: list[int]
    weight_prefix: str = ""  # prefix of the text model's tensors in the checkpoint ("language_model." for kimi_k25)
    skipped_prefixes: tuple[str, ...] = ()  # checkpoint tensors that are not the text model (vision tower)
    # other layouts of the text model's tensors: (stored prefix, name after weight_prefix); transformers writes
    # kimi_k25 as model.language_model.* and lm_head.*, the official checkpoint as language_model.model.*
    weight_renames: tuple[tuple[str, str], ...] = ()
    # filled by the engine once the tokenizer and the context limit are known
    max_model_len: int = 0
    think_end_token_id: int | None = None

    def text_weight_name(self, stored: str) -> str | None:
        """A checkpoint tensor's name within the text model, or None for the vision tower and projector."""
        if self.skipped_prefixes and stored.startswith(self.skipped_prefixes):
            return None
        for source, target in self.weight_renames:
            if stored.startswith(source):
                return target + stored[len(source):]
        if not stored.startswith(self.weight_prefix):
            raise ValueError(f"unexpected tensor {stored!r}: text model tensors are expected under "
                             f"{self.weight_prefix!r}")
        return stored[len(self.weight_prefix):]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key, default)
        return default if value is None and default is not None else value

    @property
    def is_mla(self) -> bool:
        return self.family in ("deepseek_v3", "deepseek_v2", "deepseek_v32", "glm_moe_dsa")

    @property
    def name(self) -> str:
        return self.path.name


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    model_dir = Path(path)
    config_file = model_dir / "config.json"
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: not a Hugging Face checkpoint folder")
    outer = json.loads(config_file.read_text())
    model_type = outer.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} in {config_file}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    raw = outer
    prefix = ""
    skipped: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    if model_type == "kimi_k25":
        if "text_config" not in outer:
            raise ValueError(f"kimi_k25 config in {config_file} has no text_config")
        raw = dict(outer["text_config"])
        prefix = "language_model."
        skipped = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "model.vision_tower.",
                   "model.mm_projector.")
        # transformers 5 writes either layout; its original-format save names the text layers "blocks"
        renames = (("language_model.model.blocks.", "model.layers."), ("model.language_model.", "model."),
                   ("lm_head.", "lm_head."))
        raw.setdefault("quantization_config", outer.get("quantization_config"))
        raw.setdefault("torch_dtype", outer.get("torch_dtype") or outer.get("dtype"))
    if model_type in _TEXT_CONFIG_CLASS:
        if "text_config" not in outer:
            raise ValueError(f"{model_type} config in {config_file} has no text_config")
        raw = dict(outer["text_config"])
        skipped = ("model.visual.", "mtp.")
        renames = (("model.language_model.", "model."), ("lm_head.", "lm_head."))
        raw.setdefault("tie_word_embeddings", outer.get("tie_word_embeddings"))
        raw.setdefault("torch_dtype", outer.get("torch_dtype") or outer.get("dtype"))
        raw.setdefault("quantization_config", outer.get("quantization_config"))
    elif model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        skipped = ("mtp.",)  # the multi-token-prediction layer: a draft model, not the text model
    elif model_type == "glm5_next":  # the image-text wrapper (text_config, model.language_model.*), or flat text
        skipped = ("model.visual.",)
        if "text_config" in outer:
            raw = dict(outer["text_config"])
            renames = (("model.language_model.", "model."), ("lm_head.", "lm_head."))
            raw.setdefault("tie_word_embeddings", outer.get("tie_word_embeddings"))
            raw.setdefault("torch_dtype", outer.get("torch_dtype") or outer.get("dtype"))
            raw.setdefault("quantization_config", outer.get("quantization_config"))
    # GLM-4.7-Flash (glm4_moe_lite) is DeepSeek-V3's MLA and MoE; its own config class reads its fields
    # (`mlp_layer_types`, GLM's defaults)
    family = {"kimi_k2": "deepseek_v3", "kimi_k25": "deepseek_v3",
              "glm4_moe_lite": "deepseek_v3", "qwen3_5": "qwen3_next", "qwen3_5_moe": "qwen3_next",
              "qwen3_5_text": "qwen3_next", "qwen3_5_moe_text": "qwen3_next"}.get(model_type, model_type)
    config_class = {"glm4_moe_lite": "glm4_moe_lite", "glm5_next": "glm5_next_text", **_TEXT_CONFIG_CLASS}.get(
        model_type, model_type if family == "qwen3_next" else family)
    raw = normalise_config(config_class, raw, config_file)
    if model_type == "kimi_linear":  # its class reads `linear_attn_config`, `first_k_dense_replace` and its MoE
        # names (num_experts, num_expert_group, ...) into layer_types / mlp_layer_types / DeepSeek-V3's names
        raw["n_routed_experts"] = raw["num_experts"]
    theta, scaling = _rope(raw)
    num_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id", outer.get("eos_token_id"))
    dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return ModelConfig(
        path=model_dir,
        model_type=model_type,
        family=family,
        raw=raw,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))),
        rope_theta=theta,
        rope_scaling=scaling,
        torch_dtype=parse_dtype(dtype_name) if isinstance(dtype_name, str) and dtype_name in _DTYPES else torch.float32,
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        weight_prefix=prefix,
        skipped_prefixes=skipped,
        weight_renames=renames,
    )


def normalise_config(family: str, raw: dict[str, Any], source: Path | str = "config.json") -> dict[str, Any]:
    """config.json read through transformers' own config class for the family, so checkpoints written by
    transformers 4.x and 5.x and the hub's hand-edited configs all read the same: renamed fields (5.x writes Qwen3-MoE's
    `num_experts` as `num_local_experts`, `rope_scaling` + `rope_theta` as `rope_parameters`) are resolved by the
    class's attribute map and its standardisation, and fields a config leaves out take the defaults transformers'
    reference model takes. Fields the file sets win; every alias of the attribute map is filled in both directions."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    try:
        standard = config_class.from_dict({k: v for k, v in raw.items() if k not in ("model_type", "auto_map")})
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{source}: transformers' {config_class.__name__} rejects this config: {exc}") from exc
    # rope_parameters is transformers' reading of whichever spelling the file uses (rope_theta + rope_scaling)
    merged = {**standard.to_dict(), **raw, "rope_parameters": standard.to_dict().get("rope_parameters")}
    for alias, attribute in config_class.attribute_map.items():
        if attribute in merged and alias not in merged:
            merged[alias] = merged[attribute]
        elif alias in merged and attribute not in merged:
            merged[attribute] = merged[alias]
    return merged


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Accept both `rope_theta` + `rope_scaling` (published checkpoints) and `rope_parameters` (new transformers)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


_MEMORY_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
                 "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_memory(value: str | int, name: str = "kv_cache_memory") -> int:
    """'2GiB' / '512MB' / 123456 -> bytes (ValueError naming the field `name`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if not match or match.group(2).lower() not in _MEMORY_UNITS:
        raise ValueError(f"{name} must look like '2GiB' or '512MB', got {value!r}")
    return int(float(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()])


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def parse_kv_cache_dtype(value: str | None) -> str:
    """vLLM's names for the KV cache's dtype: "auto" (the model's), "fp8" or its alias "fp8_e4m3" -> "auto" or
    "fp8"."""
    if value is None or value == "auto":
        return "auto"
    if value in ("fp8", "fp8_e4m3"):
        return "fp8"
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")


EXECUTOR_BACKENDS = ("mp", "ray")
# images and videos one prompt may carry when limit_mm_per_prompt leaves a kind out
DEFAULT_LIMIT_MM_PER_PROMPT = {"image": 16, "video": 2}


@dataclass
class ParallelConfig:
    """How the model is spread over processes, with vLLM's names. There are tensor_parallel_size x
    data_parallel_size ranks: each data-parallel replica splits attention and dense layers over its
    tensor_parallel_size ranks; with enable_expert_parallel the routed experts are partitioned over all ranks instead
    of split like the dense layers. Several nodes: `nnodes` launches of the same command (one per node, `node_rank`
    0 to nnodes - 1), meeting at master_addr:master_port (node 0, which runs the driver)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str = "mp"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port, found at start (one node only)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def check(self, model: ModelConfig, device: torch.device) -> None:
        """Raise ValueError naming the option when these ranks cannot run `model` here: sizes that do not divide
        what they split, DP without expert parallelism, more ranks than GPUs."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        for name, value in (("tensor_parallel_size", tp), ("data_parallel_size", dp), ("nnodes", self.nnodes)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}) for nnodes={self.nnodes}, got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must divide the {self.world_size} ranks "
                             f"(tensor_parallel_size x data_parallel_size)")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need master_port (and master_addr: node 0's address) to meet at")
        moe_experts = model.get("n_routed_experts") or model.get("num_experts") or 0
        if dp > 1 and not (self.enable_expert_parallel and moe_experts):
            raise ValueError("data_parallel_size > 1 runs attention data-parallel beside expert-parallel MoE layers: it "
                             "needs enable_expert_parallel and a mixture-of-experts model")
        if device.type == "cuda" and self.ranks_per_node > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size x data_parallel_size / nnodes = {self.ranks_per_node} ranks per "
                             f"node, but this node has {torch.cuda.device_count()} CUDA devices")
        self._check_splits(model, moe_experts)

    def _check_splits(self, model: ModelConfig, moe_experts: int) -> None:
        tp, raw = self.tensor_parallel_size, model.raw
        needs = [("num_attention_heads", model.num_attention_heads)]
        if not model.is_mla and model.family != "deepseek_v4":  # V4's one K=V row is whole on every rank
            needs.append(("num_key_value_heads", model.num_key_value_heads))
        if raw.get("o_groups"):  # DeepSeek-V4's output groups, split with their heads
            needs.append(("o_groups", raw["o_groups"]))
        if raw.get("intermediate_size"):
            needs.append(("intermediate_size", raw["intermediate_size"]))
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_num_heads", "shared_expert_intermediate_size"):
            if raw.get(name):  # linear-attention heads (their states too) and a Qwen-style shared expert
                needs.append((name, raw[name]))
        shared = (raw.get("n_shared_experts") or 0) * (raw.get("moe_intermediate_size") or 0)
        if shared:
            needs.append(("moe_intermediate_size x n_shared_experts", shared))
        for what, total in needs:
            if total % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide {what} ({total})")
        if not moe_experts or self.world_size == 1:
            return
        if self.enable_expert_parallel:
            if moe_experts % self.world_size:
                raise ValueError(f"enable_expert_parallel partitions the routed experts over all {self.world_size} ranks "
                                 f"(tensor_parallel_size x data_parallel_size), which must divide n_routed_experts "
                                 f"({moe_experts})")
            return
        quant = parse_quant_config(raw)
        unit = 1  # packed experts split in whole INT4 scale groups (of whole int32 words) or FP8 blocks
        if quant is not None and quant.method != "fp8-channel":  # per-channel FP8: any split keeps whole scales
            unit = math.lcm(8, quant.group_size) if quant.method == "compressed-tensors" else math.lcm(*quant.block)
            if quant.method == "mxfp4" or quant.expert_dtype == "fp4":  # whole groups of 32 (gpt-oss, DeepSeek-V4)
                unit = 32
        # the experts' width: MiniMax-M2 names it intermediate_size (it has no dense MLP)
        field = "moe_intermediate_size" if raw.get("moe_intermediate_size") else "intermediate_size"
        inter = raw[field]
        if tp > 1 and inter % (tp * unit):
            whole = f"whole quantization blocks of {unit} channels" if unit > 1 else "equal parts"
            raise ValueError(f"tensor_parallel_size={tp} must split {field} ({inter}) into {whole}; or "
                             f"pass enable_expert_parallel to partition the experts over the ranks instead")


@dataclass
class EngineConfig:
    """Everything the engine needs besides the weights; built from LLM(...) keyword arguments."""

    model: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    block_size: int = 16
    kv_cache_blocks: int | None = None  # of block pool 0 (a model's other pools, DeepSeek-V4's window, are sized apart)
    kv_cache_memory: int | None = None
    # "auto": the cache in `dtype`; "fp8": K/V (MLA: the latent) in float8 e4m3 with a scale per row (kernels/fp8_cache.py)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    seed: int = 0
    kernel_backend: str = "torch"
    # CUDA graphs for decode batches are captured on CUDA unless enforce_eager (always eager on CPU).
    enforce_eager: bool = False
    # torch.compile the model forward of CPU decode steps (engine/compiled_decode.py), compiled when the engine starts
    # (minutes on a small CPU); not with EAGLE-3 drafts, whose steps read intermediate layers.
    compile_decode: bool = False
    # "auto": weights from the checkpoint; "dummy": random weights from config.json alone (benchmarks, like vLLM's).
    load_format: str = "auto"
    speculative_config: dict[str, Any] | None = None
    tokenizer: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # adaptive optimisation (reasoning_engine/adaptive): draft lengths by goodput, latency-aware token budgets, KV
    # retention for agent sessions, learned state kept in state_dir; False gives the static behaviour
    adaptive: bool = True
    state_dir: str | None = None
    target_itl_ms: float | None = None
    target_ttft_ms: float | None = None
    # CUDA-graph decode buckets (None: powers of two up to max_num_seqs); the adaptive engine picks them from the
    # batch sizes its state has seen
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # CUDA-graph verification buckets by draft length k (query length k + 1), crossed with the batch-size buckets
    # (engine/cuda_graph.verify_buckets; None: powers of two up to num_speculative_tokens; (): verification eager);
    # the adaptive engine picks them from the draft lengths its state has seen
    cuda_graph_draft_lengths: tuple[int, ...] | None = None
    # multimodal models: vision-encoder output rows kept per replica for reuse by content hash (a step's own images
    # may exceed it), and the most images / videos one prompt may carry (vLLM's limit_mm_per_prompt)
    encoder_cache_tokens: int = 16384
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMIT_MM_PER_PROMPT))
    # KV tiers under the prefix cache (engine/kv_tiers.py): bytes of host memory per rank for blocks the device pool
    # evicts (0: off), and an optional folder where the host tier's victims go (at most kv_offload_dir_size bytes
    # per rank), reused after a restart
    kv_offload_size: int = 0
    kv_offload_dir: str | None = None
    kv_offload_dir_size: int = 16 << 30
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_offload_size < 0 or self.kv_offload_dir_size < 1:
            raise ValueError(f"kv_offload_size must be >= 0 and kv_offload_dir_size >= 1 byte, got "
                             f"{self.kv_offload_size} and {self.kv_offload_dir_size}")
        if self.kv_offload_size and not self.enable_prefix_caching:
            raise ValueError("kv_offload_size: the KV tiers keep prefix-cache blocks; enable prefix caching")
        if self.kv_offload_dir and Path(self.kv_offload_dir).exists() and not Path(self.kv_offload_dir).is_dir():
            raise ValueError(f"kv_offload_dir: {self.kv_offload_dir} exists and is not a folder")
        if self.kv_offload_dir and not self.kv_offload_size:
            raise ValueError("kv_offload_dir needs kv_offload_size > 0: blocks reach the disk through the host tier")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be >= 1, got {self.kv_cache_blocks}")
        for name in ("cuda_graph_batch_sizes", "cuda_graph_draft_lengths"):
            sizes = getattr(self, name)
            if sizes is not None and (any(not isinstance(n, int) or n < 1 for n in sizes) or list(sizes) != sorted(set(sizes))):
                raise ValueError(f"{name} must be increasing positive integers, got {sizes!r}")
        if self.kernel_backend not in ("torch", "triton"):
            raise ValueError(f"kernel_backend must be 'torch' or 'triton', got {self.kernel_backend!r}")
        self.kv_cache_dtype = parse_kv_cache_dtype(self.kv_cache_dtype)
        if self.compile_decode and (self.device.type != "cpu" or self.kernel_backend != "torch"):
            raise ValueError("compile_decode is for the CPU path with kernel_backend='torch' (on CUDA, decode steps "
                             f"replay CUDA graphs); got device {self.device}, kernel_backend {self.kernel_backend!r}")
        if self.compile_decode and self.enforce_eager:
            raise ValueError("compile_decode and enforce_eager contradict each other: enforce_eager runs every step eagerly")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        for name in ("target_itl_ms", "target_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a number of milliseconds > 0, got {value!r}")
        if (self.target_itl_ms is not None or self.target_ttft_ms is not None) and not self.adaptive:
            raise ValueError("target_itl_ms and target_ttft_ms need the adaptive engine (adaptive=True)")
        self.parallel.check(self.model, self.device)
        if self.parallel.world_size > 1 and self.compile_decode:
            raise ValueError("compile_decode runs one process: it cannot be combined with tensor_parallel_size or "
                             "data_parallel_size > 1")
