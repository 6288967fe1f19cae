"""One rank's share of the model: its weights, its KV cache, and the forward passes the driver asks for.

The driver (`ModelRunner`: scheduling results in, sampled tokens out) calls a worker with plain data: a `StepInput`
for the step's forward pass, a `DraftObservation` for the draft models' pass over what the step kept, the items to
draft for. In one process it calls the worker directly. With several ranks (engine/distributed.py) every rank's
worker makes the same call in lockstep, so the collectives inside the model meet; only rank 0's results are used.
Nothing here decides a token: the tokens the draft models chain are argmaxes of logits every rank gathers whole, so
all ranks of a replica draft alike.

Every call carries one entry per data-parallel replica (one, without data parallelism); a rank reads its replica's.
Replicas run their forward passes together, an idle one on a placeholder token, because their MoE layers exchange
tokens; the replicas' logits and drafts are gathered for rank 0.

A model with a vision tower (Kimi K2.5, GLM-5.3-Flash) has it on every rank, whole: a step's new images are encoded
before the forward pass and their output rows replace the placeholder tokens' embeddings (the driver says which rows;
outputs stay cached by content hash until it says to drop them).

On CUDA with the Triton kernels, decode and verification steps replay CUDA graphs captured at start (`cuda_graph.py`); with
`compile_decode`, CPU decode steps run `torch.compile` graphs (`compiled_decode.py`); everything else runs eagerly. A
hybrid model's steps take those paths too (a verification step with a prefill chunk beside it runs eagerly).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.cache_groups import (CacheGroup, cache_bytes, cache_dtypes, num_pools, pool_block_bytes, shared_cache_layers,
                                           single_group, state_bytes)
from reasoning_engine.config import EngineConfig
from reasoning_engine.engine.compiled_decode import CompiledDecode
from reasoning_engine.engine.cuda_graph import CudaGraphRunner, cuda_graphs_enabled
from reasoning_engine.engine.encoder_cache import MediaSlice
from reasoning_engine.engine.kv_tiers import BlockStore, TierOp, model_identity, replica_folder, tiers_supported
from reasoning_engine.kernels import kernel_module
from reasoning_engine.layers.linear_attention import is_decode_state_step, prepare_state
from reasoning_engine.models.registry import build_model, build_vision_encoder
from reasoning_engine.multimodal.inputs import MediaItem
from reasoning_engine.models.weights import BYTES_READ
from reasoning_engine.parallel import Parallel
from reasoning_engine.speculative.decoder import DraftModel, ProposeItem, SpeculativeConfig, load_draft_models
from reasoning_engine.speculative.draft import Draft

logger = logging.getLogger(__name__)


@dataclass
class StepInput:
    """One replica's step, its tokens flattened, as the driver sends it: what `ModelWorker.make_batch` turns into a
    ForwardBatch, and the rows whose logits the driver wants."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]
    tree_parts: list[torch.Tensor] | None = None  # per sequence, which of its query tokens each may see (drafts)
    # hybrid models: per KV cache group past the first, its slots and block tables (slots and block_tables are group
    # 0's); empty: every group uses group 0's, a group in another block pool that pool's padding block (placeholder
    # steps in the padding block)
    group_slots: list[list[int]] = field(default_factory=list)
    group_block_tables: list[list[list[int]]] = field(default_factory=list)
    # multimodal prompts (engine/encoder_cache.py): items to encode first, encoder outputs to drop, and which output
    # rows replace which tokens' embeddings
    media_encode: list[MediaItem] = field(default_factory=list)
    media_drop: list[str] = field(default_factory=list)
    media_slices: list[MediaSlice] = field(default_factory=list)
    # hybrid models (engine/state_cache.py): per sequence its state slot, whether it starts from zeros, snapshots to
    # save and its first scratch slot (-1: no draft); then copies made before the forward pass, in this order: the
    # accepted draft nodes' states of the last step into live and snapshot slots, then prefix hits' snapshots into
    # live slots (all reads of a phase happen before its writes)
    state_slots: list[int] | None = None
    state_fresh: list[bool] | None = None
    state_saves: list[list[tuple[int, int]]] | None = None
    state_scratch: list[int] | None = None
    state_commits: list[tuple[int, int]] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)

    @staticmethod
    def idle(padding_block: int, block_size: int) -> StepInput:
        """A data-parallel replica with nothing scheduled still runs a step, so that its MoE layers meet the other
        replicas': one token in the padding block, which no request owns, and no logits."""
        return StepInput([0], [0], [padding_block * block_size], [1], [1], [[padding_block]], [])


@dataclass
class DraftFinal:
    """A request whose step produced tokens: its row in the draft pass and where its next draft starts."""

    seq_id: str
    row: int
    position: int  # the new root's position: every position below it is now in the caches
    block_table: list[int]  # the request's blocks holding those positions


@dataclass
class DraftObservation:
    """What the draft models' pass after a replica's step reads: the rows of the step's hidden states whose
    positions were kept, each paired with the token after it, and the requests that got new tokens."""

    rows: list[int]
    next_ids: list[int]
    starts: list[int]  # per scheduled request, its first position this step
    query_lens: list[int]  # per scheduled request, how many of its positions were kept
    block_tables: list[list[int]]
    finals: list[DraftFinal]

    @staticmethod
    def idle(padding_block: int) -> DraftObservation:
        """The draft pass of a replica whose step was `StepInput.idle`."""
        return DraftObservation([0], [0], [0], [1], [[padding_block]], [])


