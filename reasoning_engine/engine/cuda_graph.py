"""CUDA graphs for decode and verification steps.

A decode step of a small batch launches a few kernels per layer, each doing little work, so on a GPU the step is
bound by the CPU launching them. A CUDA graph records the whole forward once and replays it with one launch. A graph
replays fixed kernels on fixed memory, so each batch-size bucket (1, 2, 4, ... up to max_num_seqs) gets its own graph
over static input buffers, captured at engine start. A step copies its tensors into those buffers, pads the batch to
the bucket with rows that write their K/V to a spare cache slot, replays, and keeps the first rows of the output.
A hybrid model's KV cache groups (cache_groups.py) each have their own slot and block-table buffers; its
linear-attention layers read and write each sequence's state slot through a static slot buffer and a static
zero-start flag buffer (`layers/linear_attention.DecodeStateMetadata`), padding rows pointing at the padding state
slot, which no request owns, from zeros. The snapshots a decode step takes are copied out of the live slots after the
replay (`ModelWorker.add_state`).

A verification step (each sequence's last token and the draft tree below it, `ForwardBatch.tree_mask`) replays a graph
of a (batch size, query length) bucket, the query length being the root plus k draft nodes for each draft-length
bucket k (`verify_buckets`; `EngineConfig.cuda_graph_draft_lengths`). Every sequence is padded to the bucket's query
length: its padding rows follow its real ones, its length grows by as many (so the kernels, which take each sequence's
context as its length minus its query rows, see its real context), the tree mask hides them from the real rows, and
they write their K/V to the padding block. Keys the padding rows add to a sequence are read through its block table,
whose columns past its own blocks point at the padding block. A step of decodes and verifications mixed is one too
(a decode is a root without drafts). A hybrid model's verification graph finds each row's parent from the static tree
mask and writes each row's state to its sequence's scratch slots (a decoding sequence's first row to its live slot,
other rows to the padding slot; `padded_tree_state`); a step with a prefill chunk or a snapshot inside it runs eagerly.

Only the model forward (ids -> final hidden states) is captured; logits and sampling stay eager. Steps with a prefill
chunk, or larger than every bucket, run eagerly.

Capture needs the forward to be free of host syncs and of shapes that depend on tensor values. The batch carries
`static_shapes`: its host-side lengths are the bound max_model_len, so the attention launches enough context slices
for any length up to it, while each sequence's own slices depend on its own length alone (see
`kernels/triton_attention.split_plan`): a graph step and an eager step give the same bits. The Triton kernels (norm, rotary, cache write, paged
decode, MoE routing sort and grouped GEMMs) read lengths from tensors only; the torch reference MoE does not, hence
graphs need kernel_backend="triton".

`capture=False` runs the same static buffers and padding without a graph (the forward is called directly): the path
the CPU tests check against eager decoding and verification.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import EngineConfig
from reasoning_engine.kernels import kernel_module
from reasoning_engine.layers.linear_attention import (DecodeStateMetadata, fits_padded_tree, is_decode_state_step,
                                                      padded_tree_state)
from reasoning_engine.models.base import CausalLM

logger = logging.getLogger(__name__)


def cuda_graphs_enabled(config: EngineConfig) -> bool:
    """Graphs need a GPU and the Triton kernels (graph-safe); enforce_eager turns them off, and so does data
    parallelism (a captured MoE layer would need every replica's batch size, fixed at capture)."""
    return (config.device.type == "cuda" and config.kernel_backend == "triton" and not config.enforce_eager
            and config.parallel.data_parallel_size == 1)


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs: at most twice the work of the exact size per step."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return sizes + [max_num_seqs]


# a verification bucket's padded tokens (batch size x query length) at most: the graphs share one memory pool, which
# the largest sizes; larger verification steps run eagerly
VERIFY_GRAPH_TOKENS = 1024


def verify_buckets(batch_sizes: list[int], draft_lengths: list[int], max_tokens: int = VERIFY_GRAPH_TOKENS
                   ) -> list[tuple[int, int]]:
    """(batch size, query length) of every verification graph: each batch-size bucket with each draft-length bucket k
    (query length k + 1), within `max_tokens` padded tokens."""
    return [(b, k + 1) for b in batch_sizes for k in draft_lengths if b * (k + 1) <= max_tokens]


def choose_bucket(buckets: list[tuple[int, int]], num_seqs: int, query_len: int) -> tuple[int, int] | None:
    """The bucket (batch size, query length) holding `num_seqs` sequences of up to `query_len` query tokens in the
    fewest padded tokens (ties: fewer sequences); None when none holds them."""
    fits = [(b * q, b, q) for b, q in buckets if b >= num_seqs and q >= query_len]
    return min(fits)[1:] if fits else None


class CudaGraphRunner:
    """Static buffers for every decode bucket (batch size, query length 1) and verification bucket (batch size, root
    plus k draft nodes); with `capture`, one CUDA graph per bucket replays the model forward over them."""

    def __init__(self, model: CausalLM, config: EngineConfig, padding_block: int, capture: bool,
                 max_draft_tokens: int = 0, state_padding_slot: int | None = None) -> None:
        """`padding_block`: a cache block no request owns; padding rows write their K/V to its first slot.
        `max_draft_tokens`: the most draft nodes a sequence verifies (0: no speculation, no verification graphs).
        `state_padding_slot`: a hybrid model's linear-attention state slot no request owns, where padding rows keep
        their state (None: no linear-attention layers)."""
        self.model = model
        self.device = config.device
        self.attention_ops = kernel_module("attention", config.kernel_backend)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.batch_sizes = list(config.cuda_graph_batch_sizes or decode_batch_sizes(config.max_num_seqs))
        draft_lengths = (config.cuda_graph_draft_lengths if config.cuda_graph_draft_lengths is not None
                         else decode_batch_sizes(max_draft_tokens) if max_draft_tokens else [])
        self.verify_buckets = verify_buckets(self.batch_sizes, sorted(k for k in draft_lengths if k <= max_draft_tokens))
        self.buckets = [(b, 1) for b in self.batch_sizes] + self.verify_buckets
        self.padding_block = padding_block
        self.num_steps = 0  # steps that took the static path (replayed, or run directly without capture)
        self.num_verify_steps = 0  # of which verification steps
        largest = self.batch_sizes[-1]
        tokens = max(b * q for b, q in self.buckets)
        max_query = max(q for _, q in self.buckets)
        # a verification row's sequence grows by its padding rows: up to max_query - 1 past max_model_len
        self.max_blocks = -(-(config.max_model_len + max_query - 1) // config.block_size)
        num_groups = len(model.cache_groups())
        with torch.inference_mode(), torch.device(self.device):
            self.input_ids = torch.zeros(tokens, dtype=torch.long)
            self.positions = torch.zeros(tokens, dtype=torch.long)
            # per KV cache group (cache_groups.py), its slots and block tables
            self.group_slots = [torch.zeros(tokens, dtype=torch.long) for _ in range(num_groups)]
            self.group_tables = [torch.zeros(largest, self.max_blocks, dtype=torch.int32) for _ in range(num_groups)]
            self.seq_lens = torch.zeros(largest, dtype=torch.long)
            self.tree_mask = torch.zeros(tokens, max_query, dtype=torch.bool)
            # per query length, the first row of each sequence
            self.query_starts = {q: torch.arange(largest + 1, dtype=torch.long) * q for q in {q for _, q in self.buckets}}
            # hybrid models: per sequence its linear-attention state slot, whether it starts from zeros and (when it
            # verifies a draft) its first scratch slot, else -1
            self.state_padding_slot = state_padding_slot
            self.state_slots = torch.full((largest,), state_padding_slot or 0, dtype=torch.long)
            self.state_fresh = torch.ones(largest, dtype=torch.bool)
            self.state_scratch = torch.full((largest,), -1, dtype=torch.long)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        if capture:
            self.capture()

    @property
    def captured_batch_sizes(self) -> list[int]:
        """Batch sizes of the captured decode graphs."""
        return sorted(b for b, q in self.graphs if q == 1)

    @property
    def captured_verify_buckets(self) -> list[tuple[int, int]]:
        """(batch size, draft length) of the captured verification graphs."""
        return sorted((b, q - 1) for b, q in self.graphs if q > 1)

    def bucket(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The bucket a step replays: a pure decode step a decode bucket; a step whose sequences each verify a draft
        tree or decode (every query row under the tree mask) a verification bucket; None for anything else (a prefill
        chunk, too many sequences or draft nodes, a context past max_model_len)."""
        if not 0 < batch.num_seqs or batch.block_tables.shape[1] > self.max_blocks or batch.max_seq_len > self.max_model_len:
            return None
        hybrid = self.state_padding_slot is not None
        if batch.max_query_len == 1 and batch.tree_mask is None:
            if hybrid and not is_decode_state_step(batch):
                return None
            return choose_bucket([(b, 1) for b in self.batch_sizes], batch.num_seqs, 1)
        if batch.tree_mask is None or (hybrid and not fits_padded_tree(batch)):
            return None
        return choose_bucket(self.verify_buckets, batch.num_seqs, batch.max_query_len)

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.bucket(batch) is not None

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a decode or verification batch (`can_run`), in the batch's row order.
        A decode step's result is a view of the graph's output, valid until the next step."""
        size, query_len = self.bucket(batch)
        if query_len == 1:
            self._fill(batch, size)
        else:
            rows = self._fill_verify(batch, size, query_len)
        graph = self.graphs.get((size, query_len))
        hidden = self._forward(size, query_len) if graph is None else self._replay(graph, (size, query_len))
        self.num_steps += 1
        if query_len == 1:
            return hidden[: batch.num_seqs]
        self.num_verify_steps += 1
        return hidden[rows]

    def _replay(self, graph: torch.cuda.CUDAGraph, bucket: tuple[int, int]) -> torch.Tensor:
        graph.replay()
        return self.outputs[bucket]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, most tokens first, into one memory pool: buckets never run at once, so the smaller
        graphs reuse the larger ones' intermediate memory."""
        start = time.perf_counter()
        with torch.cuda.device(self.device):
            free_before = torch.cuda.mem_get_info()[0]
            pool = torch.cuda.graph_pool_handle()
            for size, query_len in sorted(self.buckets, key=lambda bq: (bq[0] * bq[1], bq), reverse=True):
                self._pad(0, size, query_len)
                # warm-up outside the capture: Triton compiles its kernels, cuBLAS sets up its workspace; on a side
                # stream, as the capture itself runs on one
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._forward(size, query_len)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size, query_len] = self._forward(size, query_len)
                self.graphs[size, query_len] = graph
            torch.cuda.synchronize()
            used = free_before - torch.cuda.mem_get_info()[0]
        logger.info("CUDA graphs: decode batch sizes %s and verification buckets (batch size, draft length) %s "
                    "captured in %.1f s (%.0f MiB)", self.captured_batch_sizes, self.captured_verify_buckets,
                    time.perf_counter() - start, used / 2**20)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.group_slots[0]

    @property
    def block_tables(self) -> torch.Tensor:
        return self.group_tables[0]

    def _static_batch(self, size: int, query_len: int) -> ForwardBatch:
        """A ForwardBatch over the first `size` sequences (`query_len` rows each) of the static buffers; host-side
        lengths are the static bounds."""
        tokens = size * query_len
        bound = self.max_model_len + query_len - 1  # padding rows lengthen a sequence by up to query_len - 1
        starts = self.query_starts[query_len][: size + 1]
        batch = ForwardBatch(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            slot_mapping=self.group_slots[0][:tokens],
            query_start_loc=starts,
            seq_lens=self.seq_lens[:size],
            block_tables=self.group_tables[0][:size],
            logits_indices=starts[:size],
            max_query_len=query_len,
            max_seq_len=bound,
            query_lens_cpu=[query_len] * size,
            seq_lens_cpu=[bound] * size,
            tree_mask=self.tree_mask[:tokens, :query_len] if query_len > 1 else None,
            static_shapes=True,
        )
        batch.groups = [dataclasses.replace(batch, slot_mapping=slots[:tokens], block_tables=tables[:size], groups=[])
                        for slots, tables in zip(self.group_slots[1:], self.group_tables[1:])]
        if self.state_padding_slot is not None:  # built here, within the captured region: the tree's are tensor ops
            slots, fresh = self.state_slots[:size], self.state_fresh[:size]
            batch.state_metadata = (DecodeStateMetadata(slots, fresh) if query_len == 1 else padded_tree_state(
                slots, fresh, self.state_scratch[:size], batch.tree_mask, self.state_padding_slot))
        return batch

    def _forward(self, size: int, query_len: int = 1) -> torch.Tensor:
        """The captured region: attention metadata (it converts the buffers, so it must replay too) and the model."""
        batch = self._static_batch(size, query_len)
        for view in batch.with_groups():
            view.attn_metadata = self.attention_ops.prepare_attention(view, self.block_size)
        return self.model(batch)

    def _fill(self, batch: ForwardBatch, size: int) -> None:
        """Copy a decode step's tensors into the first rows and pad the rest of the bucket. Block-table columns past a
        sequence's own blocks keep stale ids: the kernels read only positions below its length."""
        n = batch.num_seqs
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.seq_lens[:n].copy_(batch.seq_lens)
        for view, slots, tables in zip(batch.with_groups(), self.group_slots, self.group_tables):
            slots[:n].copy_(view.slot_mapping)
            tables[:n, : view.block_tables.shape[1]].copy_(view.block_tables)
        if self.state_padding_slot is not None:
            self.state_slots[:n].copy_(batch.state_slots)
            self.state_fresh[:n].copy_(batch.state_fresh)
        self._pad(n, size, 1)

    def _fill_verify(self, batch: ForwardBatch, size: int, query_len: int) -> torch.Tensor:
        """Lay a verification step out as `size` sequences of `query_len` rows: sequence b's rows from b * query_len,
        its real ones first. Returns the static rows of the batch's rows, in order."""
        n, q = batch.num_seqs, query_len
        tokens = size * q
        rows = torch.tensor([b * q + i for b, length in enumerate(batch.query_lens_cpu) for i in range(length)],
                            dtype=torch.long, device=self.device)
        self._pad(0, size, q)
        # a real sequence's padding rows sit after its real ones, at the positions that follow: its length grows by
        # their number, its context (length minus query rows) stays its own
        query_lens = batch.query_lens()
        context = torch.zeros(size, dtype=torch.long, device=self.device)  # padding sequences: none
        context[:n] = batch.seq_lens - query_lens
        self.positions[:tokens].copy_(context.repeat_interleave(q) + self.positions[:tokens])
        self.seq_lens[:n].copy_(batch.seq_lens + (q - query_lens))
        self.input_ids.index_copy_(0, rows, batch.input_ids)
        self.positions.index_copy_(0, rows, batch.positions)
        for view, slots, tables in zip(batch.with_groups(), self.group_slots, self.group_tables):
            slots.index_copy_(0, rows, view.slot_mapping)
            tables[:n, : view.block_tables.shape[1]].copy_(view.block_tables)
        if batch.tree_mask is not None:
            self.tree_mask[rows, : batch.max_query_len] = batch.tree_mask
        if self.state_padding_slot is not None:
            self.state_slots[:n].copy_(batch.state_slots)
            self.state_fresh[:n].copy_(batch.state_fresh)
            self.state_scratch[:n].copy_(torch.tensor(batch.state_scratch or [-1] * n, dtype=torch.long))
        return rows

    def _pad(self, start: int, stop: int, query_len: int) -> None:
        """Sequences start..stop-1 become `query_len`-token sequences at position 0 in the padding block: their K/V go
        to a slot no request reads and their attention sees only that block (finite outputs, which are dropped). With
        several query rows each row sees only itself among them. A verification step pads every sequence's block table
        past its own blocks with the padding block (`_fill_verify` then writes the real rows over it). A hybrid
        model's padding sequences start from zeros in the padding state slot."""
        if start == stop:
            return
        rows = slice(start * query_len, stop * query_len)
        self.input_ids[rows] = 0
        self.seq_lens[start:stop] = query_len
        if self.state_padding_slot is not None:
            self.state_slots[start:stop] = self.state_padding_slot
            self.state_fresh[start:stop] = True
            self.state_scratch[start:stop] = -1
        for slots in self.group_slots:
            slots[rows] = self.padding_block * self.block_size
        for tables in self.group_tables:
            if query_len == 1:
                tables[start:stop, 0] = self.padding_block
            else:
                tables[start:stop] = self.padding_block
        if query_len == 1:
            self.positions[rows] = 0
            return
        offsets = torch.arange(query_len, device=self.device)
        self.positions[rows] = offsets.repeat(stop - start)
        self.tree_mask[rows, :query_len] = (offsets.view(-1, 1) == offsets.view(1, -1)).repeat(stop - start, 1)
