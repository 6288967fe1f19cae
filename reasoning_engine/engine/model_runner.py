"""Turns a scheduled step into tensors, runs the model and samples.

It owns the KV cache tensors (allocated once from a block budget and bound to the attention layers) and builds the
step's ForwardBatch from the requests' block tables.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import EngineConfig
from reasoning_engine.engine.request import Request
from reasoning_engine.engine.scheduler import ScheduledRequest
from reasoning_engine.kernels.attention import prepare_torch_attention
from reasoning_engine.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from reasoning_engine.models.base import CausalLM
from reasoning_engine.outputs import Logprob

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one scheduled request got from a step: a sampled token when its tokens reached the end."""

    token_id: int | None = None
    logprobs: dict[int, Logprob] | None = None
    logprob: float = 0.0
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

    # ---- one step ----
    def prepare(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, list[int], list[int]]:
        """Flatten the scheduled tokens. Returns the batch and, per request, the hidden-state row of its sampling
        logits and the first logits row of its prompt-logprob chunk (-1 where none)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        bs = self.block_size
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            stop = start + item.num_tokens
            real_stop = min(stop, request.num_tokens)
            tokens = request.all_token_ids[start:real_stop] + request.draft_token_ids[: stop - real_stop]
            table = request.block_table
            row0 = len(input_ids)
            input_ids.extend(tokens)
            positions.extend(range(start, stop))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, stop))
            query_lens.append(stop - start)
            seq_lens.append(stop)
            wants_prompt = request.params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1
            prompt_rows.append(len(logits_rows) if wants_prompt else -1)
            if wants_prompt:
                logits_rows.extend(range(row0, row0 + item.num_tokens))
            if real_stop == request.num_tokens:
                sample_rows.append(row0 + (real_stop - 1 - start))
                if not wants_prompt:
                    logits_rows.append(sample_rows[-1])
            else:
                sample_rows.append(-1)
        max_blocks = max(len(item.request.block_table) for item in scheduled)
        tables = torch.zeros(len(scheduled), max_blocks, dtype=torch.int32)
        for i, item in enumerate(scheduled):
            tables[i, : len(item.request.block_table)] = torch.tensor(item.request.block_table, dtype=torch.int32)
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        dev = self.device
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
        )
        batch.attn_metadata = prepare_torch_attention(batch, bs)
        return batch, sample_rows, prompt_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], forced: dict[int, int]) -> list[StepResult]:
        """Run one step. `forced` maps a scheduled index to a token it must emit (thinking budget)."""
        batch, sample_rows, prompt_rows = self.prepare(scheduled)
        hidden = self.model(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        row_of = {row: i for i, row in enumerate(batch.logits_indices.tolist())}
        results = [StepResult() for _ in scheduled]
        sampling = [i for i, row in enumerate(sample_rows) if row >= 0]
        if sampling:
            picked = logits[[row_of[sample_rows[i]] for i in sampling]]
            out = self.sampler(picked, self._metadata([scheduled[i].request for i in sampling],
                                                       [forced.get(i) for i in sampling], picked.device))
            self._fill(results, sampling, out, scheduled, picked)
        for i, item in enumerate(scheduled):
            if prompt_rows[i] >= 0:
                results[i].prompt_logprobs = self._prompt_logprobs(item, logits[prompt_rows[i]:])
        return results

    def _fill(self, results: list[StepResult], sampling: list[int], out: SamplerOutput,
              scheduled: list[ScheduledRequest], picked: torch.Tensor) -> None:
        for j, i in enumerate(sampling):
            results[i].token_id = out.token_ids[j]
            results[i].logprobs = out.logprobs[j]
            results[i].logprob = out.sampled_logprobs[j]
            if scheduled[i].request.capture_logits:
                results[i].logits = picked[j].cpu()

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

    def _metadata(self, requests: list[Request], forced: list[int | None], device: torch.device) -> SamplingMetadata:
        params = [r.params for r in requests]
        greedy = [p.greedy for p in params]
        penalties = any(p.has_penalties for p in params)
        banned = [self._banned(r) for r in requests]
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
            meta.output_ids = [r.output_token_ids for r in requests]
        return meta

    @staticmethod
    def _banned(request: Request) -> list[int]:
        if len(request.output_token_ids) >= request.params.min_tokens:
            return []
        return sorted(set(request.eos_token_ids) | set(request.params.stop_token_ids))
