"""Turns a scheduled step into tensors, runs the model and samples.

It owns the KV cache tensors (allocated once from a block budget and bound to the attention layers) and builds the
step's ForwardBatch from the requests' block tables.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import EngineConfig
from reasoning_engine.engine.request import Request
from reasoning_engine.engine.scheduler import ScheduledRequest
from reasoning_engine.kernels import kernel_module
from reasoning_engine.layers.sampler import Sampler, SamplingMetadata, top_logprobs
from reasoning_engine.models.base import CausalLM
from reasoning_engine.outputs import Logprob
from reasoning_engine.speculative.verify import verify_greedy, verify_sampled

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one scheduled request got from a step: new tokens once its tokens reached the end (one, or the accepted
    part of a draft plus the target's next token), with their logprobs."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    logprob_values: list[float] = field(default_factory=list)
    accepted_nodes: list[int] | None = None  # verification: draft nodes accepted, root to leaf
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    logits: torch.Tensor | None = None


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM) -> None:
        self.config = config
        self.model = model
        self.device = config.device
        self.block_size = config.block_size
        self.sampler = Sampler(config.seed)
        self.attention_ops = kernel_module("attention", config.kernel_backend)
        self.num_blocks = self._num_blocks()
        self._allocate_cache()

    def _num_blocks(self) -> int:
        c = self.config
        per_block = c.model.kv_cache_bytes_per_token(c.dtype) * c.block_size
        if c.kv_cache_blocks is not None:
            blocks = c.kv_cache_blocks
        elif c.kv_cache_memory is not None:
            blocks = c.kv_cache_memory // per_block
        else:
            # enough for every sequence at full length, within a share of the free memory
            wanted = c.max_num_seqs * ((c.max_model_len + c.block_size - 1) // c.block_size) + 1
            share = 0.85 if self.device.type == "cuda" else 0.3
            blocks = min(wanted, int(available_memory(self.device) * share) // per_block)
        min_blocks = (c.max_model_len + c.block_size - 1) // c.block_size
        if blocks < min_blocks:
            raise ValueError(
                f"kv_cache_blocks={blocks} holds {blocks * c.block_size} tokens, fewer than max_model_len={c.max_model_len}; "
                f"give more KV cache memory or a smaller max_model_len")
        return blocks

    def _allocate_cache(self) -> None:
        self.kv_caches: list[list[torch.Tensor]] = []
        for attn in self.model.attention_layers():
            caches = [torch.zeros(shape, dtype=self.config.dtype, device=self.device)
                      for shape in attn.cache_shape(self.num_blocks, self.block_size)]
            attn.bind_cache(caches)
            self.kv_caches.append(caches)
        total = sum(t.numel() * t.element_size() for caches in self.kv_caches for t in caches)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks, self.block_size, total / 2**20)

    def move_kv(self, block_table: list[int], moves: list[tuple[int, int]]) -> None:
        """Copy cache entries between token positions of one sequence (accepted draft-tree nodes into place)."""
        bs = self.block_size
        src = torch.tensor([block_table[a // bs] * bs + a % bs for a, _ in moves], device=self.device)
        dst = torch.tensor([block_table[b // bs] * bs + b % bs for _, b in moves], device=self.device)
        for caches in self.kv_caches:
            for cache in caches:
                flat = cache.view(-1, *cache.shape[2:])
                flat[dst] = flat[src]

    # ---- one step ----
    def prepare(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, list[list[int]], list[int]]:
        """Flatten the scheduled tokens. Returns the batch and, per request, the hidden-state rows it samples from
        (one, or 1 + draft size when verifying a draft; none mid-prefill) and the first logits row of its
        prompt-logprob chunk (-1 where none)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sample_rows: list[list[int]] = []
        prompt_rows: list[int] = []
        tree_parts: list[torch.Tensor] = []
        bs = self.block_size
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            stop = start + item.num_tokens
            draft = request.draft if item.num_draft_tokens else None
            table = request.block_table
            row0 = len(input_ids)
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, stop))
            query_lens.append(stop - start)
            seq_lens.append(stop)
            if draft is not None:  # verify: the last token, then the draft tree at positions by depth
                input_ids.append(request.token_at(start))
                input_ids.extend(draft.token_ids)
                positions.append(start)
                positions.extend(start + d for d in draft.depths())
                rows = list(range(row0, row0 + 1 + len(draft)))
                tree_parts.append(draft.ancestor_mask(include_root=True))
                sample_rows.append(rows)
                logits_rows.extend(rows)
                prompt_rows.append(-1)
                continue
            real_stop = min(stop, request.num_tokens)
            input_ids.extend(request.all_token_ids[start:real_stop])
            positions.extend(range(start, stop))
            tree_parts.append(torch.ones(stop - start, stop - start, dtype=torch.bool).tril())
            wants_prompt = request.params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1
            prompt_rows.append(len(logits_rows) if wants_prompt else -1)
            if wants_prompt:
                logits_rows.extend(range(row0, row0 + item.num_tokens))
            if real_stop == request.num_tokens:
                sample_rows.append([row0 + (real_stop - 1 - start)])
                if not wants_prompt:
                    logits_rows.append(sample_rows[-1][0])
            else:
                sample_rows.append([])
        max_blocks = max(len(item.request.block_table) for item in scheduled)
        tables = torch.zeros(len(scheduled), max_blocks, dtype=torch.int32)
        for i, item in enumerate(scheduled):
            tables[i, : len(item.request.block_table)] = torch.tensor(item.request.block_table, dtype=torch.int32)
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        dev = self.device
        tree_mask = None
        if any(item.num_draft_tokens for item in scheduled):
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
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            tree_mask=tree_mask,
        )
        batch.attn_metadata = self.attention_ops.prepare_attention(batch, bs)
        return batch, sample_rows, prompt_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], forced: dict[int, int]) -> list[StepResult]:
        """Run one step. `forced` maps a scheduled index to a token it must emit (thinking budget)."""
        batch, sample_rows, prompt_rows = self.prepare(scheduled)
        hidden = self.model(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        row_of = {row: i for i, row in enumerate(batch.logits_indices.tolist())}
        results = [StepResult() for _ in scheduled]
        plain = [i for i, rows in enumerate(sample_rows) if len(rows) == 1 and not scheduled[i].num_draft_tokens]
        if plain:
            picked = logits[[row_of[sample_rows[i][0]] for i in plain]]
            out = self.sampler(picked, self._metadata([scheduled[i].request for i in plain],
                                                       [forced.get(i) for i in plain], picked.device))
            for j, i in enumerate(plain):
                results[i].token_ids = [out.token_ids[j]]
                results[i].logprobs = [out.logprobs[j]]
                results[i].logprob_values = [out.sampled_logprobs[j]]
                if scheduled[i].request.capture_logits:
                    results[i].logits = picked[j].cpu()
        for i, item in enumerate(scheduled):
            if item.num_draft_tokens:
                results[i] = self._verify(item.request, logits[[row_of[r] for r in sample_rows[i]]])
            if prompt_rows[i] >= 0:
                results[i].prompt_logprobs = self._prompt_logprobs(item, logits[prompt_rows[i]:])
        return results

    def _verify(self, request: Request, logits: torch.Tensor) -> StepResult:
        """Accept the longest valid part of the request's draft tree; rows: root then one per draft node."""
        draft = request.draft
        paths = [[]] + [[draft.token_ids[n] for n in draft.path_to(node)] for node in range(len(draft))]
        meta = self._metadata([request] * len(paths), [None] * len(paths), logits.device, paths)
        processed = self.sampler.process(logits, meta)
        if request.params.greedy:
            accepted, bonus = verify_greedy(draft, processed.argmax(dim=-1).tolist())
        else:
            accepted, bonus = verify_sampled(draft, self.sampler.probabilities(processed, meta), request.generator)
        tokens = [draft.token_ids[n] for n in accepted] + [bonus]
        rows = [0] + [n + 1 for n in accepted]  # the row each emitted token was drawn from
        raw = logits[rows].log_softmax(dim=-1)
        values = raw.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1)).squeeze(1).tolist()
        logprobs = top_logprobs(raw, tokens, [request.params.logprobs] * len(tokens))
        return StepResult(token_ids=tokens, logprobs=logprobs, logprob_values=values, accepted_nodes=accepted)

    @staticmethod
    def _prompt_logprobs(item: ScheduledRequest, logits: torch.Tensor) -> list[dict[int, Logprob] | None]:
        """Logprobs of prompt tokens start+1 .. end of this chunk, from the logits one position earlier."""
        request = item.request
        start = request.num_computed_tokens
        stop = min(start + item.num_tokens, request.num_prompt_tokens - 1)
        chunk = logits[: stop - start].log_softmax(dim=-1)
        n = request.params.prompt_logprobs
        entries: list[dict[int, Logprob] | None] = []
        for offset in range(stop - start):
            target = request.prompt_token_ids[start + offset + 1]
            row = chunk[offset]
            lp = float(row[target])
            entry = {target: Logprob(lp, int((row > row[target]).sum()) + 1)}
            if n:
                values, ids = row.topk(n)
                for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist())):
                    entry.setdefault(t, Logprob(v, rank + 1))
            entries.append(entry)
        return entries

    def _metadata(self, requests: list[Request], forced: list[int | None], device: torch.device,
                  paths: list[list[int]] | None = None) -> SamplingMetadata:
        """Per-row settings. `paths` (verification) extends each row's output with the draft tokens above it."""
        paths = paths or [[] for _ in requests]
        params = [r.params for r in requests]
        greedy = [p.greedy for p in params]
        penalties = any(p.has_penalties for p in params)
        banned = [self._banned(r, len(path)) for r, path in zip(requests, paths)]
        meta = SamplingMetadata(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device),
            greedy=greedy,
            generators=[r.generator for r in requests],
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(greedy),
            needs_filters=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
            banned=banned if any(banned) else None,
            forced=forced if any(f is not None for f in forced) else None,
        )
        if penalties:
            meta.presence = torch.tensor([p.presence_penalty for p in params], device=device)
            meta.frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
            meta.repetition = torch.tensor([p.repetition_penalty for p in params], device=device)
            meta.prompt_ids = [r.prompt_token_ids for r in requests]
            meta.output_ids = [r.output_token_ids + path for r, path in zip(requests, paths)]
        return meta

    @staticmethod
    def _banned(request: Request, extra: int = 0) -> list[int]:
        if len(request.output_token_ids) + extra >= request.params.min_tokens:
            return []
        return sorted(set(request.eos_token_ids) | set(request.params.stop_token_ids))
