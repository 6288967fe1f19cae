"""Turns a scheduled step into tensors, runs the model and samples.

It owns the KV cache tensors (allocated once from a block budget and bound to the attention layers) and builds the
step's ForwardBatch from the requests' block tables. On CUDA with the Triton kernels, decode steps replay CUDA graphs
captured at start (`cuda_graph.py`); everything else runs eagerly. With a draft model (MTP, EAGLE-3) it also runs that
model after each step over what the step kept (`DraftRunner`), which is what the draft-model proposers draft from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import EngineConfig
from reasoning_engine.engine.compiled_decode import CompiledDecode
from reasoning_engine.engine.cuda_graph import CudaGraphRunner, cuda_graphs_enabled
from reasoning_engine.engine.request import Request
from reasoning_engine.engine.scheduler import ScheduledRequest
from reasoning_engine.kernels import kernel_module
from reasoning_engine.layers.sampler import Sampler, SamplingMetadata, top_logprobs
from reasoning_engine.models.base import CausalLM
from reasoning_engine.outputs import Logprob
from reasoning_engine.speculative.decoder import DraftModel, ProposeItem
from reasoning_engine.speculative.draft import Draft
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


def cache_bytes_per_token(layers: Sequence[torch.nn.Module], dtype: torch.dtype) -> int:
    """Bytes one token takes in the caches of these attention layers."""
    size = torch.tensor([], dtype=dtype).element_size()
    return sum(torch.Size(shape).numel() * size for attn in layers for shape in attn.cache_shape(1, 1))


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, draft_models: Mapping[str, DraftModel] | None = None,
                 max_draft_tokens: int = 0) -> None:
        """`draft_models` (speculative methods mtp / eagle3 -> model) each get a cache beside the target's and run
        after every step; `max_draft_tokens` bounds their drafts (num_speculative_tokens)."""
        self.config = config
        self.model = model
        self.device = config.device
        self.block_size = config.block_size
        self.sampler = Sampler(config.seed)
        self.attention_ops = kernel_module("attention", config.kernel_backend)
        draft_models = dict(draft_models or {})
        self.aux_layers = sorted({i for m in draft_models.values() for i in m.aux_layers})
        self.num_blocks = self._num_blocks(list(draft_models.values()))
        # one block past those the BlockManager hands out: padding rows of CUDA-graph decode batches write there, and
        # so do the steps that compile the decode graphs (compile_decode)
        self.padding_block = self.num_blocks
        self.kv_caches = self.allocate_caches(self.model.attention_layers(), self.num_blocks + 1)
        self.drafters = {method: DraftRunner(method, m, self, max_draft_tokens) for method, m in draft_models.items()}
        # EAGLE-3 reads intermediate layers, which a captured forward does not return: its steps stay eager
        self.decode_graphs: CudaGraphRunner | None = None
        if cuda_graphs_enabled(config) and not self.aux_layers:
            self.decode_graphs = CudaGraphRunner(model, config, self.padding_block, capture=True)
        self.compiled_decode: CompiledDecode | None = None
        if config.compile_decode and not self.aux_layers:
            self.compiled_decode = CompiledDecode(model)
            self._compile_decode_graphs()

    @torch.inference_mode()
    def _compile_decode_graphs(self) -> None:
        """Compile the three decode graphs at start rather than during the first requests: steps of one, three and
        MAX_SEQS + 1 sequences whose context lies in the padding block, which no request owns. The sizes avoid
        coincidences (context 7, block tables 2 wider than needed): torch gives equal sizes one symbol, so a graph
        traced with, say, batch size == table width would demand that of every later step (and one traced with two
        sequences came out specialised to two on the test models, whose heads come in pairs)."""
        start = time.perf_counter()
        pad, size, length = self.padding_block, self.block_size, 7
        table = [pad] * (-(-length // size) + 2)
        for n in (1, 3, CompiledDecode.MAX_SEQS + 1):
            self.compiled_decode.warm_up(self.make_batch([0] * n, [length - 1] * n, [pad * size + (length - 1) % size] * n,
                                                         [1] * n, [length] * n, [table] * n, list(range(n))))
        logger.info("compile_decode: decode graphs compiled in %.1f s (guards: %d kept, %d on the model dropped)",
                    time.perf_counter() - start, self.compiled_decode.guards_kept,
                    self.compiled_decode.guards_dropped)

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes replayed from captured CUDA graphs; [] when every step runs eagerly (CPU, torch
        kernels, enforce_eager, EAGLE-3). A step of n sequences replays the smallest of these >= n."""
        return self.decode_graphs.captured_batch_sizes if self.decode_graphs is not None else []

    def _num_blocks(self, draft_models: list[DraftModel]) -> int:
        c = self.config
        per_token = c.model.kv_cache_bytes_per_token(c.dtype)
        per_token += sum(cache_bytes_per_token(m.attention_layers(), c.dtype) for m in draft_models)
        per_block = per_token * c.block_size
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

    def allocate_caches(self, layers: Sequence[torch.nn.Module], num_blocks: int) -> list[list[torch.Tensor]]:
        """Allocate and bind the paged caches of these attention layers (the target's, or a draft model's)."""
        kv_caches: list[list[torch.Tensor]] = []
        for attn in layers:
            caches = [torch.zeros(shape, dtype=self.config.dtype, device=self.device)
                      for shape in attn.cache_shape(num_blocks, self.block_size)]
            attn.bind_cache(caches)
            kv_caches.append(caches)
        total = sum(t.numel() * t.element_size() for caches in kv_caches for t in caches)
        logger.info("KV cache: %d blocks of %d tokens for %d layers (%.1f MiB)", num_blocks, self.block_size,
                    len(kv_caches), total / 2**20)
        return kv_caches

    def move_kv(self, block_table: list[int], moves: list[tuple[int, int]]) -> None:
        """Copy cache entries between token positions of one sequence (accepted draft-tree nodes into place). Draft
        models' caches need no move: their pass after the step writes the accepted positions in place."""
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
        # per-sequence visibility among its own tokens, only when some sequence verifies a draft tree
        tree_parts: list[torch.Tensor] | None = [] if any(item.num_draft_tokens for item in scheduled) else None
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
            if tree_parts is not None:
                tree_parts.append(torch.ones(stop - start, stop - start, dtype=torch.bool).tril())
            wanted = self._prompt_logprob_positions(item)
            wants_prompt = len(wanted) > 0
            prompt_rows.append(len(logits_rows) if wants_prompt else -1)
            if wants_prompt:
                logits_rows.extend(range(row0 + wanted.start - start, row0 + item.num_tokens))
            if real_stop == request.num_tokens:
                sample_rows.append([row0 + (real_stop - 1 - start)])
                if not wants_prompt:
                    logits_rows.append(sample_rows[-1][0])
            else:
                sample_rows.append([])
        batch = self.make_batch(input_ids, positions, slots, query_lens, seq_lens,
                                [item.request.block_table for item in scheduled], logits_rows, tree_parts,
                                with_attention=False)
        return batch, sample_rows, prompt_rows

    def make_batch(self, input_ids: list[int], positions: list[int], slots: list[int], query_lens: list[int],
                   seq_lens: list[int], block_tables: list[list[int]], logits_rows: list[int] | None = None,
                   tree_parts: list[torch.Tensor] | None = None, with_attention: bool = True) -> ForwardBatch:
        """A ForwardBatch over the paged caches, its attention metadata built once for all layers (unless
        `with_attention` is False: a step that replays a CUDA graph builds its own inside the graph). `tree_parts`: per
        sequence, which of its query tokens each may see (draft trees); None for causal order."""
        dev = self.device
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
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
        if with_attention:
            batch.attn_metadata = self.attention_ops.prepare_attention(batch, self.block_size)
        return batch

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], forced: dict[int, int]) -> list[StepResult]:
        """Run one step. `forced` maps a scheduled index to a token it must emit (thinking budget)."""
        batch, sample_rows, prompt_rows = self.prepare(scheduled)
        aux_hidden = dict.fromkeys(self.aux_layers) if self.aux_layers else None
        logits: torch.Tensor | None = None
        if self.decode_graphs is not None and aux_hidden is None and self.decode_graphs.can_run(batch):
            hidden = self.decode_graphs.run(batch)
        else:
            batch.attn_metadata = self.attention_ops.prepare_attention(batch, self.block_size)
            if self.compiled_decode is not None and self.compiled_decode.can_run(batch):  # never built with aux layers
                hidden, logits = self.compiled_decode.run(batch)  # a decode step's logits rows are all of its rows
            else:
                hidden = self.model(batch, aux_hidden)
        if logits is None:
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
        if self.drafters:
            self._run_drafters(scheduled, batch, hidden, aux_hidden or {}, results)
        return results

    def _run_drafters(self, scheduled: list[ScheduledRequest], batch: ForwardBatch, hidden: torch.Tensor,
                      aux_hidden: dict[int, torch.Tensor], results: list[StepResult]) -> None:
        """After sampling: the draft models' pass over every position this step keeps. Position t is paired with the
        token after it: the next prompt token, the sampled token for the last position, or for a verified draft the
        accepted tokens and the bonus token (rejected nodes are left out: their slots are rewritten later)."""
        bs = self.block_size
        rows: list[int] = []  # rows of the step's hidden states whose positions are kept
        next_ids: list[int] = []
        starts: list[int] = []
        query_lens: list[int] = []
        finals: list[DraftFinal] = []
        row0 = 0
        for item, result in zip(scheduled, results):
            request, start, before = item.request, item.request.num_computed_tokens, len(next_ids)
            if item.num_draft_tokens:
                rows += [row0] + [row0 + 1 + node for node in result.accepted_nodes]
                next_ids += result.token_ids
            else:
                stop = start + item.num_tokens
                rows += range(row0, row0 + item.num_tokens)
                next_ids += request.all_token_ids[start + 1 : stop] + (result.token_ids[:1] or [request.token_at(stop)])
            row0 += item.num_tokens
            kept = len(next_ids) - before
            starts.append(start)
            query_lens.append(kept)
            if result.token_ids:
                end = start + kept
                finals.append(DraftFinal(request.seq_id, len(next_ids) - 1, end, request.block_table[: -(-end // bs)]))
        if batch.tree_mask is None:  # no draft verified: the same positions as the target's batch
            draft_batch = dataclasses.replace(batch, input_ids=torch.tensor(next_ids, dtype=torch.long, device=self.device))
        else:
            index = torch.tensor(rows, device=hidden.device)
            hidden, aux_hidden = hidden[index], {i: t[index] for i, t in aux_hidden.items()}
            tables = [item.request.block_table for item in scheduled]
            spans = [range(start, start + n) for start, n in zip(starts, query_lens)]
            draft_batch = self.make_batch(
                next_ids, [p for span in spans for p in span],
                [table[p // bs] * bs + p % bs for table, span in zip(tables, spans) for p in span],
                query_lens, [span.stop for span in spans], tables)
        for drafter in self.drafters.values():
            drafter.observe(draft_batch, hidden, aux_hidden, finals)

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
    def _prompt_logprob_positions(item: ScheduledRequest) -> range:
        """Positions of this chunk whose logits give prompt logprobs the request does not have yet (the logprob of
        the prompt token after each). A prompt recomputed after preemption already has those of its earlier run."""
        request = item.request
        if request.prompt_logprobs is None:
            return range(0)
        start = max(request.num_computed_tokens, len(request.prompt_logprobs) - 1)
        return range(start, max(start, min(request.num_computed_tokens + item.num_tokens, request.num_prompt_tokens - 1)))

    @classmethod
    def _prompt_logprobs(cls, item: ScheduledRequest, logits: torch.Tensor) -> list[dict[int, Logprob] | None]:
        """Prompt logprobs from the logits of `_prompt_logprob_positions` (logits: from the first of them on)."""
        request = item.request
        positions = cls._prompt_logprob_positions(item)
        start, stop = positions.start, positions.stop
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


@dataclass
class DraftFinal:
    """A request whose step produced tokens: its row in the draft pass and where its next draft starts."""

    seq_id: str
    row: int
    position: int  # the new root's position: every position below it is now in the caches
    block_table: list[int]  # the request's blocks holding those positions


@dataclass
class DraftState:
    """What a request's next draft starts from, left by the draft model's pass over the request's last step."""

    position: int
    block_table: list[int]
    features: torch.Tensor  # [hidden] carried from position - 1
    token: int  # the first draft token, predicted at position - 1
    prob: float  # the draft model's probability of it


class DraftRunner:
    """Runs a `DraftModel` (MTP layer, EAGLE-3 head) beside the target and proposes its greedy chains: a `Proposer`.

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

    def __init__(self, method: str, model: DraftModel, runner: ModelRunner, max_draft_tokens: int) -> None:
        self.method = method
        self.model = model
        self.runner = runner
        bs = runner.block_size
        self.scratch_per_seq = -(-max(max_draft_tokens - 1, 0) // bs)
        self.scratch_start = runner.num_blocks
        num_blocks = runner.num_blocks + runner.config.max_num_seqs * self.scratch_per_seq
        self.kv_caches = runner.allocate_caches(model.attention_layers(), num_blocks)
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

    # ---- Proposer ----
    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Nothing to do: the request's state comes from the draft pass over its steps."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_draft_tokens: int) -> Draft:
        return self.propose_batch([(request_id, token_ids, max_draft_tokens)])[0]

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
        if not live:
            return drafts
        chains = {i: ([state.token], [state.prob]) for i, state, _ in live}
        longer = [(i, state, n) for i, state, n in live if n > 1]
        chained = [(i, state, n, self._chain_table(slot, state, n)) for slot, (i, state, n) in enumerate(longer)]
        features = torch.stack([state.features for _, state, _, _ in chained]) if chained else None
        bs = self.runner.block_size
        depth = 1
        while chained:
            # draft token `depth` sits at position + depth; the draft model reads it at the position before
            positions = [state.position + depth - 1 for _, state, _, _ in chained]
            batch = self.runner.make_batch(
                [chains[i][0][-1] for i, _, _, _ in chained], positions,
                [table[p // bs] * bs + p % bs for p, (_, _, _, table) in zip(positions, chained)],
                [1] * len(chained), [p + 1 for p in positions], [table for _, _, _, table in chained])
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

    def _chain_table(self, index: int, state: DraftState, length: int) -> list[int]:
        """The request's blocks, then the scratch blocks of chain slot `index` for draft positions past them."""
        bs = self.runner.block_size
        needed = -(-(state.position + length - 1) // bs) - len(state.block_table)
        scratch = self.scratch_start + index * self.scratch_per_seq
        return state.block_table + list(range(scratch, scratch + max(needed, 0)))

    def on_tokens_accepted(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        """Nothing to do: the next draft pass sees what was accepted."""

    def finish_request(self, request_id: str, learn: bool = True) -> None:
        self.states.pop(request_id, None)