def _padded_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """[B, max blocks] int32, rows padded with block 0 (never read: beyond each sequence's length)."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def use_fp8_cache(layers: Sequence[torch.nn.Module], device: torch.device) -> None:
    """Switch these attention layers' caches to FP8 rows (kv_cache_dtype="fp8"); a layer whose cache is not plain
    K/V or latent rows (DeepSeek-V4's compressed rows) is refused, naming the setting."""
    for layer in layers:
        if not hasattr(layer, "use_fp8_cache"):
            raise ValueError(f"kv_cache_dtype='fp8' is not supported by {type(layer).__name__} layers (their caches "
                             "are not plain K/V or MLA latent rows); use kv_cache_dtype='auto'")
        layer.use_fp8_cache(device)


def check_fp8_kernels(config: EngineConfig) -> None:
    """The Triton kernels convert e4m3 to bf16 in hardware, which GPUs of compute capability 8.9 on (Ada, Hopper,
    Blackwell) have: an older GPU is refused with an error naming the settings that work there."""
    if config.kernel_backend == "triton" and config.device.type == "cuda":
        capability = torch.cuda.get_device_capability(config.device)
        if tuple(capability) < (8, 9):
            raise ValueError(f"kv_cache_dtype='fp8' with kernel_backend='triton' needs a GPU of compute capability 8.9 "
                             f"or newer, this one has {capability[0]}.{capability[1]}; use kv_cache_dtype='auto' or "
                             "kernel_backend='torch'")


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_step_tokens: int) -> int:
    """The most blocks sliding groups of `window` in their own pool hold at once: every sequence its window's
    blocks, the one the window starts in and the one its step's last token straddles into, plus the blocks of the
    step's tokens (at most `max_step_tokens` over all sequences)."""
    return max_num_seqs * (-(-window // block_size) + 2) + -(-max_step_tokens // block_size)


class ModelWorker:
    """A rank's model shard, draft models and KV caches. `init_cache` must follow construction (with the block
    count every rank agreed on: the smallest any can hold)."""

    def __init__(self, config: EngineConfig, parallel: Parallel = Parallel(), local_ranks: int = 1) -> None:
        """`local_ranks`: the ranks sharing this machine's memory (CPU), which split its share of the free memory."""
        self.config = config
        self.parallel = parallel
        self.device = config.device
        self.block_size = config.block_size
        self.local_ranks = local_ranks
        self.attention_ops = kernel_module("attention", config.kernel_backend)
        read_before = BYTES_READ.bytes
        self.model = build_model(config.model, config.dtype, config.device, config.max_model_len, config.kernel_backend,
                                 load_format=config.load_format,
                                 keep_plain_weights=config.compile_decode,  # the compiled graphs multiply them
                                 parallel=parallel)
        spec = SpeculativeConfig.from_dict(config.speculative_config) if config.speculative_config else None
        self.draft_models = load_draft_models(spec, config, self.model) if spec is not None else {}
        self.max_draft_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.vision = build_vision_encoder(config.model.path, config.dtype, config.device, config.kernel_backend,
                                           config.load_format)
        self.encoder_outputs: dict[str, torch.Tensor] = {}  # content hash -> [rows, hidden]
        self.encoder_seconds = 0.0
        self.checkpoint_bytes_read = BYTES_READ.bytes - read_before
        self.aux_layers = sorted({i for m in self.draft_models.values() for i in m.aux_layers})
        if config.kv_cache_dtype == "fp8":
            check_fp8_kernels(config)
            for model in (self.model, *self.draft_models.values()):
                use_fp8_cache(model.attention_layers(), config.device)
        self.cache_groups = self.model.cache_groups()
        self.pool_blocks: list[int] = []  # blocks per pool (cache_groups.py); each pool's padding block is its count
        self.num_blocks = 0  # pool 0's (group 0's, which draft models mirror)
        self.padding_block = 0
        self.kv_caches: list[list[torch.Tensor]] = []  # per pool, per shared position, its tensors (flattened)
        self.pool_caches: list[list[list[torch.Tensor]]] = []
        self.state_caches: list[list[torch.Tensor]] = []
        self.linear_layers = self.model.linear_layers()
        self.num_state_slots, self.state_scratch_per_seq = self.state_slot_counts()
        self.drafters: dict[str, DraftRunner] = {}
        self.decode_graphs: CudaGraphRunner | None = None
        self.compiled_decode: CompiledDecode | None = None
        self._last: tuple[ForwardBatch, torch.Tensor, dict[int, torch.Tensor]] | None = None  # for the draft pass
        self.failure: str | None = None  # one process: a failed step leaves nothing out of step
        self.tier_store: BlockStore | None = None  # this rank's host / disk tier entries (kv_offload_size)

    @property
    def local(self) -> ModelWorker:
        """The worker in this process (an executor's rank 0; here, itself)."""
        return self

    def memory_report(self) -> dict[str, int]:
        """This rank's resident bytes: weights (the target's and its draft models', parameters and buffers), KV
        caches, and what loading read from the checkpoint files."""
        modules = [self.model, *self.draft_models.values()]
        tensors = {id(t): t for m in modules for t in (*m.parameters(), *m.buffers())}  # tied weights once
        return {"weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "kv_cache_bytes": sum(t.numel() * t.element_size() for caches in self.kv_caches for t in caches),
                "checkpoint_bytes_read": self.checkpoint_bytes_read}

    def gather(self, method: str, *args: object) -> list[object]:
        """Every rank's result of `method`: here, the only one's."""
        return [getattr(self, method)(*args)]

    # ---- linear-attention state ----
    SNAPSHOT_SHARE = 0.1  # of the cache budget that prefix-cache state snapshots may take

    def state_slot_counts(self) -> tuple[int, int]:
        """(live and snapshot slots, scratch slots per sequence) of a hybrid model's state cache; (0, 0) otherwise.
        A live slot for every sequence that may run; snapshots within SNAPSHOT_SHARE of the cache budget (the
        configured KV memory or blocks, else what max_num_seqs full-length sequences would need: a figure every rank
        computes alike), at least two and at most 32 per sequence; for drafts, one scratch slot per verified token
        (the root and each node) of every sequence."""
        if not self.linear_layers:
            return 0, 0
        c = self.config
        scratch = self.max_draft_tokens + 1 if self.max_draft_tokens else 0
        snapshots = 0
        if c.enable_prefix_caching:
            per_token = cache_bytes(self.model.attention_layers(), c.dtype)
            if c.kv_cache_memory is not None:
                budget = c.kv_cache_memory
            elif c.kv_cache_blocks is not None:
                budget = c.kv_cache_blocks * c.block_size * per_token
            else:
                budget = c.max_num_seqs * c.max_model_len * per_token
            fit = int(self.SNAPSHOT_SHARE * budget) // max(self._state_bytes(1), 1)
            snapshots = min(max(fit, 2 * c.max_num_seqs), 32 * c.max_num_seqs)
        return c.max_num_seqs + snapshots, scratch

    @property
    def state_padding_slot(self) -> int:
        return self.num_state_slots

    @property
    def state_scratch_start(self) -> int:
        return self.num_state_slots + 1

    def state_bytes(self) -> int:
        """Bytes of the whole state cache (live, snapshot, padding and scratch slots of every linear layer)."""
        return self._state_bytes(self.num_state_slots + 1 + self.config.max_num_seqs * self.state_scratch_per_seq)

    def _state_bytes(self, slots: int) -> int:
        return state_bytes(self.linear_layers, self.config.dtype, slots)

    def allocate_states(self) -> None:
        slots = self.num_state_slots + 1 + self.config.max_num_seqs * self.state_scratch_per_seq
        self.state_caches = []
        for layer in self.linear_layers:
            tensors = [torch.zeros(shape, dtype=dtype or self.config.dtype, device=self.device)
                       for shape, dtype in layer.state_shapes(slots)]
            layer.bind_state(tensors)
            self.state_caches.append(tensors)
        logger.info("linear-attention state: %d slots (%d live and snapshot) for %d layers (%.1f MiB)", slots,
                    self.num_state_slots, len(self.linear_layers), self.state_bytes() / 2**20)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole slots (src, dst) in every linear layer; every source is read before any destination is written."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        for tensors in self.state_caches:
            for tensor in tensors:
                tensor[dst] = tensor[src]

    # ---- KV cache ----
    # a pool of sliding groups alone keeps this many times what its running windows need: the rest holds the
    # windows of finished requests, which prefix hits at their ends need
    WINDOW_POOL_CACHE_FACTOR = 2

    def pool_bytes_per_block(self) -> list[int]:
        """Bytes one block of each pool costs on this rank: its cache tensors' rows, and in pool 0 the draft
        models' caches, which mirror its block ids."""
        c = self.config
        per_block = pool_block_bytes(self.model.attention_layers(), self.cache_groups, c.dtype, c.block_size)
        per_block[0] += c.block_size * sum(cache_bytes(m.attention_layers(), c.dtype)
                                           for m in self.draft_models.values())
        return per_block

    def available_blocks(self) -> list[int]:
        """How many KV blocks of each pool this rank can hold. Pool 0: the configured count, or what fits in its
        share of free memory beside the other pools. Another pool (sliding groups alone: DeepSeek-V4's windows):
        WINDOW_POOL_CACHE_FACTOR times what its windows need (`window_pool_blocks`), at most pool 0's count and
        together at most half the memory budget."""
        c = self.config
        per_block = self.pool_bytes_per_block()
        context_blocks = -(-c.max_model_len // c.block_size)
        wanted = c.max_num_seqs * context_blocks + 1  # enough for every sequence at full length
        windows = self._pool_windows()
        side = [min(wanted, self.WINDOW_POOL_CACHE_FACTOR * window_pool_blocks(
            w, c.block_size, c.max_num_seqs, c.max_num_batched_tokens)) for w in windows]
        if c.kv_cache_blocks is not None:
            blocks = c.kv_cache_blocks
            side = [min(n, blocks) for n in side]
        else:
            if c.kv_cache_memory is not None:  # one budget: a hybrid model's state slots come out of it first
                budget = max(0, c.kv_cache_memory - self.state_bytes())
            else:
                share = 0.85 if self.device.type == "cuda" else 0.3 / self.local_ranks
                budget = max(0, int(available_memory(self.device) * share) - self.state_bytes())
            side_bytes = sum(n * b for n, b in zip(side, per_block[1:]))
            if side_bytes > budget // 2:  # scaled down alike to half the budget
                side = [n * (budget // 2) // side_bytes for n in side]
            blocks = (budget - sum(n * b for n, b in zip(side, per_block[1:]))) // per_block[0]
            if c.kv_cache_memory is None:
                blocks = min(wanted, blocks)
        if blocks < context_blocks:
            raise ValueError(
                f"kv_cache_blocks={blocks} holds {blocks * c.block_size} tokens, fewer than max_model_len={c.max_model_len}; "
                f"give more KV cache memory or a smaller max_model_len")
        for n, window in zip(side, windows):
            least = min(context_blocks, window_pool_blocks(window, c.block_size, 1, c.max_num_batched_tokens))
            if n < least:
                raise ValueError(
                    f"the KV cache's sliding-window pool holds {n} blocks, fewer than one sequence's window and step "
                    f"need ({least}); give more KV cache memory or a smaller max_num_batched_tokens")
        return [blocks, *side]

    def _pool_windows(self) -> list[int]:
        """The widest window of each pool past pool 0 (those pools hold sliding groups only)."""
        windows = []
        for pool in range(1, num_pools(self.cache_groups)):
            groups = [g for g in self.cache_groups if g.pool == pool]
            if any(g.kind != "sliding" for g in groups):
                raise ValueError(f"cache pool {pool}: only pool 0 may hold groups that keep every block")
            windows.append(max(g.window for g in groups))
        return windows

    def init_cache(self, pool_blocks: int | Sequence[int]) -> None:
        """Allocate the caches (`pool_blocks`: the blocks of each pool, an int for one), then capture or compile
        the decode graphs (every rank at once: they run the model)."""
        self.pool_blocks = [pool_blocks] if isinstance(pool_blocks, int) else list(pool_blocks)
        self.num_blocks = self.pool_blocks[0]
        # two blocks past those the BlockManager hands out in each pool: padding rows of CUDA-graph decode batches
        # write to the first, and so do the steps that compile the decode graphs (compile_decode); the second is the
        # null block of sliding groups' tables (kv_cache.py), never written
        self.padding_block = self.num_blocks
        self.pool_caches = self.allocate_caches(self.model.attention_layers(), [n + 2 for n in self.pool_blocks],
                                                self.cache_groups)
        self.kv_caches = [caches for pool in self.pool_caches for caches in pool]
        if self.linear_layers:
            self.allocate_states()
        self.drafters = {method: DraftRunner(method, m, self, self.max_draft_tokens)
                         for method, m in self.draft_models.items()}
        if self.config.kv_offload_size and tiers_supported(self.cache_groups, bool(self.linear_layers)):
            self.tier_store = self._tier_store()
        # EAGLE-3 reads intermediate layers, which a captured forward does not return: its steps stay eager. A
        # hybrid model's decode and verification steps address their linear-attention state through tensors alone
        # (slots, zero-start flags, scratch slots; padding rows in the padding state slot), so they are captured and
        # compiled like any other model's. DeepSeek-V4 (`eager_only`) builds its step addressing per step on the host
        eager = bool(self.aux_layers or getattr(self.model, "eager_only", False))
        if cuda_graphs_enabled(self.config) and not eager:
            self.decode_graphs = CudaGraphRunner(
                self.model, self.config, self.padding_block, capture=True, max_draft_tokens=self.max_draft_tokens,
                state_padding_slot=self.state_padding_slot if self.linear_layers else None)
        if self.config.compile_decode and not eager:
            self.compiled_decode = CompiledDecode(self.model)
            self._compile_decode_graphs()

    def allocate_caches(self, layers: Sequence[torch.nn.Module], pool_blocks: Sequence[int],
                        groups: Sequence[CacheGroup] | None = None) -> list[list[list[torch.Tensor]]]:
        """Allocate and bind the paged caches of these attention layers (the target's, or a draft model's, which has
        one group): per pool (`pool_blocks[p]` blocks), one set of tensors per position in a group, shared by that
        position's layer of every group in the pool. Returns the sets of each pool."""
        groups = list(groups or single_group(len(layers)))
        for g, group in enumerate(groups):
            for index in group.layers:
                layers[index].cache_group = g
        per_pool: list[list[list[torch.Tensor]]] = []
        for pool, num_blocks in enumerate(pool_blocks):
            per_pool.append([])
            for members in shared_cache_layers(layers, groups, pool):
                shapes = [m.cache_shape(num_blocks, self.block_size) for m in members]
                if any(shape != shapes[0] for shape in shapes):
                    raise ValueError(f"cache pool {pool}: layers sharing a cache position need equal cache shapes, "
                                     f"got {shapes}; give groups of unequal footprints their own pools")
                caches = [torch.zeros(shape, dtype=kind, device=self.device)
                          for shape, kind in zip(shapes[0], cache_dtypes(members[0], self.config.dtype))]
                for attn in members:
                    attn.bind_cache(caches)
                per_pool[-1].append(caches)
        total = sum(t.numel() * t.element_size() for pool in per_pool for caches in pool for t in caches)
        logger.info("KV cache: %s blocks of %d tokens for %d layers in %d cache groups (%.1f MiB)",
                    " + ".join(map(str, pool_blocks)), self.block_size, len(layers), len(groups), total / 2**20)
        return per_pool

    @torch.inference_mode()
    def _compile_decode_graphs(self) -> None:
        """Compile the decode graphs at start rather than during the first requests: steps of one, three and
        MAX_SEQS + 1 sequences whose context lies in the padding block, which no request owns (only those that
        max_num_seqs lets a step use: one sequence; 2 to MAX_SEQS; more). The sizes avoid
        coincidences (context 7, block tables 2 wider than needed): torch gives equal sizes one symbol, so a graph
        traced with, say, batch size == table width would demand that of every later step (and one traced with two
        sequences came out specialised to two on the test models, whose heads come in pairs). A hybrid model's rows
        keep their linear-attention state in the padding state slot."""
        start = time.perf_counter()
        pad, size, length = self.padding_block, self.block_size, 7
        table = [pad] * (-(-length // size) + 2)
        most = self.config.max_num_seqs
        for n in (1, 3, CompiledDecode.MAX_SEQS + 1)[: 1 + (most > 1) + (most > CompiledDecode.MAX_SEQS)]:
            batch = self.make_batch([0] * n, [length - 1] * n, [pad * size + (length - 1) % size] * n, [1] * n,
                                    [length] * n, [table] * n, list(range(n)))
            if self.linear_layers:
                self.add_state(batch, None)
            self.compiled_decode.warm_up(batch)
        logger.info("compile_decode: decode graphs compiled in %.1f s (guards: %d kept, %d on the model dropped)",
                    time.perf_counter() - start, self.compiled_decode.guards_kept,
                    self.compiled_decode.guards_dropped)

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes replayed from captured CUDA graphs; [] when every step runs eagerly (CPU, torch
        kernels, enforce_eager, EAGLE-3). A step of n sequences replays the smallest of these >= n."""
        return self.decode_graphs.captured_batch_sizes if self.decode_graphs is not None else []

    @property
    def cuda_graph_verify_buckets(self) -> list[tuple[int, int]]:
        """(batch size, draft length) of the verification steps replayed from captured CUDA graphs: a step of n
        sequences verifying up to k draft nodes each replays the bucket of fewest padded tokens that holds it."""
        return self.decode_graphs.captured_verify_buckets if self.decode_graphs is not None else []

    def move_kv(self, replica: int, block_tables: list[list[int]], moves: list[tuple[int, int]]) -> None:
        """Copy cache entries between token positions of one sequence of `replica` (accepted draft-tree nodes into
        place), in each cache group's blocks (`block_tables`, one per group) and tensors. Draft models' caches need no
        move: their pass after the step writes the accepted positions in place."""
        if replica != self.replica:
            return
        bs = self.block_size
        for group, block_table in zip(self.cache_groups, block_tables):
            src = torch.tensor([block_table[a // bs] * bs + a % bs for a, _ in moves], device=self.device)
            dst = torch.tensor([block_table[b // bs] * bs + b % bs for _, b in moves], device=self.device)
            for caches in self.pool_caches[group.pool][: len(group.layers)]:
                for cache in caches:
                    flat = cache.view(-1, *cache.shape[2:])
                    flat[dst] = flat[src]

    def _tier_store(self) -> BlockStore:
        """The host / disk tier store over every cache tensor a block id addresses: the target's pool-0 caches and
        the draft models' (which mirror group 0's blocks)."""
        tensors = [t for caches in self.pool_caches[0] for t in caches]
        tensors += [t for drafter in self.drafters.values() for caches in drafter.kv_caches for t in caches]
        path = self.config.model.path
        weights = sorted((f.name, f.stat().st_size) for f in path.glob("*.safetensors"))
        config_file = path / "config.json"
        fields = {"dtype": self.config.dtype, "load_format": self.config.load_format, "block_size": self.block_size,
                  "tp": self.parallel.tp.size, "speculative": self.config.speculative_config,
                  "seed": self.config.seed if self.config.load_format == "dummy" else None}
        identity = model_identity(config_file.read_bytes() if config_file.is_file() else b"", weights, fields,
                                  [(tuple(t.shape[1:]), t.dtype) for t in tensors])
        folder = (replica_folder(self.config.kv_offload_dir, identity, self.replica)
                  if self.config.kv_offload_dir else None)
        return BlockStore(tensors, identity, self.parallel.tp.rank, folder, pin=self.device.type == "cuda")

    def kv_tier_ops(self, replica: int, ops: list[TierOp]) -> None:
        """Run the driver's tier ops (saves, loads, drops, spills, unlinks; in order) on this rank's shard."""
        if replica == self.replica:
            self.tier_store.run(ops)

    def kv_tier_fetch(self, replica: int, ops: list[TierOp], keys: list[bytes], blocks: list[int]) -> list[bool] | None:
        """Run the pending tier ops, then read these keys' disk files into these cache blocks: per key whether this
        rank's file was sound (None from another replica's ranks)."""
        if replica != self.replica:
            return None
        return self.tier_store.fetch(ops, keys, blocks)

    # ---- one step ----
    def make_batch(self, input_ids: list[int], positions: list[int], slots: list[int], query_lens: list[int],
                   seq_lens: list[int], block_tables: list[list[int]], logits_rows: list[int] | None = None,
                   tree_parts: list[torch.Tensor] | None = None, with_attention: bool = True,
                   group_slots: list[list[int]] | None = None,
                   group_block_tables: list[list[list[int]]] | None = None) -> ForwardBatch:
        """A ForwardBatch over the paged caches, its attention metadata built once for all layers (unless
        `with_attention` is False: a step that replays a CUDA graph builds its own inside the graph). `tree_parts`: per
        sequence, which of its query tokens each may see (draft trees); None for causal order. `group_slots` and
        `group_block_tables`: those of the model's other cache groups (absent: group 0's, or in another block pool
        its padding block: only steps in pool 0's padding block come without them)."""
        dev = self.device
        tables = _padded_tables(block_tables)
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        tree_mask = None
        if tree_parts is not None:
            tree_mask = torch.zeros(len(input_ids), max(query_lens), dtype=torch.bool)
            for part, row0 in zip(tree_parts, query_start):
                tree_mask[row0 : row0 + part.shape[0], : part.shape[1]] = part
            tree_mask = tree_mask.to(dev)
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            logits_indices=torch.tensor(logits_rows or [], dtype=torch.long, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            tree_mask=tree_mask,
        )
        for g in range(1, len(self.cache_groups)):
            if group_slots is not None and len(group_slots) >= g:
                slot_mapping = torch.tensor(group_slots[g - 1], dtype=torch.long, device=dev)
                group_tables = _padded_tables(group_block_tables[g - 1]).to(dev)
            elif self.cache_groups[g].pool == self.cache_groups[0].pool:
                slot_mapping, group_tables = batch.slot_mapping, batch.block_tables
            else:  # a padding step (its slots are in pool 0's padding block): this pool's padding block instead
                pad = self.pool_blocks[self.cache_groups[g].pool]
                slot_mapping = pad * self.block_size + batch.slot_mapping % self.block_size
                group_tables = torch.full_like(batch.block_tables, pad)
            batch.groups.append(dataclasses.replace(batch, groups=[], slot_mapping=slot_mapping,
                                                    block_tables=group_tables))
        if with_attention:
            self.prepare_attention(batch)
        return batch

    def add_state(self, batch: ForwardBatch, step: StepInput | None) -> list[tuple[int, int]]:
        """A hybrid model's state addressing for the batch (a step without it, such as an idle replica's, runs its
        rows in the padding slot from zeros); the metadata of a step other than a decode waits for its eager run.
        Returns the (live, snapshot) slot copies to make after the forward pass: the snapshot of a sequence that runs
        one token is its state after the step, so it is copied out of the live slot then, and a decode step itself (a
        CUDA graph, a compiled graph) writes no snapshot."""
        n = len(batch.query_lens_cpu)
        if step is None or step.state_slots is None:
            slots, fresh, saves, scratch = [self.state_padding_slot] * n, [True] * n, None, None
        else:
            slots, fresh, saves, scratch = step.state_slots, step.state_fresh, step.state_saves, step.state_scratch
        after: list[tuple[int, int]] = []
        if saves:
            lens = batch.query_lens_cpu
            after = [(slot, snapshot) for slot, per_seq, length in zip(slots, saves, lens) if length == 1
                     for _, snapshot in per_seq]
            saves = [[] if length == 1 else per_seq for per_seq, length in zip(saves, lens)]
        batch.state_slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        batch.state_fresh = torch.tensor(fresh, dtype=torch.bool, device=self.device)
        batch.state_saves, batch.state_scratch = saves, scratch
        batch.state_metadata = prepare_state(batch) if is_decode_state_step(batch) else None
        return after

    def prepare_attention(self, batch: ForwardBatch) -> None:
        """The attention metadata of the batch and of its other cache groups' views."""
        for view in batch.with_groups():
            view.attn_metadata = self.attention_ops.prepare_attention(view, self.block_size)

    @property
    def replica(self) -> int:
        return self.parallel.dp.rank

    @torch.inference_mode()
    def execute_model(self, steps: list[StepInput]) -> list[torch.Tensor]:
        """The step's forward pass over this replica's `StepInput`; returns the float32 logits of each replica's
        `logits_rows` (on rank 0; another rank may return only its own). With draft models, the batch and hidden
        states stay for the draft pass (`observe_drafts`)."""
        step = steps[self.replica]
        batch = self.make_batch(step.input_ids, step.positions, step.slots, step.query_lens, step.seq_lens,
                                step.block_tables, step.logits_rows, step.tree_parts, with_attention=False,
                                group_slots=step.group_slots, group_block_tables=step.group_block_tables)
        if len(steps) > 1:
            batch.dp_num_tokens = [len(s.input_ids) for s in steps]
        saves_after: list[tuple[int, int]] = []
        if self.linear_layers:
            self.copy_states(step.state_commits)
            self.copy_states(step.state_restores)
            saves_after = self.add_state(batch, step)
        self._media_embeddings(step, batch)
        aux_hidden = dict.fromkeys(self.aux_layers) if self.aux_layers else None
        logits: torch.Tensor | None = None
        if (self.decode_graphs is not None and aux_hidden is None and batch.media_rows is None
                and self.decode_graphs.can_run(batch)):
            hidden = self.decode_graphs.run(batch)
        else:
            self.prepare_attention(batch)
            if self.compiled_decode is not None and batch.media_rows is None and self.compiled_decode.can_run(batch):  # never built with aux layers
                hidden, logits = self.compiled_decode.run(batch)  # a decode step's logits rows are all of its rows
            else:
                if self.linear_layers and batch.state_metadata is None:
                    batch.state_metadata = prepare_state(batch)
                hidden = self.model(batch, aux_hidden)
        self.copy_states(saves_after)
        if logits is None:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        if self.drafters:
            self._last = (batch, hidden, aux_hidden or {})
        if len(steps) == 1 or self.parallel.tp.rank != 0:
            return [logits]
        counts = [len(s.logits_rows) for s in steps]
        return list(self.parallel.dp.all_gather_rows(logits, counts).split(counts))

    def _media_embeddings(self, step: StepInput, batch: ForwardBatch) -> None:
        """Follow the driver's encoder-cache plan, then point the batch at the rows that replace placeholders."""
        for key in step.media_drop:
            self.encoder_outputs.pop(key, None)
        if step.media_encode:
            if self.vision is None:
                raise ValueError(f"{self.config.model.model_type}: this model has no vision tower")
            began = time.perf_counter()
            pixels = torch.cat([item.pixel_values for item in step.media_encode]).to(self.device, self.config.dtype)
            outputs = self.vision(pixels, [item.grid_thw for item in step.media_encode])
            for item, output in zip(step.media_encode, outputs):
                self.encoder_outputs[item.content_hash] = output
            self.encoder_seconds += time.perf_counter() - began
        if step.media_slices:
            rows = [r for s in step.media_slices for r in range(s.row, s.row + s.stop - s.start)]
            batch.media_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
            batch.media_embeds = torch.cat([self.encoder_outputs[s.content_hash][s.start:s.stop]
                                            for s in step.media_slices])

    @torch.inference_mode()
    def observe_drafts(self, observations: list[DraftObservation]) -> None:
        """The draft models' pass over every position the last step kept (see `DraftObservation`)."""
        batch, hidden, aux_hidden = self._last
        self._last = None
        obs, bs = observations[self.replica], self.block_size
        if batch.tree_mask is None:  # no draft verified: the same positions as the target's batch
            draft_batch = dataclasses.replace(batch, input_ids=torch.tensor(obs.next_ids, dtype=torch.long, device=self.device))
        else:
            index = torch.tensor(obs.rows, device=hidden.device)
            hidden, aux_hidden = hidden[index], {i: t[index] for i, t in aux_hidden.items()}
            spans = [range(start, start + n) for start, n in zip(obs.starts, obs.query_lens)]
            draft_batch = self.make_batch(
                obs.next_ids, [p for span in spans for p in span],
                [table[p // bs] * bs + p % bs for table, span in zip(obs.block_tables, spans) for p in span],
                obs.query_lens, [span.stop for span in spans], obs.block_tables)
        if len(observations) > 1:
            draft_batch.dp_num_tokens = [len(o.next_ids) for o in observations]
        for drafter in self.drafters.values():
            drafter.observe(draft_batch, hidden, aux_hidden, obs.finals)

    def propose_drafts(self, method: str, items: list[list[ProposeItem]]) -> list[list[Draft]]:
        """The draft model `method`'s chains for each replica's `items` (rank 0 gets every replica's)."""
        drafts = self.drafters[method].propose_batch(items[self.replica])
        if len(items) == 1 or self.parallel.tp.rank != 0:
            return [drafts]
        gathered: list[list[Draft] | None] = [None] * len(items)
        dist.all_gather_object(gathered, drafts, group=self.parallel.dp.handle)
        return gathered

    def release_draft_state(self, method: str, seq_id: str) -> None:
        """A request finished: its draft state goes."""
        self.drafters[method].states.pop(seq_id, None)

    def on_failure(self, callback: object) -> None:
        """One process: no other rank can fail (executors with several ranks call back when one does)."""

    def shutdown(self) -> None:
        """Nothing to stop in one process; executors with several ranks stop them here."""


@dataclass
class DraftState:
    """What a request's next draft starts from, left by the draft model's pass over the request's last step."""

    position: int
    block_table: list[int]
    features: torch.Tensor  # [hidden] carried from position - 1
    token: int  # the first draft token, predicted at position - 1
    prob: float  # the draft model's probability of it


class DraftRunner:
    """Runs a `DraftModel` (MTP layer, EAGLE-3 head) beside the target and drafts its greedy chains.

    Its KV cache mirrors the target's block ids and slots, so a position's draft entry lives, is shared through the
    prefix cache and is recycled with the target's. After each target step `observe` runs the draft model over every
    position the step kept, which fills that cache and leaves each request that got new tokens a `DraftState`: the
    first draft token and the carried features. `propose_batch` continues the chains of all asked requests together,
    one draft-model forward per draft position; those positions lie beyond what the target has computed, so they write
    to the request's own partly filled last block or to scratch blocks past the shared ones (`scratch_per_seq` per
    request of the batch), and the next `observe` overwrites whatever the target keeps.

    A prefix-cache hit reuses the draft entries of the request that computed the blocks; the entry of the hit's last
    position was paired with that request's next token, which may differ. That only costs draft quality.
    """

    def __init__(self, method: str, model: DraftModel, worker: ModelWorker, max_draft_tokens: int) -> None:
        self.method = method
        self.model = model
        self.worker = worker
        bs = worker.block_size
        self.scratch_per_seq = -(-max(max_draft_tokens - 1, 0) // bs)
        self.scratch_start = worker.num_blocks + 2  # past the padding and null blocks, as in the target's cache
        num_blocks = self.scratch_start + worker.config.max_num_seqs * self.scratch_per_seq
        self.kv_caches = worker.allocate_caches(model.attention_layers(), [num_blocks])[0]
        self.states: dict[str, DraftState] = {}

    def observe(self, batch: ForwardBatch, hidden: torch.Tensor, aux_hidden: Mapping[int, torch.Tensor],
                finals: list[DraftFinal]) -> None:
        """Run the draft model over a step's kept positions (batch.input_ids: the token after each position)."""
        head_input, carried = self.model(batch, self.model.target_features(hidden, aux_hidden), batch.input_ids)
        if not finals:
            return
        rows = torch.tensor([f.row for f in finals], device=head_input.device)
        tokens, probs = self.model.greedy(head_input[rows])
        for final, token, prob, features in zip(finals, tokens.tolist(), probs.tolist(), carried[rows]):
            self.states[final.seq_id] = DraftState(final.position, final.block_table, features, token, prob)

    @torch.inference_mode()
    def propose_batch(self, items: Sequence[ProposeItem]) -> list[Draft]:
        """Greedy chains, scored by their expected accepted length under the draft's own probabilities (the sum over
        depths of the product of the probabilities so far). A request whose state is not from its last token (it
        has not finished a step since) gets no draft. The items are running requests, at most max_num_seqs."""
        drafts = [Draft.empty() for _ in items]
        live: list[tuple[int, DraftState, int]] = []
        for i, (seq_id, tokens, n) in enumerate(items):
            state = self.states.get(seq_id)
            if n > 0 and state is not None and len(tokens) == state.position + 1:
                live.append((i, state, n))
        chains = {i: ([state.token], [state.prob]) for i, state, _ in live}
        longer = [(i, state, n) for i, state, n in live if n > 1]
        chained = [(i, state, n, self._chain_table(slot, state, n)) for slot, (i, state, n) in enumerate(longer)]
        features = torch.stack([state.features for _, state, _, _ in chained]) if chained else None
        bs = self.worker.block_size
        depth = 1
        while counts := self._chain_counts(len(chained)):
            if not chained:  # another replica still drafts: a placeholder pass keeps the MoE layers in step
                self._idle_pass(counts)
                continue
            # draft token `depth` sits at position + depth; the draft model reads it at the position before
            positions = [state.position + depth - 1 for _, state, _, _ in chained]
            batch = self.worker.make_batch(
                [chains[i][0][-1] for i, _, _, _ in chained], positions,
                [table[p // bs] * bs + p % bs for p, (_, _, _, table) in zip(positions, chained)],
                [1] * len(chained), [p + 1 for p in positions], [table for _, _, _, table in chained])
            batch.dp_num_tokens = counts if len(counts) > 1 else None
            head_input, features = self.model(batch, features, batch.input_ids)
            tokens, probs = self.model.greedy(head_input)
            for (i, _, _, _), token, prob in zip(chained, tokens.tolist(), probs.tolist()):
                chains[i][0].append(token)
                chains[i][1].append(prob)
            depth += 1
            keep = [j for j, (_, _, n, _) in enumerate(chained) if n > depth]
            chained = [chained[j] for j in keep]
            features = features[keep]
        for i, _, _ in live:
            tokens, probs = chains[i]
            expected = torch.tensor(probs, dtype=torch.float64).cumprod(0).sum().item()
            drafts[i] = Draft.path(tokens, score=expected)
        return drafts

    def _chain_counts(self, chains: int) -> list[int]:
        """The rows of this chaining pass on every data-parallel replica (an idle one runs one placeholder row);
        empty once no replica has chains left. Without data parallelism: [chains], or [] when done."""
        dp = self.worker.parallel.dp
        if dp.size == 1:
            return [chains] if chains else []
        counts = dp.all_gather(torch.tensor([chains], device=self.worker.device)).flatten().tolist()
        return [max(c, 1) for c in counts] if any(counts) else []

    def _idle_pass(self, counts: list[int]) -> None:
        """One placeholder row through the draft model, written to the padding block."""
        bs, block = self.worker.block_size, self.worker.padding_block
        batch = self.worker.make_batch([0], [0], [block * bs], [1], [1], [[block]])
        batch.dp_num_tokens = counts
        # the features a chained pass carries (DeepSeek-V4's MTP: every residual stream)
        width = getattr(self.model, "feature_width", None) or self.model.layers[0].input_layernorm.weight.shape[0]
        hidden = torch.zeros(1, width, dtype=self.worker.config.dtype, device=self.worker.device)
        self.model.greedy(self.model(batch, hidden, batch.input_ids)[0])

    def _chain_table(self, index: int, state: DraftState, length: int) -> list[int]:
        """The request's blocks, then the scratch blocks of chain slot `index` for draft positions past them."""
        bs = self.worker.block_size
        needed = -(-(state.position + length - 1) // bs) - len(state.block_table)
        scratch = self.scratch_start + index * self.scratch_per_seq
        return state.block_table + list(range(scratch, scratch + max(needed, 0)))
