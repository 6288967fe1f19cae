"""LLMEngine: requests in, outputs out. One step = schedule, run, postprocess."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reasoning_engine.adaptive.state import check_state_dir
from reasoning_engine.config import EngineConfig
from reasoning_engine.engine.detokenizer import IncrementalDetokenizer
from reasoning_engine.cache_groups import group_names
from reasoning_engine.engine.kv_cache import BlockManager, check_cache_salt, prefix_hashes
from reasoning_engine.engine.executor import start_executor
from reasoning_engine.engine.kv_tiers import TierIndex, all_ranks_found, replica_folder, scan_disk
from reasoning_engine.engine.model_runner import ModelRunner, StepResult
from reasoning_engine.engine.request import Request, RequestStatus
from reasoning_engine.engine.scheduler import Scheduler
from reasoning_engine.engine.state_cache import StateCache
from reasoning_engine.engine.tuning import EngineTuner
from reasoning_engine.models.chat_templates import bundled_chat_template
from reasoning_engine.multimodal.inputs import MediaItem
from reasoning_engine.multimodal.processors import load_media_processor
from reasoning_engine.outputs import CompletionOutput, RequestOutput
from reasoning_engine.sampling_params import SamplingParams
from reasoning_engine.speculative.decoder import TEXT_METHODS, SpeculativeConfig, SpeculativeDecoder
from reasoning_engine.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


def load_tokenizer(path: str | Path, model_type: str | None = None) -> Any:
    """The checkpoint's HF tokenizer, or None for a folder without tokenizer files (token-id prompts only). A
    tokenizer without a chat template gets ours for its model type where we have one (DeepSeek-V3.2, V4)."""
    folder = Path(path)
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = bundled_chat_template(model_type)
    return tokenizer


@dataclass
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    free_blocks: int
    total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decode: dict[str, float] = field(default_factory=dict)
    adaptive: dict[str, float] = field(default_factory=dict)  # the adaptive engine's gauges
    adaptive_counters: dict[str, float] = field(default_factory=dict)  # and its counters
    # vision encoder (multimodal models): items encoded, items found already encoded, seconds spent (rank 0's)
    encoder_cache_misses: int = 0
    encoder_cache_hits: int = 0
    encoder_seconds: float = 0.0
    # hybrid models: the linear-attention state group (engine/state_cache.py), slots in use and snapshots kept
    state_cache_usage: float | None = None
    state_cache_snapshots: int | None = None
    # per KV cache group (labelled "full", "sliding", ...: cache_groups.group_names), the share of its pool it holds
    kv_cache_group_usage: dict[str, float] = field(default_factory=dict)
    # KV tiers (kv_offload_size, engine/kv_tiers.py): prompt tokens copied back from host memory and read from disk,
    # blocks written to each tier, disk files skipped as damaged; bytes held now (rank 0's)
    kv_offload_host_hits: int = 0
    kv_offload_disk_hits: int = 0
    kv_offload_host_stored_blocks: int = 0
    kv_offload_disk_stored_blocks: int = 0
    kv_offload_damaged_entries: int = 0
    kv_offload_host_bytes: int = 0
    kv_offload_disk_bytes: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model
        self.tokenizer = load_tokenizer(config.tokenizer or config.model.path, config.model.model_type)
        self.media_processor = (load_media_processor(config.model.path, self.tokenizer)
                                if self.tokenizer is not None else None)
        spec_config = SpeculativeConfig.from_dict(config.speculative_config) if config.speculative_config else None
        for state_dir, name in ((config.state_dir, "state_dir"),
                                (spec_config and spec_config.state_dir, "speculative_config.state_dir")):
            if state_dir:
                check_state_dir(state_dir, name)
        self.tuner = EngineTuner(config, spec_config, self._tool_call_ids()) if config.adaptive else None
        if self.tuner is not None and config.device.type == "cuda":
            config = self.config = dataclasses.replace(config, cuda_graph_batch_sizes=self.tuner.graph_batch_sizes(),
                                                       cuda_graph_draft_lengths=self.tuner.graph_draft_lengths())
        self.groups: dict[str, list[Request]] = {}
        self.runner = ModelRunner(config, start_executor(config), self._replica_of)
        # one scheduler and KV cache per data-parallel replica (one without data parallelism)
        self.schedulers = [
            Scheduler(BlockManager(self.runner.pool_blocks, config.block_size, config.enable_prefix_caching,
                                   self.runner.worker.cache_groups),
                      config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                      self._state_cache(config))
            for _ in range(config.parallel.data_parallel_size)]
        for replica, scheduler in enumerate(self.schedulers):
            scheduler.blocks.tiers = self._tier_index(replica)
            self.runner.state_caches[replica] = scheduler.states
            self.runner.key_of[replica] = lambda request, i, blocks=scheduler.blocks: blocks._block_hash(
                request, i, request.all_token_ids)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.eos_token_ids = frozenset(self._eos_ids())
        self.think_start_id = self._token_id("<think>")
        self.think_end_id = self._token_id("</think>")
        self.model_config.max_model_len = config.max_model_len
        self.model_config.think_end_token_id = self.think_end_id
        self.num_preemptions = 0
        self._grammars: GrammarCompiler | None = None
        self._ids = itertools.count()
        self.spec = (SpeculativeDecoder(spec_config, self.runner.drafters, caller_lengths=self.tuner is not None,
                                        vocab_size=self.model_config.vocab_size)
                     if spec_config is not None else None)
        if self.tuner is not None:
            self.tuner.calibrate(self.runner)

    def _tier_index(self, replica: int) -> TierIndex | None:
        """A replica's host / disk tier index (kv_offload_size), or None: off, or a model the tiers do not cover."""
        config, store = self.config, self.runner.worker.tier_store
        if not config.kv_offload_size:
            return None
        if store is None:
            logger.warning("kv_offload_size: the KV tiers cover models whose cache is one full-attention group; "
                           "this model's cache groups (%s) or linear-attention state are not tiered, so the tiers "
                           "are off", ", ".join(group_names(self.runner.worker.cache_groups)))
            return None
        host_blocks = config.kv_offload_size // store.entry_bytes
        if host_blocks < 1:
            raise ValueError(f"kv_offload_size: {config.kv_offload_size} bytes hold no block "
                             f"({store.entry_bytes} bytes each on this model)")
        disk = (scan_disk(replica_folder(config.kv_offload_dir, store.identity, replica))
                if config.kv_offload_dir else [])
        executor = self.runner.executor
        return TierIndex(host_blocks, config.kv_offload_dir_size if config.kv_offload_dir else 0, store.file_bytes,
                         disk, lambda ops, keys, blocks: all_ranks_found(
                             executor.gather("kv_tier_fetch", replica, ops, keys, blocks)))

    def _run_tier_ops(self) -> None:
        """Before the step: every rank of each replica runs the tier copies its scheduler planned, in order."""
        for replica, scheduler in enumerate(self.schedulers):
            tiers = scheduler.blocks.tiers
            if tiers is not None and tiers.ops:
                self.runner.executor.kv_tier_ops(replica, tiers.take_ops())

    def _state_cache(self, config: EngineConfig) -> StateCache | None:
        """A replica's linear-attention state slots (hybrid models), or None."""
        worker = self.runner.worker
        if not worker.linear_layers:
            return None
        return StateCache(worker.num_state_slots, config.max_num_seqs, config.block_size,
                          enable_prefix_caching=config.enable_prefix_caching)

    @property
    def model(self) -> torch.nn.Module:
        """The model (this process's shard of it, under tensor or expert parallelism)."""
        return self.runner.worker.model

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of the first (without data parallelism, the only) replica."""
        return self.schedulers[0]

    @property
    def block_manager(self) -> BlockManager:
        return self.schedulers[0].blocks

    def _replica_of(self, seq_id: str) -> int:
        group_id, _, index = seq_id.rpartition("#")
        return self.groups[group_id][int(index)].replica

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler and cache, built at first use (it reads the whole vocabulary)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: this checkpoint has no tokenizer to compile a grammar against")
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._grammars

    def _pick_replica(self, token_ids: list[int], media: tuple[MediaItem, ...], cache_salt: str | None) -> int:
        """Data parallelism: the replica already holding the longest prefix of the prompt (under its salt) in its
        cache, then the least loaded (fewest unfinished requests)."""
        if len(self.schedulers) == 1:
            return 0
        hashes = prefix_hashes(token_ids, self.config.block_size, media, cache_salt)
        return max(range(len(self.schedulers)), key=lambda r: (
            self.schedulers[r].blocks.cached_prefix_blocks(hashes),
            -len(self.schedulers[r].running) - len(self.schedulers[r].waiting), -r))

    def shutdown(self) -> None:
        """Keep what was learned, then stop the other ranks' workers, if any; the engine cannot step afterwards."""
        self.save_state()
        self.runner.executor.shutdown()

    def save_state(self) -> None:
        """Write the learned state (adaptive controller, suffix proposer) to the state directory, if one is set."""
        if self.tuner is not None:
            self.tuner.save()
        if self.spec is not None:
            self.spec.save_state()

    def adaptive_snapshot(self) -> dict[str, Any]:
        """What the adaptive engine measured and decided (GET /v1/engine/adaptive), as of its last refresh (a
        quarter of a second at most behind the engine, or the last step when it went idle)."""
        if self.tuner is None:
            return {"enabled": False}
        return self.tuner.controller.snapshot_data or {"enabled": True}

    def kv_events(self, after: int = 0, replica: int = 0, limit: int = 1000) -> dict[str, Any]:
        """Data-parallel replica `replica`'s prefix-cache events numbered after `after`, at most `limit`
        (GET /v1/kv_events; engine/kv_events.py)."""
        if not 0 <= replica < len(self.schedulers):
            raise ValueError(f"replica must be in [0, {len(self.schedulers)}), got {replica}")
        return self.schedulers[replica].blocks.events.since(after, limit)

    def _tool_call_ids(self) -> set[int]:
        """Single tokens that open a tool call in the formats the server parses (Kimi K2, Hermes)."""
        markers = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", "<|tool_call_begin|>", "<tool_call>")
        return {i for i in (self._token_id(m) for m in markers) if i is not None}

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_config = self.model_config.path / "generation_config.json"
        if gen_config.is_file():
            import json

            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            ids |= {eos} if isinstance(eos, int) else set(eos or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _token_id(self, token: str) -> int | None:
        if self.tokenizer is None:
            return None
        ids = self.tokenizer.convert_tokens_to_ids([token])
        return ids[0] if ids and ids[0] != self.tokenizer.unk_token_id and ids[0] is not None else None

    # ---- requests ----
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this checkpoint has no tokenizer; pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, capture_logits: bool = False, session_id: str | None = None,
                    workload: str = "default", media: tuple[MediaItem, ...] | None = None) -> str:
        """`session_id` (an agent's conversation, e.g. the OpenAI `user` or `prompt_cache_key`) and `workload` (a
        class such as "agent" or "chat") tell the adaptive engine what to keep and what to expect. `media`: the
        items of a prompt whose placeholders `expand_media` already expanded (AsyncLLM does it off the engine
        thread); otherwise the prompt's `multi_modal_data` is expanded here. A prompt dict's `cache_salt` keeps its
        prefix-cache blocks apart from those of prompts with another salt or none."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        cache_salt = prompt_cache_salt(prompt)
        text, token_ids = self.tokenize(prompt)
        if media is None:
            token_ids, media = self.expand_media(prompt, token_ids)
        self.validate(token_ids, params, media)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        thinking = self._starts_in_thinking(token_ids)
        replica = self._pick_replica(token_ids, media, cache_salt)
        grammar = self.grammars.matcher(params.structured_outputs) if params.structured_outputs is not None else None
        bad_word_ids = self._bad_word_ids(params.bad_words) if params.bad_words else []
        group = []
        for index in range(params.n):
            request = Request(seq_id=f"{request_id}#{index}", group_id=request_id, index=index, prompt=text,
                              prompt_token_ids=token_ids, params=params, eos_token_ids=self.eos_token_ids,
                              arrival_time=arrival, thinking=thinking, capture_logits=capture_logits, replica=replica,
                              session=session_id, workload=workload, media=media, cache_salt=cache_salt,
                              grammar=grammar.fork() if grammar is not None and index else grammar,
                              bad_word_ids=bad_word_ids)
            group.append(request)
            if self.spec is not None:
                self.spec.start(request.seq_id, token_ids)
            self.detokenizers[request.seq_id] = IncrementalDetokenizer(
                self.tokenizer, token_ids, params.skip_special_tokens, params.stop_strings, params.include_stop_str_in_output)
            self.schedulers[replica].add(request)
            if self.tuner is not None:
                self.tuner.request_added(request)
        self.groups[request_id] = group
        return request_id

    def expand_media(self, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], tuple[MediaItem, ...]]:
        """A prompt dict's `multi_modal_data` ({"image": one or a list, "video": one or a list}, vLLM's shape):
        each placeholder in the prompt becomes its run of tokens, and each image or video chunk a `MediaItem`."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return token_ids, ()
        unknown = sorted(set(data) - {"image", "video"})
        if unknown:
            raise ValueError(f"multi_modal_data: unknown media kind {unknown[0]!r} (image, video)")
        if self.media_processor is None:
            if self.runner.worker.vision is not None:
                raise ValueError("multi_modal_data: this checkpoint has no tokenizer to place media tokens with")
            raise ValueError(f"multi_modal_data: {self.model_config.model_type} has no vision tower; "
                             f"this model takes text only")
        media = {kind: _media_list(data.get(kind)) for kind in ("image", "video")}
        for kind, items in media.items():
            limit = self.config.limit_mm_per_prompt.get(kind)
            if limit is not None and len(items) > limit:
                raise ValueError(f"multi_modal_data: {len(items)} {kind}s in one prompt, at most {limit} "
                                 f"(limit_mm_per_prompt)")
        try:
            token_ids, items = self.media_processor.expand(token_ids, media["image"], media["video"])
        except (ValueError, TypeError) as exc:  # named for the caller's error (the server's `param`)
            raise ValueError(f"multi_modal_data: {exc}") from exc
        return token_ids, tuple(items)

    def validate(self, token_ids: list[int], params: SamplingParams, media: tuple[MediaItem, ...] = ()) -> None:
        """Raise ValueError naming the field when a request cannot run on this model."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        placeholders = {p for item in media for p in range(item.offset, item.end)}
        bad = [t for p, t in enumerate(token_ids) if not 0 <= t < vocab and p not in placeholders]
        if params.prompt_logprobs is not None and any(token_ids[p] >= vocab for p in placeholders):
            raise ValueError("prompt_logprobs: not available for prompts with video (its placeholder token lies "
                             "outside the vocabulary)")
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(f"prompt is {len(token_ids)} tokens, the model's context is {limit} (max_model_len)")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > limit:
            raise ValueError(f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({limit})")
        self._validate_constraints(params)

    def _validate_constraints(self, params: SamplingParams) -> None:
        """Token ids within the vocabulary; a grammar that compiles against it (cached: add_request reuses it)."""
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab})")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words: this checkpoint has no tokenizer to encode them with")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as tokens, alone and after a space (how it appears mid-text), as vLLM encodes them."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _starts_in_thinking(self, token_ids: list[int]) -> bool:
        """The prompt opened a <think> section that it did not close (templates with thinking on)."""
        if self.think_start_id is None:
            return False
        for token in reversed(token_ids):
            if token == self.think_end_id:
                return False
            if token == self.think_start_id:
                return True
        return False

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop the request and free its blocks at once. Returns its final output (what it produced so far, each
        unfinished sample with finish_reason "abort"), so a caller streaming it can end the stream; None when the id
        is unknown or already finished."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for request in group:
            if not request.is_finished:
                self.schedulers[request.replica].finish(request)
                self._finish(request, "abort", None)
                if self.spec is not None:
                    self.spec.finish(request.seq_id, learn=False, token_ids=request.all_token_ids)
                if self.tuner is not None:
                    self.tuner.controller.forget(request.seq_id)
        return self._output(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(scheduler.has_unfinished for scheduler in self.schedulers)

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        tuner = self.tuner
        if tuner is not None:
            tuner.begin_step()
            plans = [scheduler.schedule(tuner.budget(scheduler)) for scheduler in self.schedulers]
        else:
            plans = [scheduler.schedule() for scheduler in self.schedulers]
        self.num_preemptions += sum(len(plan.preempted) for plan in plans)
        self._run_tier_ops()
        if not any(plan.scheduled for plan in plans):
            return []
        shape = tuner.shape(plans) if tuner is not None else None
        now = time.monotonic()
        forced = [{i: self.think_end_id for i, s in enumerate(plan.scheduled) if self._budget_spent(s.request)}
                  for plan in plans]
        results = self.runner.execute([plan.scheduled for plan in plans], forced)
        touched: dict[str, None] = {}
        for plan, replica_results in zip(plans, results):
            for item, result in zip(plan.scheduled, replica_results):
                request = item.request
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = now
                self._postprocess(request, item.num_tokens, result)
                touched[request.group_id] = None
        for scheduler in self.schedulers:
            if scheduler.states is not None:
                scheduler.states.end_step()
        proposing = 0.0
        if self.spec is not None:
            started = time.perf_counter()
            self._propose_drafts()
            proposing = time.perf_counter() - started
        if tuner is not None:
            for scheduler in self.schedulers:
                tuner.returned(scheduler)
            tuner.expire(self.schedulers)
            tuner.end_step(plans, shape, proposing)
            tuner.refresh(self.schedulers, force=not self.has_unfinished_requests())
        if self.spec is not None:
            self.spec.maybe_save()
        return [self._output(group_id) for group_id in touched if group_id in self.groups]

    def _propose_drafts(self) -> None:
        """Give each decoding request a draft for the next step, unless its replica's batch is too large to gain
        from it."""
        running: list[Request] = []
        cap = self.spec.batch_cap
        backed_off: set[str] = set()  # requests of replicas where the fixed setting drafts nothing (too many running)
        for scheduler in self.schedulers:
            if cap is not None and len(scheduler.running) > cap:
                for request in scheduler.running:
                    request.draft = None
            else:
                running += scheduler.running
                if len(scheduler.running) > self.spec.static_batch_cap:
                    backed_off.update(r.seq_id for r in scheduler.running)
        asking: list[Request] = []
        limits: list[int] = []
        for request in running:
            request.draft = None
            if request.is_prefilling or request.params.prompt_logprobs is not None:
                continue
            limit = self.config.max_model_len - request.num_tokens - 1
            if request.params.max_tokens is not None:
                limit = min(limit, request.params.max_tokens - len(request.output_token_ids) - 1)
            budget = request.params.thinking_token_budget
            if budget is not None and request.thinking:
                limit = min(limit, budget - request.thinking_tokens - 1)  # the forced </think> is never drafted over
            asking.append(request)
            limits.append(limit)
        keep = None
        offered = 0  # draft tokens the proposer made, before the adaptive engine kept part of them
        # seeded sampling needs no care here: its draws do not depend on drafts (speculative/verify.py)
        if self.tuner is not None:
            static = [min(self.spec.draft_len.get(r.seq_id, 1), n) for r, n in zip(asking, limits)]
            default = [0 if r.seq_id in backed_off else s for r, s in zip(asking, static)]
            policy = self.tuner.policy(asking, self.schedulers)  # adaptive/gate.py
            if policy == "default":  # the fixed setting: what the engine drafts without the adaptive engine
                limits = default
            elif policy == "plain":
                limits = [0] * len(asking)
            elif self.spec.config.method in TEXT_METHODS:
                # text proposers say how far they are confident, so each request drafts up to the longest that could
                # pay (its cap), then the goodput-optimal part of each real draft is verified; the cap spares the
                # proposer's work where no draft would be verified
                caps = self.tuner.draft_caps(asking, limits, self.schedulers)
                limits = [min(n, c) for n, c in zip(limits, caps)]

                def keep(drafts: list) -> list[int]:
                    nonlocal offered
                    offered = sum(len(d) for d in drafts)
                    return self.tuner.draft_lengths(asking, [len(d) for d in drafts], self.schedulers,
                                                    [d.probs for d in drafts])
            else:  # a draft model pays per drafted position: choose the lengths first
                limits = self.tuner.draft_lengths(asking, limits, self.schedulers)
            if keep is None and not any(limits):
                self.tuner.offered(0, sum(default))
                return
            drafts = self.spec.propose_batch([(r.seq_id, r.all_token_ids, n) for r, n in zip(asking, limits)], keep)
            self.tuner.offered(offered if keep is not None else sum(len(d) for d in drafts), sum(default))
        elif not any(limits):
            return  # nothing to draft: spare building every request's sequence
        else:
            drafts = self.spec.propose_batch([(r.seq_id, r.all_token_ids, n) for r, n in zip(asking, limits)])
        chains_only = not getattr(self.model, "draft_trees", True)
        for request, draft in zip(asking, drafts):
            if chains_only and len(draft):
                draft = draft.first_path()
            if request.grammar is not None and len(draft):
                # nodes the grammar rejects could never be accepted: do not spend verification on them
                draft = draft.subset(request.grammar.walk_draft(draft.token_ids, draft.parents, request.thinking,
                                                                self.think_end_id))
            request.draft = draft if len(draft) else None

    def _budget_spent(self, request: Request) -> bool:
        budget = request.params.thinking_token_budget
        return budget is not None and request.thinking and request.thinking_tokens >= budget and self.think_end_id is not None

    def _postprocess(self, request: Request, num_tokens: int, result: StepResult) -> None:
        scheduler = self.schedulers[request.replica]
        blocks_before = request.num_computed_tokens // self.config.block_size
        if result.accepted_nodes is not None:
            self._keep_accepted(request, result.accepted_nodes, result.token_ids)
        else:
            request.num_computed_tokens += num_tokens
        if result.prompt_logprobs:
            request.prompt_logprobs.extend(result.prompt_logprobs)
        if not result.token_ids:
            scheduler.blocks.cache_full_blocks(request, blocks_before)
            return
        if result.logits is not None:
            request.captured_logits = result.logits
        for i, token in enumerate(result.token_ids):
            self._append_token(request, token, result.logprob_values[i], result.logprobs[i])
            if request.is_finished:
                break
        if result.accepted_nodes is not None and scheduler.states is not None:
            self.runner.commit_state(request.replica, request, request.num_computed_tokens - 1 - len(result.accepted_nodes),
                                     result.accepted_nodes)
        scheduler.blocks.cache_full_blocks(request, blocks_before)
        if request.is_finished:
            scheduler.finish(request)
            if self.spec is not None:
                self.spec.finish(request.seq_id, learn=True, token_ids=request.all_token_ids)
            if self.tuner is not None:
                self.tuner.request_finished(request, scheduler.blocks)

    def _keep_accepted(self, request: Request, accepted: list[int], new_tokens: list[int]) -> None:
        """After verification: the root and the accepted draft nodes hold valid K/V; move tree nodes that are not
        already in place to consecutive slots, then give back blocks that only held rejected nodes. `new_tokens`
        (accepted draft tokens and the target's next token) is what the proposer learns from."""
        draft, root = request.draft, request.num_computed_tokens
        moves = [(root + 1 + node, root + 1 + i) for i, node in enumerate(accepted) if node != i]
        if moves:
            self.runner.move_kv(request.replica, request.block_tables, moves)
        request.num_computed_tokens = root + 1 + len(accepted)
        self.schedulers[request.replica].blocks.truncate(request, request.num_computed_tokens)
        if self.spec is not None:
            self.spec.record(request.seq_id, draft, accepted, new_tokens)
            request.spec_draft_tokens += len(draft)
            request.spec_accepted_tokens += len(accepted)
        if self.tuner is not None:
            self.tuner.record_draft(request, max(draft.depths()), len(accepted))
        request.draft = None

    def _append_token(self, request: Request, token: int, logprob: float, logprobs: dict | None) -> None:
        now = time.monotonic()
        request.output_token_ids.append(token)
        request.cumulative_logprob += logprob
        if request.logprobs is not None and logprobs is not None:
            request.logprobs.append(logprobs)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        constrained = request.constrained
        if request.thinking:
            if token == self.think_end_id:
                request.thinking = False
            else:
                request.thinking_tokens += 1
        elif token == self.think_start_id and request.grammar is None:
            request.thinking = True
        params = request.params
        allowed = request.grammar.accept(token) if constrained else True
        # stop strings, like EOS and stop_token_ids, count only from min_tokens on
        min_reached = len(request.output_token_ids) >= params.min_tokens
        ends_here = ((token in self.eos_token_ids and not params.ignore_eos)
                     or (token in params.stop_token_ids and min_reached))
        # the token that ends the output is in its token ids, not in its text (as vLLM; an end id of a plain
        # character would otherwise show), unless include_stop_str_in_output
        stop = None
        if not ends_here or params.include_stop_str_in_output:
            stop = self.detokenizers[request.seq_id].append([token], min_reached)
        if stop is not None:
            self._finish(request, "stop", stop)
        elif not allowed:  # only when bad_words banned every token the grammar allows: end it, not crash
            logger.warning("request %s: token %d is not allowed by its grammar; ending it", request.seq_id, token)
            self._finish(request, "stop", None)
        elif token in self.eos_token_ids and not params.ignore_eos:
            self._finish(request, "stop", None)
        elif constrained and request.grammar.is_terminated:
            self._finish(request, "stop", None)  # the grammar is complete (its stop token, even under ignore_eos)
        elif token in params.stop_token_ids and min_reached:
            self._finish(request, "stop", token)
        elif params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
            self._finish(request, "length", None)
        elif request.num_tokens >= self.config.max_model_len:
            self._finish(request, "length", None)

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None) -> None:
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.status = RequestStatus.FINISHED
        request.metrics.finished_time = time.monotonic()

    def _output(self, group_id: str) -> RequestOutput:
        group = self.groups[group_id]
        outputs = []
        for request in group:
            detok = self.detokenizers[request.seq_id]
            outputs.append(CompletionOutput(
                index=request.index,
                text=detok.visible_text(request.is_finished),
                token_ids=list(request.output_token_ids),
                cumulative_logprob=request.cumulative_logprob if request.params.logprobs is not None else None,
                logprobs=request.logprobs,
                finish_reason=request.finish_reason,
                stop_reason=request.stop_reason,
            ))
        first = group[0]
        finished = all(r.is_finished for r in group)
        out = RequestOutput(
            request_id=group_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids, outputs=outputs,
            finished=finished, num_cached_tokens=first.num_cached_tokens, prompt_logprobs=first.prompt_logprobs,
            metrics=first.metrics, spec_accepted_tokens=sum(r.spec_accepted_tokens for r in group),
            spec_draft_tokens=sum(r.spec_draft_tokens for r in group),
            num_image_tokens=sum(item.length for item in first.media if item.kind == "image"),
            num_video_tokens=sum(item.length for item in first.media if item.kind == "video"))
        if first.capture_logits:
            out.extra["logits"] = first.captured_logits
        if finished:
            for request in group:
                self.detokenizers.pop(request.seq_id, None)
            del self.groups[group_id]
        return out

    def stats(self) -> EngineStats:
        """Over every data-parallel replica: counts summed, KV usage their mean."""
        managers = [scheduler.blocks for scheduler in self.schedulers]
        adaptive, adaptive_counters = self._adaptive_metrics()
        return EngineStats(
            num_requests_running=sum(len(s.running) for s in self.schedulers),
            num_requests_waiting=sum(len(s.waiting) for s in self.schedulers),
            kv_cache_usage=sum(bm.usage for bm in managers) / len(managers),
            kv_cache_group_usage={name: sum(bm.group_usage()[g] for bm in managers) / len(managers)
                                  for g, name in enumerate(group_names(managers[0].groups))},
            free_blocks=sum(bm.num_free_blocks for bm in managers), total_blocks=sum(bm.num_blocks for bm in managers),
            prefix_cache_queries=sum(bm.prefix_queries for bm in managers),
            prefix_cache_hits=sum(bm.prefix_hits for bm in managers), num_preemptions=self.num_preemptions,
            spec_decode=self.spec.stats_dict() if self.spec is not None else {},
            adaptive=adaptive, adaptive_counters=adaptive_counters,
            encoder_cache_misses=sum(plan.misses for plan in self.runner.encoder_caches),
            encoder_cache_hits=sum(plan.hits for plan in self.runner.encoder_caches),
            encoder_seconds=self.runner.worker.encoder_seconds,
            **self._state_cache_stats(), **self._tier_stats())

    def _tier_stats(self) -> dict[str, int]:
        indexes = [scheduler.blocks.tiers for scheduler in self.schedulers if scheduler.blocks.tiers is not None]
        if not indexes:
            return {}
        entry = self.runner.worker.tier_store.entry_bytes

        def total(name: str) -> int:
            return sum(getattr(index.counters, name) for index in indexes)

        return {"kv_offload_host_hits": total("host_hit_tokens"), "kv_offload_disk_hits": total("disk_hit_tokens"),
                "kv_offload_host_stored_blocks": total("host_stored_blocks"),
                "kv_offload_disk_stored_blocks": total("disk_stored_blocks"),
                "kv_offload_damaged_entries": total("damaged_entries"),
                "kv_offload_host_bytes": sum(len(index.host) for index in indexes) * entry,
                "kv_offload_disk_bytes": sum(index.disk_used for index in indexes)}

    def _state_cache_stats(self) -> dict[str, float | int]:
        caches = [scheduler.states for scheduler in self.schedulers if scheduler.states is not None]
        if not caches:
            return {}
        return {"state_cache_usage": sum(c.usage() for c in caches) / len(caches),
                "state_cache_snapshots": sum(c.num_snapshots for c in caches)}

    def _adaptive_metrics(self) -> tuple[dict[str, float], dict[str, float]]:
        """Numbers of the adaptive snapshot for Prometheus: gauges (the cost model, the latest choices, blocks kept
        now, the cost model's error by kind of step) and counters (steps by the policy that ran them and by what was
        decided for them, draft tokens offered / verified / accepted beside what the fixed default would have asked
        for, turns kept, tokens reused from kept blocks), so an operator sees how often drafting was verified, gated
        off or held back to measure plain steps, and whether the adaptive engine runs its own choices or the default."""
        snap = self.adaptive_snapshot()
        if not snap.get("enabled") or "cost_model" not in snap:
            return {}, {}
        gauges = {f"cost_seconds_per_{k}": v for k, v in snap["cost_model"]["seconds_per"].items()}
        gauges["draft_length_mean"] = snap["speculation"]["last_draft_lengths"]["mean"]
        if snap["batching"]["last_token_budget"] is not None:
            gauges["token_budget"] = snap["batching"]["last_token_budget"]
        gauges["protected_blocks"] = snap["retention"]["protected_blocks"]
        decided = snap["speculation"]["decided"]
        counters = {"decided_steps": decided["steps"], "verifying_steps": decided["verifying_steps"],
                    "gated_steps": decided["gated"], "plain_check_steps": decided["plain_checks"],
                    "probed_requests": decided["probes"], "chosen_draft_tokens": decided["draft_tokens"],
                    "protected_turns": snap["retention"]["turns_protected"],
                    "retention_hit_tokens": snap["retention"]["retention_hit_tokens"]}
        counters.update({f"{policy}_policy_steps": n for policy, n in snap["speculation"]["policy_steps"].items()})
        counters.update({f"{kind}_draft_tokens": n for kind, n in snap["speculation"]["draft_tokens"].items()})
        for kind, error in snap["cost_model"]["prediction_error"].items():
            gauges[f"cost_log_error_{kind}"] = error["log_abs"]
        return gauges, counters


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's: {"prompt_token_ids" or "prompt": ..., "cache_salt": "tenant-a"}), checked;
    None for a plain prompt or a dict without one."""
    return check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None


def _media_list(value: Any) -> list[Any]:
    """One item or a list of them (vLLM accepts both)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
