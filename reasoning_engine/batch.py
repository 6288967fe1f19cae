"""Per-step batch metadata shared by the model runner, the layers and the kernels.

It sits below the layers so a layer never imports the engine: the engine fills a ForwardBatch, every attention layer
reads it. Tokens of all scheduled sequences are flattened into one ragged batch of T tokens from B sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token (draft trees: context length + depth)
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) each token's K/V is written to
    # (this field and block_tables: KV cache group 0's; other groups' are in `groups`)
    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int64, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states that become logits
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    tree_mask: torch.Tensor | None = None  # [T, max_query_len] bool: query t may see query j of its own sequence
    # True for a CUDA-graph decode batch (engine/cuda_graph.py): its tensors are rewritten between replays, so the
    # host-side lengths (max_seq_len, seq_lens_cpu) are the bound max_model_len, not this step's; kernels must take
    # the lengths from the tensors and size their launches from the batch size and that bound alone.
    static_shapes: bool = False
    attn_metadata: Any = None  # backend-specific tensors built once per step from the fields above (kernels/)
    # data-parallel attention: every replica's token count this step (rank order), for the MoE layers' token gather
    dp_num_tokens: list[int] | None = None
    # multimodal prompts: rows of the step's flattened tokens whose input embedding is the vision encoder's output
    # (image and video placeholders), and those embeddings, in the same order
    media_rows: torch.Tensor | None = None  # [M] int64
    media_embeds: torch.Tensor | None = None  # [M, hidden]
    # hybrid models' linear-attention state (engine/state_cache.py, layers/linear_attention.py), per sequence: its
    # slot, whether it starts from zeros, the snapshots to save (tokens into this step, slot), and for a sequence
    # verifying a draft tree the first of its scratch slots (one per query token; -1: no draft)
    state_slots: torch.Tensor | None = None  # [B] int64
    state_fresh: torch.Tensor | None = None  # [B] bool
    state_saves: list[list[tuple[int, int]]] | None = None
    state_scratch: list[int] | None = None
    state_metadata: Any = None  # built once per step from the fields above (layers/linear_attention.py)
    # hybrid models (cache_groups.py): the same batch as KV cache groups 1, 2, ... see it, each with its own
    # slot_mapping, block_tables and attn_metadata; empty with one group
    groups: list[ForwardBatch] = field(default_factory=list)

    def group(self, index: int) -> ForwardBatch:
        """The batch as the layers of KV cache group `index` see it."""
        return self if index == 0 else self.groups[index - 1]

    def with_groups(self) -> list[ForwardBatch]:
        """This batch and its other groups' views: what attention metadata is prepared for."""
        return [self, *self.groups]

    @property
    def num_seqs(self) -> int:
        """A tensor's size, not len(query_lens_cpu): under torch.compile (engine/compiled_decode.py) it stays symbolic,
        so one graph serves every batch size."""
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]
