"""The adaptive controller (reasoning_engine/adaptive) wired into this engine: what each hook of a step measures and
decides. `LLMEngine` calls an `EngineTuner` at its hook points (scheduling, drafting, verification, finishing) and
never needs to know how the decisions are made.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from reasoning_engine.adaptive.batching import LatencyTargets
from reasoning_engine.adaptive.controller import AdaptiveController, DraftAsk, StepTrace, choose_graph_batch_sizes
from reasoning_engine.adaptive.cost_model import StepShape, chunk_pairs
from reasoning_engine.config import EngineConfig
from reasoning_engine.engine.kv_cache import BlockManager
from reasoning_engine.engine.request import Request
from reasoning_engine.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from reasoning_engine.engine.worker import StepInput
from reasoning_engine.speculative.decoder import SpeculativeConfig

if TYPE_CHECKING:
    from reasoning_engine.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

MAX_CUDA_GRAPHS = 12  # captured decode buckets at most (each graph holds its own buffers)
MAX_DRAFT_LENGTH_BUCKETS = 4  # draft-length buckets of the verification graphs at most (each crossed with the above)
REFRESH_S = 0.25


def identity(config: EngineConfig) -> dict[str, Any]:
    """What learned state is specific to: the model, its dtype, the device and the ranks it runs on."""
    model = config.model
    device = config.device.type
    if device == "cuda":
        device = torch.cuda.get_device_name(config.device)
    return {"model": model.name, "model_type": model.model_type, "layers": model.num_hidden_layers,
            "hidden": model.hidden_size, "vocab": model.vocab_size, "dtype": str(config.dtype), "device": device,
            "kernels": config.kernel_backend, "tp": config.parallel.tensor_parallel_size,
            "dp": config.parallel.data_parallel_size, "ep": config.parallel.enable_expert_parallel}


class EngineTuner:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig | None, tool_call_ids: set[int]) -> None:
        """`tool_call_ids`: tokens that open a tool call (a turn ending in one is an agent waiting on its tool)."""
        self.config = config
        self.tool_call_ids = tool_call_ids
        self.controller = AdaptiveController(
            identity(config), spec.method if spec is not None else None,
            spec.num_speculative_tokens if spec is not None else 0, config.state_dir,
            LatencyTargets(config.target_itl_ms, config.target_ttft_ms))
        self._step_start = 0.0
        self._proposing = 0.0  # seconds the last step spent proposing (and choosing) the next step's drafts
        self._policy: str | None = None  # the gate's policy for this step (None: not asked)
        self._next_policy: str | None = None  # and for the next one
        self._trace: StepTrace | None = None  # what this step's drafts were (offered, the default's ask)
        self._next_trace: StepTrace | None = None
        self._accepted = 0  # draft tokens accepted in this step
        self._chunks: tuple[StepShape, int, int] | None = None  # this step's decodes, chunk tokens and pairs
        self._refreshed = 0.0

    @property
    def uses_cost_model(self) -> bool:
        """Decisions read the cost model (speculation or latency targets): worth calibrating at start."""
        targets = self.config.target_itl_ms is not None or self.config.target_ttft_ms is not None
        return self.controller.method is not None or targets

    def graph_batch_sizes(self) -> tuple[int, ...] | None:
        """CUDA-graph buckets from the batch sizes the saved state has seen, or None (the default buckets)."""
        if not self.controller.batch_sizes:
            return None
        sizes = choose_graph_batch_sizes(self.controller.batch_sizes, self.config.max_num_seqs, MAX_CUDA_GRAPHS)
        return tuple(sizes) or None

    def graph_draft_lengths(self) -> tuple[int, ...] | None:
        """Verification graphs' draft-length buckets from the longest drafts of the verifying steps the saved state
        has seen (the same choice as the batch sizes'), or None (the default buckets)."""
        longest = self.controller.max_draft_tokens
        if not self.controller.verified_lengths or not longest:
            return None
        lengths = choose_graph_batch_sizes(self.controller.verified_lengths, longest, MAX_DRAFT_LENGTH_BUCKETS)
        return tuple(lengths) or None

    def calibrate(self, runner: ModelRunner) -> None:
        """Time a few synthetic steps (their tokens live in the padding block, which no request owns) so the cost
        model is ready before the first request; skipped when the saved state already has one."""
        if self.controller.cost.ready or not self.uses_cost_model:
            return
        start = time.perf_counter()
        replicas = self.config.parallel.data_parallel_size

        def run(shape: StepShape) -> float:
            step = synthetic_step(shape, runner.num_blocks, self.config.block_size, self.config.max_model_len)
            begin = time.perf_counter()
            runner.executor.execute_model([step] * replicas)
            return time.perf_counter() - begin

        c = self.config
        self.controller.calibrate(run, c.max_num_seqs, c.max_num_batched_tokens, c.block_size)
        logger.info("adaptive: cost model calibrated in %.1f s: %s", time.perf_counter() - start,
                    {k: f"{v:.2e}" for k, v in self.controller.cost.coefficients().items()})

    # ---- a step ----
    def budget(self, scheduler: Scheduler) -> int | None:
        """The next step's token budget for this replica under the latency targets (None: the configured one)."""
        if self.config.target_itl_ms is None and self.config.target_ttft_ms is None:
            return None
        decodes = [r for r in scheduler.running if not r.is_prefilling]
        shape = StepShape(sum(1 + (len(r.draft) if r.draft is not None else 0) for r in decodes), len(decodes),
                          sum(r.num_tokens for r in decodes))
        prefill = _next_prefill(scheduler)
        wait = time.monotonic() - prefill.arrival_time if prefill is not None else 0.0
        left = prefill.num_tokens - prefill.num_computed_tokens if prefill is not None else 0
        context = prefill.num_computed_tokens if prefill is not None else 0
        return self.controller.token_budget(shape, self.config.max_num_batched_tokens, wait, left, context)

    def begin_step(self) -> None:
        self._step_start = time.perf_counter()
        self._policy, self._next_policy = self._next_policy, None
        self._trace, self._next_trace = self._next_trace, None
        self._accepted = 0

    def end_step(self, plans: list[SchedulerOutput], shape: StepShape, proposing: float) -> None:
        """After postprocessing: the step's measured time into the cost model. A step proposes the next step's drafts
        (`proposing` seconds), and that time belongs to the step that verifies them; a step that verifies none is
        measured without it (the proposer ran before the choice not to verify, which saved none of it). Counted where
        it was spent, or in a plain step, it made plain steps look dearer the more the chooser drafted (it fed on
        itself). The drafting gate, which weighs drafting as a whole, scores the step with all of it."""
        decode_batch = max((sum(1 for s in plan.scheduled if s.num_tokens - s.num_draft_tokens == 1) for plan in plans),
                           default=0)
        draft_length = max((s.num_draft_tokens for plan in plans for s in plan.scheduled), default=0)
        own = time.perf_counter() - self._step_start - proposing
        seconds = own + (self._proposing if shape.verifying else 0.0)
        decodes = None
        if self._chunks is not None:
            self.controller.observe_chunk(*self._chunks, seconds)
            decodes = self._chunks[0]
        part = decodes if decodes is not None else shape
        tokens = part.sequences + self._accepted
        trace = self._trace or StepTrace()
        trace.decodes, trace.verified, trace.accepted = part.sequences, part.draft_tokens, self._accepted
        self.controller.observe_step(shape, seconds, decode_batch, self._policy, tokens, own + self._proposing,
                                     decodes, trace, draft_length)
        self._proposing = proposing

    def shape(self, plans: list[SchedulerOutput]) -> StepShape:
        """What the scheduled step computes (before postprocessing moves the requests on); a step with prefill
        chunks also notes its decodes' part and its chunks' tokens and attention pairs, for what chunks cost."""
        items = [s for plan in plans for s in plan.scheduled]
        chunks = [s for s in items if s.num_tokens - s.num_draft_tokens > 1]
        self._chunks = None
        if chunks:
            decodes = _shape_of([s for s in items if s.num_tokens - s.num_draft_tokens == 1])
            chunked = _shape_of(chunks)
            self._chunks = (decodes, chunked.query_tokens, chunked.pairs)
        return _shape_of(items)

    # ---- speculation ----
    def policy(self, requests: list[Request], schedulers: list[Scheduler]) -> str:
        """Which drafting policy the next step runs for these decoding requests (adaptive/gate.py): "default" (the
        fixed setting's lengths), "adaptive" or "plain", told whether the schedulers will likely add a prefill chunk
        to it; the fixed default where the gate has nothing to go by yet."""
        beside_chunk = any(self._next_chunk(s) is not None for s in schedulers)
        self._next_policy = self.controller.policy(len(requests), beside_chunk)
        return self._next_policy or "default"

    def offered(self, offered: int, default_asked: int) -> None:
        """The draft tokens proposed for the next step, and what the fixed default would have asked for."""
        self._next_trace = StepTrace(self._next_policy, offered=offered, default_asked=default_asked)
        self.controller.note_offer(offered, default_asked)

    def draft_lengths(self, requests: list[Request], limits: list[int], schedulers: list[Scheduler],
                      probs: list[list[float] | None] | None = None) -> list[int]:
        """Per decoding request, its draft length by goodput within its limit; `probs`: each request's drafted
        nodes' probabilities, where its proposer has them (then they, not its history, say what will be accepted)."""
        return self.controller.draft_lengths(*self._asks(requests, limits, schedulers, probs))

    def draft_caps(self, requests: list[Request], limits: list[int], schedulers: list[Scheduler]) -> list[int]:
        """Per decoding request, the longest draft worth proposing within its limit."""
        return self.controller.draft_caps(*self._asks(requests, limits, schedulers))

    def _asks(self, requests: list[Request], limits: list[int], schedulers: list[Scheduler],
              probs: list[list[float] | None] | None = None) -> tuple[list[DraftAsk], StepShape, StepShape | None]:
        """The asks, the next step as expected, and the decodes alone where that step also carries a prefill chunk."""
        probs = probs if probs is not None else [None] * len(requests)
        asks = [DraftAsk(r.seq_id, r.workload, limit, r.num_tokens, p) for r, limit, p in zip(requests, limits, probs)]
        step = self.expected_step(requests, schedulers)
        return asks, step, self.expected_step(requests, []) if step.sequences > len(requests) else None

    def expected_step(self, requests: list[Request], schedulers: list[Scheduler]) -> StepShape:
        """The next step as expected before its drafts are chosen: the decoding requests' one token each and the
        prefill chunks the schedulers will likely add (drafts beside a chunk cost differently from drafts beside
        decodes alone); with no schedulers, the decodes alone."""
        chunks = [chunk for chunk in (self._next_chunk(s) for s in schedulers) if chunk is not None]
        decode_context = sum(r.num_tokens + 1 for r in requests)
        return StepShape(len(requests) + sum(n for n, _ in chunks), len(requests) + len(chunks),
                         decode_context + sum(n + c for n, c in chunks),
                         attention_pairs=decode_context + sum(chunk_pairs(n, c) for n, c in chunks), draft_sequences=0)

    def _next_chunk(self, scheduler: Scheduler) -> tuple[int, int] | None:
        """(tokens, cached context) of the prefill chunk the scheduler's next step likely carries: a running prompt's
        next chunk, else the oldest waiting prompt's first if there is room for it."""
        prefill = _next_prefill(scheduler)
        if prefill is None:
            return None
        if scheduler.waiting and prefill is scheduler.waiting[0] and len(scheduler.running) >= self.config.max_num_seqs:
            return None  # a waiting prompt with no room to be admitted
        decodes = sum(1 for r in scheduler.running if not r.is_prefilling)
        tokens = min(prefill.num_tokens - prefill.num_computed_tokens, self.config.max_num_batched_tokens - decodes)
        return (tokens, prefill.num_computed_tokens) if tokens > 0 else None

    def record_draft(self, request: Request, draft_len: int, accepted: int) -> None:
        self._accepted += accepted
        self.controller.record_draft(request.seq_id, request.workload, draft_len, accepted)

    # ---- sessions and retention ----
    def request_added(self, request: Request) -> None:
        if request.session is not None and request.index == 0:
            self.controller.session_arrived(request.session, time.monotonic())

    def returned(self, scheduler: Scheduler) -> None:
        """Admitted requests that found a finished turn's protected blocks: those turns' return gaps."""
        now = time.monotonic()
        for origin in scheduler.returned_turns:
            self.controller.session_arrived(origin, now)
        scheduler.returned_turns.clear()

    def request_finished(self, request: Request, blocks: BlockManager) -> None:
        """A finished turn that carries a session key or ends in a tool call keeps its blocks protected for its
        class's learned hold time."""
        self.controller.forget(request.seq_id)
        if request.finish_reason == "abort":
            return
        tool_call = any(t in self.tool_call_ids for t in request.output_token_ids)
        if request.session is None and not tool_call:
            return
        origin = request.session if request.session is not None else f"turn:{request.seq_id}"
        workload = f"{request.workload}/{'tool_call' if tool_call else 'session'}"
        now = time.monotonic()
        hold = self.controller.turn_finished(origin, workload, now)
        blocks.protect(blocks.full_block_keys(request), now + hold, origin)

    def expire(self, schedulers: list[Scheduler]) -> None:
        now = time.monotonic()
        for scheduler in schedulers:
            scheduler.blocks.expire(now)

    # ---- what it shows and keeps ----
    def refresh(self, schedulers: list[Scheduler], force: bool = False) -> None:
        """Rebuild the snapshot (at most every REFRESH_S: a step of a small model takes a few milliseconds) and save
        the state now and then."""
        now = time.monotonic()
        if not force and now - self._refreshed < REFRESH_S:
            return
        self._refreshed = now
        managers = [s.blocks for s in schedulers]
        hits = sum(bm.prefix_hits for bm in managers)
        tiers = [bm.tiers.counters for bm in managers if bm.tiers is not None]
        host, disk = sum(c.host_hit_tokens for c in tiers), sum(c.disk_hit_tokens for c in tiers)
        self.controller.refresh_snapshot({
            "protected_blocks": sum(len(bm.protected) for bm in managers),
            "retention_hit_tokens": sum(bm.retention_hits for bm in managers),
            "prefix_hit_rate": hits / max(1, sum(bm.prefix_queries for bm in managers)),
            # prompt tokens found cached, by where they were found (host and disk: the KV tiers, engine/kv_tiers.py)
            "prefix_hit_tokens": {"device": max(hits - host - disk, 0), "host": host, "disk": disk},
        })
        self.controller.maybe_save()

    def save(self) -> None:
        self.controller.save()


def _next_prefill(scheduler: Scheduler) -> Request | None:
    """The prompt the scheduler's next step would prefill: a running one's next chunk, else the oldest waiting one."""
    running = next((r for r in scheduler.running if r.is_prefilling), None)
    return running or (scheduler.waiting[0] if scheduler.waiting else None)


def _shape_of(items: list[ScheduledRequest]) -> StepShape:
    return StepShape(sum(s.num_tokens for s in items), len(items),
                     sum(s.request.num_computed_tokens + s.num_tokens for s in items),
                     sum(s.num_draft_tokens for s in items),
                     sum(chunk_pairs(s.num_tokens, s.request.num_computed_tokens) for s in items),
                     sum(1 for s in items if s.num_draft_tokens))


def synthetic_step(shape: StepShape, padding_block: int, block_size: int, max_model_len: int) -> StepInput:
    """A step of `shape` whose every token is written to the padding block and whose context reads it repeatedly.
    Its draft tokens are spread over its first `shape.verifying` sequences, each a chain whose every row is verified
    (logits), as a verification step's drafts; the rest run their share of the other tokens."""
    drafting = shape.verifying
    per_draft = shape.draft_tokens // drafting if drafting else 0
    per_seq = max(1, (shape.query_tokens - shape.draft_tokens) // shape.sequences)
    context = min(max(per_seq + per_draft, shape.context_tokens // shape.sequences), max_model_len - 1)
    tokens, positions, slots, query_lens, rows, trees = [], [], [], [], [], []
    for s in range(shape.sequences):
        drafted = s < drafting
        count = min(per_seq + (per_draft if drafted else 0), context)
        span = range(context - count, context)
        first = len(tokens)
        tokens += [0] * count
        positions += list(span)
        slots += [padding_block * block_size + p % block_size for p in span]
        query_lens.append(count)
        rows += list(range(first, len(tokens))) if drafted else [len(tokens) - 1]
        trees.append(torch.ones(count, count, dtype=torch.bool).tril())
    table = [padding_block] * -(-context // block_size)
    return StepInput(tokens, positions, slots, query_lens, [context] * shape.sequences, [table] * shape.sequences, rows,
                     trees if drafting else None)
