"""The driver's side of a step: turns the scheduled requests into a `StepInput`, has the workers run the model
(`worker.py`; one in this process, or every rank's through `executor.py`), and samples from the logits.

Sampling, draft verification and prompt logprobs happen here only, once, whatever the number of ranks. With a draft
model (MTP, EAGLE-3) it also asks the workers to run it after each step over what the step kept, and drafts through
them (`DraftProposer`): the draft models' state lives beside their KV cache, on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from reasoning_engine.config import EngineConfig
from reasoning_engine.engine.encoder_cache import EncoderCachePlan, MediaSlice
from reasoning_engine.engine.kv_tiers import TierOp
from reasoning_engine.engine.request import Request
from reasoning_engine.engine.scheduler import ScheduledRequest
from reasoning_engine.engine.state_cache import StateCache, StatePlan
from reasoning_engine.engine.worker import DraftFinal, DraftObservation, ModelWorker, StepInput
from reasoning_engine.layers.sampler import Sampler, SamplingMetadata, top_logprobs
from reasoning_engine.multimodal.inputs import MediaItem
from reasoning_engine.outputs import Logprob
from reasoning_engine.sampling_params import SamplingParams
from reasoning_engine.speculative.decoder import ProposeItem
from reasoning_engine.speculative.draft import Draft
from reasoning_engine.speculative.verify import verify_draft
from reasoning_engine.structured.matcher import allocate_bitmask, unpack_bitmask

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


class Executor(Protocol):
    """What the runner calls to run the model: a `ModelWorker` itself in one process, or engine/executor.py's
    `DistributedExecutor`, which has every rank's worker make the same call (rank 0's result comes back)."""

    local: ModelWorker  # the worker in this process
    num_blocks: int
    failure: str | None  # why the ranks cannot step any more (a rank died or raised), else None

    def execute_model(self, steps: list[StepInput]) -> list[torch.Tensor]: ...

    def observe_drafts(self, observations: list[DraftObservation]) -> None: ...

    def propose_drafts(self, method: str, items: list[list[ProposeItem]]) -> list[list[Draft]]: ...

    def release_draft_state(self, method: str, seq_id: str) -> None: ...

    def move_kv(self, replica: int, block_tables: list[list[int]], moves: list[tuple[int, int]]) -> None: ...

    def kv_tier_ops(self, replica: int, ops: list[TierOp]) -> None: ...

    def on_failure(self, callback: Callable[[str], None]) -> None: ...

    def gather(self, method: str, *args: object) -> list[object]: ...

    def shutdown(self) -> None: ...


class DraftProposer:
    """A draft model's proposer (speculative/decoder.py `Proposer`) on the driver: drafts come from the workers,
    which keep each request's draft state (the workers of its data-parallel replica, `replica_of`)."""

    def __init__(self, method: str, executor: Executor, replicas: int, replica_of: Callable[[str], int]) -> None:
        self.method = method
        self.executor = executor
        self.replicas = replicas
        self.replica_of = replica_of

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Nothing to do: the request's state comes from the draft pass over its steps."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_draft_tokens: int) -> Draft:
        return self.propose_batch([(request_id, token_ids, max_draft_tokens)])[0]

    def propose_batch(self, items: Sequence[ProposeItem]) -> list[Draft]:
        per_replica: list[list[ProposeItem]] = [[] for _ in range(self.replicas)]
        where = []
        for item in items:
            replica = self.replica_of(item[0]) if self.replicas > 1 else 0
            where.append((replica, len(per_replica[replica])))
            per_replica[replica].append(item)
        drafts = self.executor.propose_drafts(self.method, per_replica)
        return [drafts[replica][i] for replica, i in where]

    def on_tokens_accepted(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        """Nothing to do: the next draft pass sees what was accepted."""

    def finish_request(self, request_id: str, learn: bool = True, token_ids: Sequence[int] | None = None) -> None:
        self.executor.release_draft_state(self.method, request_id)


class ModelRunner:
    """One step of every data-parallel replica (one, without data parallelism): each replica's scheduled requests
    in, each one's results out."""

    def __init__(self, config: EngineConfig, executor: Executor, replica_of: Callable[[str], int]) -> None:
        """`replica_of(seq_id)`: the data-parallel replica a running request belongs to."""
        self.config = config
        self.executor = executor
        self.block_size = config.block_size
        self.num_blocks = executor.num_blocks  # pool 0's: its padding block is idle steps'
        self.pool_blocks = list(executor.local.pool_blocks)  # per block pool (cache_groups.py)
        self.replicas = config.parallel.data_parallel_size
        self.num_groups = len(executor.local.cache_groups)  # KV cache groups (cache_groups.py)
        self.sampler = Sampler(config.seed)
        self.drafters = {method: DraftProposer(method, executor, self.replicas, replica_of)
                         for method in executor.local.drafters}
        self.encoder_caches = [EncoderCachePlan(config.encoder_cache_tokens) for _ in range(self.replicas)]
        # hybrid models: each replica's state slots (the engine sets them beside its schedulers), the first scratch
        # slot of each request verifying a draft in the last step, and the copies the next step makes first
        self.state_caches: list[StateCache | None] = [None] * self.replicas
        self.key_of: list[Callable[[Request, int], bytes] | None] = [None] * self.replicas
        self.verify_scratch: list[dict[str, int]] = [{} for _ in range(self.replicas)]
        self.state_commits: list[list[tuple[int, int]]] = [[] for _ in range(self.replicas)]

    @property
    def worker(self) -> ModelWorker:
        """The worker in this process (rank 0's): its model, caches and decode graphs."""
        return self.executor.local

    def move_kv(self, replica: int, block_tables: list[list[int]], moves: list[tuple[int, int]]) -> None:
        """Copy KV entries between positions of one sequence, in every cache group (one block table each)."""
        self.executor.move_kv(replica, block_tables, moves)

    # ---- one step ----
    def prepare(self, scheduled: list[ScheduledRequest], replica: int = 0) -> tuple[StepInput, list[list[int]], list[int]]:
        """Flatten the scheduled tokens. Returns the step and, per request, the hidden-state rows it samples from
        (one, or 1 + draft size when verifying a draft; none mid-prefill) and the first logits row of its
        prompt-logprob chunk (-1 where none). Media placeholders among the tokens get their encoder rows."""
        input_ids: list[int] = []
        positions: list[int] = []
        group_slots: list[list[int]] = [[] for _ in range(self.num_groups)]  # group 0's are the step's `slots`
        slots = group_slots[0]
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sample_rows: list[list[int]] = []
        prompt_rows: list[int] = []
        # per-sequence visibility among its own tokens, only when some sequence verifies a draft tree
        tree_parts: list[torch.Tensor] | None = [] if any(item.num_draft_tokens for item in scheduled) else None
        media: list[MediaItem] = []
        media_slices: list[MediaSlice] = []
        bs = self.block_size
        states = self.state_caches[replica]
        plans: list[StatePlan] = []
        scratch: list[int] = []
        self.verify_scratch[replica] = {}
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            stop = start + item.num_tokens
            draft = request.draft if item.num_draft_tokens else None
            row0 = len(input_ids)
            if states is not None:
                plans.append(self._state_plan(states, replica, item, draft is not None, scratch))
            for table, group in zip(request.block_tables, group_slots):
                group.extend(table[p // bs] * bs + p % bs for p in range(start, stop))
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
            for item_media in request.media:
                if item_media.overlaps(start, real_stop):
                    first, last = max(start, item_media.offset), min(real_stop, item_media.end)
                    media.append(item_media)
                    media_slices.append(MediaSlice(item_media.content_hash, first - item_media.offset,
                                                   last - item_media.offset, row0 + first - start))
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
        step = StepInput(input_ids, positions, slots, query_lens, seq_lens,
                         [list(item.request.block_table) for item in scheduled], logits_rows, tree_parts,
                         group_slots=group_slots[1:],
                         group_block_tables=[[list(item.request.block_tables[g]) for item in scheduled]
                                             for g in range(1, self.num_groups)])
        if states is not None:
            step.state_slots = [p.slot for p in plans]
            step.state_fresh = [p.fresh for p in plans]
            step.state_saves = [p.saves for p in plans]
            step.state_scratch = scratch if any(s >= 0 for s in scratch) else None
            step.state_restores = [(p.restore, p.slot) for p in plans if p.restore is not None]
            step.state_commits, self.state_commits[replica] = self.state_commits[replica], []
        if media:
            step.media_encode, step.media_drop = self.encoder_caches[replica].plan(media)
            step.media_slices = media_slices
        return step, sample_rows, prompt_rows

    def _state_plan(self, states: StateCache, replica: int, item: ScheduledRequest, verifies: bool,
                    scratch: list[int]) -> StatePlan:
        """A hybrid model's state work for one scheduled request (appends its first scratch slot, or -1)."""
        request = item.request
        if not verifies:
            scratch.append(-1)
            start = request.num_computed_tokens
            stop = min(start + item.num_tokens, request.num_tokens)
            return states.plan(request, start, stop, lambda i: self.key_of[replica](request, i))
        worker = self.worker
        if len(request.draft) + 1 > worker.state_scratch_per_seq:
            raise RuntimeError(f"a draft of {len(request.draft)} nodes exceeds the state scratch of "
                               f"{worker.state_scratch_per_seq - 1}")
        base = worker.state_scratch_start + len(self.verify_scratch[replica]) * worker.state_scratch_per_seq
        self.verify_scratch[replica][request.seq_id] = base
        scratch.append(base)
        return StatePlan(request.state_slot, fresh=False)

    def commit_state(self, replica: int, request: Request, root: int, accepted: list[int]) -> None:
        """After a verified draft: the next step first copies the state of the last accepted node (or of the root)
        into the request's live slot, and the states at block boundaries the accepted path crossed into snapshot
        slots. `root`: the position of the step's first token."""
        states, base = self.state_caches[replica], self.verify_scratch[replica].get(request.seq_id)
        if states is None or base is None:
            return
        rows = [0] + [1 + node for node in accepted]  # the path's rows among the request's verified tokens
        if request.state_slot is not None:
            self.state_commits[replica].append((base + rows[-1], request.state_slot))
        stop = min(root + len(rows), request.num_tokens)
        for boundary in states.boundaries_after_verify(request, root, stop):
            slot = states.save(request, self.key_of[replica](request, boundary // self.block_size - 1), decode=True)
            if slot is not None:
                self.state_commits[replica].append((base + rows[boundary - 1 - root], slot))

    @torch.inference_mode()
    def execute(self, plans: list[list[ScheduledRequest]], forced: list[dict[int, int]]) -> list[list[StepResult]]:
        """Run one step: `plans[r]` is replica r's scheduled requests (an idle replica's step is a placeholder),
        `forced[r]` maps an index of them to a token it must emit (thinking budget)."""
        prepared = [self.prepare(scheduled, r) if scheduled else None for r, scheduled in enumerate(plans)]
        steps = [p[0] if p is not None else StepInput.idle(self.num_blocks, self.block_size) for p in prepared]
        for replica, step in enumerate(steps):
            if prepared[replica] is None and self.state_commits[replica]:  # an idle replica still makes its copies
                step.state_commits, self.state_commits[replica] = self.state_commits[replica], []
        logits = self.executor.execute_model(steps)
        results = [self._results(scheduled, forced[r], logits[r], p[0], p[1], p[2]) if p is not None else []
                   for r, (scheduled, p) in enumerate(zip(plans, prepared))]
        if self.drafters:
            self.executor.observe_drafts([
                self._draft_observation(scheduled, replica_results) if scheduled else
                DraftObservation.idle(self.num_blocks) for scheduled, replica_results in zip(plans, results)])
        return results

    def _results(self, scheduled: list[ScheduledRequest], forced: dict[int, int], logits: torch.Tensor,
                 step: StepInput, sample_rows: list[list[int]], prompt_rows: list[int]) -> list[StepResult]:
        """Sampling, draft verification and prompt logprobs of one replica's requests."""
        row_of = {row: i for i, row in enumerate(step.logits_rows)}
        results = [StepResult() for _ in scheduled]
        plain = [i for i, rows in enumerate(sample_rows) if len(rows) == 1 and not scheduled[i].num_draft_tokens]
        if plain:
            picked = logits[[row_of[sample_rows[i][0]] for i in plain]]
            requests, forced_ids = [scheduled[i].request for i in plain], [forced.get(i) for i in plain]
            out = self.sampler(picked, self._metadata(requests, forced_ids, picked.device,
                                                       bitmask=self._grammar_bitmask(requests, forced_ids)))
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

    def _draft_observation(self, scheduled: list[ScheduledRequest], results: list[StepResult]) -> DraftObservation:
        """After sampling: what the draft models' pass reads. Every position this step keeps is paired with the token
        after it: the next prompt token, the sampled token for the last position, or for a verified draft the
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
        vocab = self.config.model.vocab_size  # a video placeholder id lies past it: the draft embeds 0 instead
        next_ids = [t if t < vocab else 0 for t in next_ids]
        return DraftObservation(rows, next_ids, starts, query_lens,
                                [list(item.request.block_table) for item in scheduled], finals)

    def _verify(self, request: Request, logits: torch.Tensor) -> StepResult:
        """Accept the longest valid part of the request's draft tree; rows: root then one per draft node."""
        draft = request.draft
        paths = [[]] + [[draft.token_ids[n] for n in draft.path_to(node)] for node in range(len(draft))]
        meta = self._metadata([request] * len(paths), [None] * len(paths), logits.device, paths,
                              self._draft_bitmask(request, draft))
        accepted, bonus = verify_draft(draft, self.sampler.choose(self.sampler.process(logits, meta), meta))
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

    def _grammar_bitmask(self, requests: list[Request], forced: list[int | None]) -> torch.Tensor | None:
        """Packed masks of the rows whose grammar applies (not thinking, not forced); None when no row has one."""
        rows = [i for i, r in enumerate(requests) if r.constrained and forced[i] is None and not r.grammar.is_terminated]
        if not rows:
            return None
        bitmask = allocate_bitmask(len(requests), self.config.model.vocab_size)
        for i in rows:
            requests[i].grammar.fill_bitmask(bitmask, i)
        return bitmask

    def _draft_bitmask(self, request: Request, draft: Draft) -> torch.Tensor | None:
        """Verification rows' grammar masks: row 0 after the root, row i + 1 after the path to draft node i (the
        engine dropped nodes the grammar rejects when it drafted; a row it could not reach stays unconstrained). A
        `</think>` in the draft starts the constraint below it. The engine advances the matcher over what is
        accepted."""
        if request.grammar is None:
            return None
        bitmask = allocate_bitmask(1 + len(draft), self.config.model.vocab_size)
        request.grammar.walk_draft(draft.token_ids, draft.parents, request.thinking,
                                   self.config.model.think_end_token_id, bitmask)
        return bitmask

    def _metadata(self, requests: list[Request], forced: list[int | None], device: torch.device,
                  paths: list[list[int]] | None = None, bitmask: torch.Tensor | None = None) -> SamplingMetadata:
        """Per-row settings. `paths` (verification) extends each row's output with the draft tokens above it (and
        so moves a seeded row's draw to the output position it decides); `bitmask`: packed grammar masks, one row
        each."""
        paths = paths or [[] for _ in requests]
        params = [r.params for r in requests]
        greedy = [p.greedy for p in params]
        penalties = any(p.has_penalties for p in params)
        banned = [self._banned(r, path) for r, path in zip(requests, paths)]
        meta = SamplingMetadata(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device),
            greedy=greedy,
            streams=[(r.stream_seed, len(r.output_token_ids) + len(path)) if r.stream_seed is not None else None
                     for r, path in zip(requests, paths)],
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(greedy),
            needs_filters=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
            banned=banned if any(banned) else None,
            forced=forced if any(f is not None for f in forced) else None,
            bias=self._bias(params, device),
            allowed=self._allowed(params, bitmask, device),
        )
        if penalties:
            meta.presence = torch.tensor([p.presence_penalty for p in params], device=device)
            meta.frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
            meta.repetition = torch.tensor([p.repetition_penalty for p in params], device=device)
            meta.prompt_ids = [r.prompt_token_ids for r in requests]
            meta.output_ids = [r.output_token_ids + path for r, path in zip(requests, paths)]
        return meta

    def _bias(self, params: list[SamplingParams], device: torch.device) -> torch.Tensor | None:
        """logit_bias as an additive [N, vocab] tensor; None when no row has one."""
        if not any(p.logit_bias for p in params):
            return None
        bias = torch.zeros(len(params), self.config.model.vocab_size)
        for row, p in enumerate(params):
            if p.logit_bias:
                bias[row, list(p.logit_bias)] = torch.tensor(list(p.logit_bias.values()))
        return bias.to(device)

    def _allowed(self, params: list[SamplingParams], bitmask: torch.Tensor | None,
                 device: torch.device) -> torch.Tensor | None:
        """Bool [N, vocab]: the grammar's mask and allowed_token_ids together. Where the two leave nothing, the
        grammar alone (an output that parses beats one that obeys a contradictory restriction)."""
        restricted = [row for row, p in enumerate(params) if p.allowed_token_ids]
        if bitmask is None and not restricted:
            return None
        vocab = self.config.model.vocab_size
        allowed = (unpack_bitmask(bitmask.to(device), vocab) if bitmask is not None
                   else torch.ones(len(params), vocab, dtype=torch.bool, device=device))
        for row in restricted:
            only = torch.zeros(vocab, dtype=torch.bool, device=device)
            only[torch.tensor(params[row].allowed_token_ids, device=device)] = True
            both = allowed[row] & only
            allowed[row] = torch.where(both.any(), both, allowed[row])
        return allowed

    def _banned(self, request: Request, path: list[int]) -> list[int]:
        """Tokens masked for this row: EOS and stop ids before min_tokens, or while a request with a grammar still
        thinks (its answer must come; once it answers, the grammar decides when it ends), and the last token of each
        bad word whose other tokens the output (plus `path`) ends with."""
        banned: set[int] = set()
        if request.grammar is not None:
            stop_early = request.thinking and self.config.model.think_end_token_id not in path
        else:
            stop_early = len(request.output_token_ids) + len(path) < request.params.min_tokens
        if stop_early:
            banned |= set(request.eos_token_ids) | set(request.params.stop_token_ids)
        if request.bad_word_ids:
            longest = max(len(word) for word in request.bad_word_ids) - 1
            tail = (request.output_token_ids[-longest:] + path)[-longest:] if longest else []
            for word in request.bad_word_ids:
                prefix = word[:-1]
                if not prefix or tail[len(tail) - len(prefix):] == prefix:
                    banned.add(word[-1])
        return sorted(banned)
