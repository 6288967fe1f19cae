"""CUDA graphs for decode steps.

A decode step of a small batch launches a few kernels per layer, each doing little work, so on a GPU the step is
bound by the CPU launching them. A CUDA graph records the whole forward once and replays it with one launch. A graph
replays fixed kernels on fixed memory, so each batch-size bucket (1, 2, 4, ... up to max_num_seqs) gets its own graph
over static input buffers, captured at engine start. A step copies its tensors into those buffers, pads the batch to
the bucket with rows that write their K/V to a spare cache slot, replays, and keeps the first rows of the output.
A hybrid model's KV cache groups (cache_groups.py) each have their own slot and block-table buffers.

Only the model forward (ids -> final hidden states) is captured; logits and sampling stay eager. Steps that are not
pure decode (a prefill chunk, draft verification) or are larger than the largest bucket run eagerly.

Capture needs the forward to be free of host syncs and of shapes that depend on tensor values. The batch carries
`static_shapes`: its host-side lengths are the bound max_model_len, so the attention launches enough context slices
for any length up to it, while each sequence's own slices depend on its own length alone (see
`kernels/triton_attention.split_plan`): a graph step and an eager step give the same bits. The Triton kernels (norm, rotary, cache write, paged
decode, MoE routing sort and grouped GEMMs) read lengths from tensors only; the torch reference MoE does not, hence
graphs need kernel_backend="triton".

`capture=False` runs the same static buffers and padding without a graph (the forward is called directly): the path
the CPU tests check against eager decoding.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import EngineConfig
from reasoning_engine.kernels import kernel_module
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


class CudaGraphRunner:
    """Static decode buffers for every batch-size bucket; with `capture`, one CUDA graph per bucket replays the model
    forward over them."""

    def __init__(self, model: CausalLM, config: EngineConfig, padding_block: int, capture: bool) -> None:
        """`padding_block`: a cache block no request owns; padding rows write their K/V to its first slot."""
        self.model = model
        self.device = config.device
        self.attention_ops = kernel_module("attention", config.kernel_backend)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.batch_sizes = list(config.cuda_graph_batch_sizes or decode_batch_sizes(config.max_num_seqs))
        self.padding_block = padding_block
        self.num_steps = 0  # steps that took the static path (replayed, or run directly without capture)
        largest = self.batch_sizes[-1]
        self.max_blocks = -(-config.max_model_len // config.block_size)
        num_groups = len(model.cache_groups())
        with torch.inference_mode(), torch.device(self.device):
            self.input_ids = torch.zeros(largest, dtype=torch.long)
            self.positions = torch.zeros(largest, dtype=torch.long)
            # per KV cache group (cache_groups.py), its slots and block tables
            self.group_slots = [torch.zeros(largest, dtype=torch.long) for _ in range(num_groups)]
            self.group_tables = [torch.zeros(largest, self.max_blocks, dtype=torch.int32) for _ in range(num_groups)]
            self.seq_lens = torch.zeros(largest, dtype=torch.long)
            self.query_start_loc = torch.arange(largest + 1, dtype=torch.long)  # one query token per sequence
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self.capture()

    @property
    def captured_batch_sizes(self) -> list[int]:
        return sorted(self.graphs)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Pure decode (one query token per sequence, no draft tree) that fits the largest bucket."""
        return (batch.max_query_len == 1 and batch.tree_mask is None and 0 < batch.num_seqs <= self.batch_sizes[-1]
                and batch.block_tables.shape[1] <= self.max_blocks)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode batch (`can_run`). The result is a view of the graph's output,
        valid until the next step."""
        num_seqs = batch.num_seqs
        size = next(s for s in self.batch_sizes if s >= num_seqs)
        self._fill(batch, size)
        graph = self.graphs.get(size)
        if graph is None:
            hidden = self._forward(size)
        else:
            graph.replay()
            hidden = self.outputs[size]
        self.num_steps += 1
        return hidden[:num_seqs]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool: buckets never run at once, so the smaller graphs
        reuse the larger ones' intermediate memory."""
        start = time.perf_counter()
        with torch.cuda.device(self.device):
            free_before = torch.cuda.mem_get_info()[0]
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.batch_sizes):
                self._pad(0, size)
                # warm-up outside the capture: Triton compiles its kernels, cuBLAS sets up its workspace; on a side
                # stream, as the capture itself runs on one
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._forward(size)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
            torch.cuda.synchronize()
            used = free_before - torch.cuda.mem_get_info()[0]
        logger.info("CUDA graphs: decode batch sizes %s captured in %.1f s (%.0f MiB)", self.captured_batch_sizes,
                    time.perf_counter() - start, used / 2**20)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.group_slots[0]

    @property
    def block_tables(self) -> torch.Tensor:
        return self.group_tables[0]

    def _static_batch(self, size: int) -> ForwardBatch:
        """A ForwardBatch over the first `size` rows of the static buffers; host-side lengths are the static bound."""
        batch = ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.group_slots[0][:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.group_tables[0][:size],
            logits_indices=self.query_start_loc[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            static_shapes=True,
        )
        batch.groups = [dataclasses.replace(batch, slot_mapping=slots[:size], block_tables=tables[:size], groups=[])
                        for slots, tables in zip(self.group_slots[1:], self.group_tables[1:])]
        return batch

    def _forward(self, size: int) -> torch.Tensor:
        """The captured region: attention metadata (it converts the buffers, so it must replay too) and the model."""
        batch = self._static_batch(size)
        for view in batch.with_groups():
            view.attn_metadata = self.attention_ops.prepare_attention(view, self.block_size)
        return self.model(batch)

    def _fill(self, batch: ForwardBatch, size: int) -> None:
        """Copy the step's tensors into the first rows and pad the rest of the bucket. Block-table columns past a
        sequence's own blocks keep stale ids: the kernels read only positions below its length."""
        n = batch.num_seqs
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.seq_lens[:n].copy_(batch.seq_lens)
        for view, slots, tables in zip(batch.with_groups(), self.group_slots, self.group_tables):
            slots[:n].copy_(view.slot_mapping)
            tables[:n, : view.block_tables.shape[1]].copy_(view.block_tables)
        self._pad(n, size)

    def _pad(self, start: int, stop: int) -> None:
        """Rows start..stop-1 become one-token sequences at position 0 in the padding block: their K/V go to a slot no
        request reads and their attention sees only that slot (finite outputs, which are dropped)."""
        if start == stop:
            return
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.seq_lens[start:stop] = 1
        for slots, tables in zip(self.group_slots, self.group_tables):
            slots[start:stop] = self.padding_block * self.block_size
            tables[start:stop, 0] = self.padding_block
