"""The engine's side of speculative decoding: which proposer, how long a draft, and the acceptance statistics.

Draft length, without the adaptive engine (adaptive/goodput.py picks lengths by measured cost and acceptance), adapts
per request: it doubles (up to num_speculative_tokens) while whole drafts are accepted and drops to one more than what
was accepted after a rejection, and speculation backs off entirely when the running batch is larger than
`max_batch_size` (16 unless set): verification then costs more than the extra tokens save. With the adaptive engine,
`max_batch_size` is only a cap, and only when set.

Proposers come in two kinds. Text proposers (ngram, lookup, suffix) draft from token sequences alone. Draft-model
proposers (mtp, eagle3) run a small network beside the target over its hidden states; the engine loads their
`DraftModel` here (`load_draft_models`), the model runner runs it and hands back a proposer. `hybrid` drafts with two
or more of either kind and keeps, per request and step, the draft expected to gain the most.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from reasoning_engine.speculative.draft import Draft, Proposer

if TYPE_CHECKING:
    import torch
    from torch import nn

    from reasoning_engine.batch import ForwardBatch
    from reasoning_engine.config import EngineConfig
    from reasoning_engine.models.base import CausalLM

logger = logging.getLogger(__name__)

TEXT_METHODS = ("ngram", "lookup", "suffix")
MODEL_METHODS = ("mtp", "eagle3")
METHODS = (*TEXT_METHODS, *MODEL_METHODS, "hybrid")
# while serving, the proposer's store is saved at most this often, and only after it learned something: a server that
# dies unannounced loses at most this much learning, and a save stalls the engine for about a step
SAVE_EVERY_S = 300.0

ProposeItem = tuple[str, Sequence[int], int]  # (request id, its tokens, draft budget)


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 8
    max_batch_size: int | None = None  # None: 16 for the static back-off, no cap for the adaptive engine
    state_dir: str | None = None
    model: str | None = None  # eagle3: the draft checkpoint folder
    methods: tuple[str, ...] = ()  # hybrid: the proposers it chooses between
    options: dict[str, Any] = field(default_factory=dict)  # the proposer's own options (hybrid: one dict per method)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        raw = dict(raw)
        method = raw.pop("method", None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}")
        k = raw.pop("num_speculative_tokens", 8)
        if not isinstance(k, int) or not 1 <= k <= 64:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 64], got {k!r}")
        max_batch = raw.pop("max_batch_size", None)
        if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 0):
            raise ValueError(f"speculative_config.max_batch_size must be an integer >= 0, got {max_batch!r}")
        state_dir = raw.pop("state_dir", None)
        model = raw.pop("model", None)
        methods: tuple[str, ...] = ()
        if method == "hybrid":
            listed = raw.pop("methods", None)
            if (not isinstance(listed, list) or len(listed) < 2 or len(set(listed)) != len(listed)
                    or any(m not in METHODS or m == "hybrid" for m in listed)):
                raise ValueError("speculative_config.methods must list two or more different methods of "
                                 f"{', '.join(METHODS[:-1])} for method 'hybrid', got {listed!r}")
            methods = tuple(listed)
            bad = [k for k, v in raw.items() if k not in methods or not isinstance(v, dict)]
            if bad:
                raise ValueError(f"speculative_config: with method 'hybrid', options go in one object per listed "
                                 f"method (e.g. {{'suffix': {{...}}}}); unexpected {', '.join(map(repr, bad))}")
        elif method in MODEL_METHODS and raw:
            raise ValueError(f"speculative_config: method {method!r} takes no option {', '.join(map(repr, raw))}")
        config = cls(method=method, num_speculative_tokens=k, max_batch_size=max_batch, state_dir=state_dir,
                     model=model, methods=methods, options=raw)
        if "eagle3" in config.model_methods() and not isinstance(model, str):
            raise ValueError("speculative_config.model must name the EAGLE-3 draft checkpoint folder for method 'eagle3'")
        return config

    def model_methods(self) -> list[str]:
        """The draft-model methods this config runs, directly or inside a hybrid."""
        return [m for m in (self.methods or (self.method,)) if m in MODEL_METHODS]


class DraftModel(Protocol):
    """A draft network run beside the target over its own paged KV cache: an MTP layer (mtp.py, qwen3_next_mtp.py,
    deepseek_v4_mtp.py) or an EAGLE-3 head (eagle3.py). Position t of a sequence pairs features of the target at t with token t + 1 and
    predicts token t + 2; chained drafting feeds the draft's own carried features back in place of the target's."""

    # target layers whose output the draft reads (CausalLM.forward's aux_hidden); () when it reads the final hidden
    aux_layers: tuple[int, ...]

    def attention_layers(self) -> list[nn.Module]: ...

    def target_features(self, hidden: torch.Tensor, aux_hidden: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Rows of the target's final-normed hidden states (and of its aux layers) -> the draft's input features."""
        ...

    def __call__(self, batch: ForwardBatch, features: torch.Tensor,
                 input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position per row: returns the head's input and the features carried to the next chained position."""
        ...

    def greedy(self, head_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The argmax token of each row as a target vocabulary id, and the draft's probability of it."""
        ...


def load_draft_models(config: SpeculativeConfig, engine_config: EngineConfig, target: CausalLM) -> dict[str, DraftModel]:
    """Build and load the draft models the config's methods need (none for text proposers)."""
    models: dict[str, DraftModel] = {}
    for method in config.model_methods():
        if method == "mtp" and engine_config.model.family == "qwen3_next":  # Qwen3-Next, Qwen3.5 / 3.6: `mtp.*`
            from reasoning_engine.speculative.qwen3_next_mtp import load_qwen3_next_mtp

            models[method] = load_qwen3_next_mtp(target, engine_config)
        elif method == "mtp" and engine_config.model.family == "deepseek_v4":  # `mtp.0.*`
            from reasoning_engine.speculative.deepseek_v4_mtp import load_deepseek_v4_mtp

            models[method] = load_deepseek_v4_mtp(target, engine_config)
        elif method == "mtp":  # DeepSeek-V3, GLM: layer num_hidden_layers
            from reasoning_engine.speculative.mtp import load_mtp

            models[method] = load_mtp(target, engine_config)
        else:
            from reasoning_engine.speculative.eagle3 import load_eagle3

            models[method] = load_eagle3(config.model, target, engine_config)
    return models


# vLLM's names for the n-gram proposer's options
NGRAM_ALIASES = {"prompt_lookup_max": "max_n", "prompt_lookup_min": "min_n"}


def _checked_options(method: str, target: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    """The options `target` accepts, or a ValueError naming the first it does not."""
    accepted = inspect.signature(target).parameters
    for key in options:
        if key not in accepted:
            raise ValueError(f"speculative_config: {key!r} is not an option of the {method} method "
                             f"(options: {', '.join(sorted(accepted))})")
    return options


def text_proposer(method: str, options: dict[str, Any], state_dir: str | None,
                  vocab_size: int | None = None) -> Proposer:
    """The proposer of a text method; the suffix proposer starts from the store saved in `state_dir`, if any, unless
    that store is unusable (corrupt, or learned for a model with another vocabulary): then it starts empty, with a
    warning, as the adaptive state does."""
    if method == "ngram":
        from reasoning_engine.speculative.ngram import NgramProposer

        options = {NGRAM_ALIASES.get(k, k): v for k, v in options.items()}
        return NgramProposer(**_checked_options(method, NgramProposer, options))
    if method == "lookup":
        from reasoning_engine.speculative.lookup import LookupProposer

        return LookupProposer(**_checked_options(method, LookupProposer, options))
    from reasoning_engine.speculative.suffix_tree import SuffixConfig, SuffixProposer

    config = SuffixConfig(**_checked_options(method, SuffixConfig, options))
    proposer = SuffixProposer(config)
    if state_dir and (Path(state_dir) / "suffix_state.json").is_file():  # a first start has nothing saved yet
        try:
            proposer.load(state_dir, vocab_size)
        except Exception as exc:  # noqa: BLE001 - json, zip and numpy each fail their own way on a damaged file
            logger.warning("suffix proposer state in %s is unusable (%s): starting without it", state_dir, exc)
            proposer = SuffixProposer(config)
    return proposer


def make_proposer(config: SpeculativeConfig, draft_proposers: Mapping[str, Proposer] | None = None,
                  vocab_size: int | None = None) -> Proposer:
    """The config's proposer; `draft_proposers` are the model runner's proposers for the draft-model methods,
    `vocab_size` the target's (a saved suffix store must not hold tokens beyond it)."""
    draft_proposers = draft_proposers or {}

    def single(method: str, options: dict[str, Any]) -> Proposer:
        if method in MODEL_METHODS:
            return draft_proposers[method]
        return text_proposer(method, options, config.state_dir, vocab_size)

    if config.method == "hybrid":
        return HybridProposer({m: single(m, config.options.get(m, {})) for m in config.methods})
    return single(config.method, config.options)


def propose_many(proposer: Proposer, items: Sequence[ProposeItem]) -> list[Draft]:
    """Drafts for several requests; proposers that batch their work (draft models) get all of them at once."""
    batched = getattr(proposer, "propose_batch", None)
    if batched is not None:
        return batched(items)
    return [proposer.propose(seq_id, tokens, n) for seq_id, tokens, n in items]


@dataclass
class MethodEstimate:
    """Running acceptance of one method's verified drafts, for the hybrid's choice and the per-method metrics."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    predicted: float = 0.0  # sum of the scores of scored drafts
    accepted_scored: int = 0  # tokens accepted from scored drafts

    def expected(self, draft: Draft) -> float:
        """Expected accepted length: the draft's own score times this method's calibration (accepted / predicted so
        far), or, when the proposer gives no score, the method's mean accepted length per draft. Both start from a
        prior of one token, so a method that has not been tried yet looks worth trying."""
        if not len(draft):
            return 0.0
        if draft.score > 0:
            return draft.score * (self.accepted_scored + 1.0) / (self.predicted + 1.0)
        return min(float(len(draft)), (self.accepted_tokens + 1.0) / (self.drafts + 1.0))

    def update(self, draft: Draft, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += len(draft)
        self.accepted_tokens += accepted
        if draft.score > 0:
            self.predicted += draft.score
            self.accepted_scored += accepted

    def as_dict(self) -> dict[str, float]:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "mean_acceptance_length": (self.accepted_tokens + self.drafts) / self.drafts if self.drafts else 0.0}


class HybridProposer:
    """Per request and step, the draft of the sub-proposer with the higher expected accepted length.

    Every sub-proposer drafts for every request (each keeps its own view of the sequence, so any can take over at the
    next step); `MethodEstimate.expected` ranks the drafts and ties go to the method listed first. What the target
    accepted of the chosen draft, reported through `on_tokens_accepted`, updates that method's estimate.
    """

    method = "hybrid"

    def __init__(self, proposers: Mapping[str, Proposer]) -> None:
        self.proposers = dict(proposers)
        self.estimates = {m: MethodEstimate() for m in self.proposers}
        self.chosen: dict[str, tuple[str, Draft]] = {}

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        for proposer in self.proposers.values():
            proposer.start_request(request_id, prompt_token_ids)

    def propose(self, request_id: str, token_ids: Sequence[int], max_draft_tokens: int) -> Draft:
        return self.propose_batch([(request_id, token_ids, max_draft_tokens)])[0]

    def propose_batch(self, items: Sequence[ProposeItem]) -> list[Draft]:
        candidates = {m: propose_many(p, items) for m, p in self.proposers.items()}
        drafts: list[Draft] = []
        for i, (seq_id, _, _) in enumerate(items):
            best = max(self.proposers, key=lambda m: (self.estimates[m].expected(candidates[m][i]),
                                                      -list(self.proposers).index(m)))
            draft = candidates[best][i]
            if len(draft):
                self.chosen[seq_id] = (best, draft)
            else:
                self.chosen.pop(seq_id, None)
            drafts.append(draft)
        return drafts

    def verified(self, request_id: str, draft: Draft) -> None:
        """The engine verifies `draft`: what is left of the chosen draft once cut to the length the engine chose and
        trimmed by the grammar. The method's estimate counts that, not what was proposed."""
        chosen = self.chosen.get(request_id)
        if chosen is not None:
            self.chosen[request_id] = (chosen[0], draft)

    def on_tokens_accepted(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        chosen = self.chosen.pop(request_id, None)
        if chosen is not None:
            method, draft = chosen
            self.estimates[method].update(draft, len(draft.match(new_token_ids)))
        for proposer in self.proposers.values():
            proposer.on_tokens_accepted(request_id, new_token_ids)

    def finish_request(self, request_id: str, learn: bool = True, token_ids: Sequence[int] | None = None) -> None:
        self.chosen.pop(request_id, None)
        for proposer in self.proposers.values():
            proposer.finish_request(request_id, learn=learn, token_ids=token_ids)

    def save(self, state_dir: str) -> None:
        for proposer in self.proposers.values():
            if hasattr(proposer, "save"):
                proposer.save(state_dir)

    def method_stats(self) -> dict[str, dict[str, float]]:
        return {m: e.as_dict() for m, e in self.estimates.items()}


@dataclass
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def as_dict(self, method: str) -> dict[str, Any]:
        steps = max(self.verify_steps, 1)
        return {"method": method, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": (self.accepted_tokens + self.verify_steps) / steps if self.verify_steps else 0.0,
                "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0}


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, draft_proposers: Mapping[str, Proposer] | None = None,
                 caller_lengths: bool = False, vocab_size: int | None = None) -> None:
        """With `caller_lengths` (the adaptive engine) each item's limit is its draft length: no doubling and
        halving here. `vocab_size`: the target model's (see `make_proposer`)."""
        self.config = config
        self.proposer = make_proposer(config, draft_proposers, vocab_size)
        self.stats = SpecStats()
        self.draft_len: dict[str, int] = {}
        self.caller_lengths = caller_lengths
        self._learned = 0  # outputs the proposer learned since its last save
        self._saved_at = time.monotonic()

    @property
    def static_batch_cap(self) -> int:
        """Above this many running requests of a replica the static setting drafts nothing (16 unless set)."""
        return 16 if self.config.max_batch_size is None else self.config.max_batch_size

    @property
    def batch_cap(self) -> int | None:
        """Above this many running requests of a replica, no drafts: the static back-off, or the adaptive engine's
        optional cap."""
        return self.config.max_batch_size if self.caller_lengths else self.static_batch_cap

    def start(self, seq_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.proposer.start_request(seq_id, prompt_token_ids)
        self.draft_len[seq_id] = max(1, self.config.num_speculative_tokens // 2)

    def propose(self, seq_id: str, token_ids: Sequence[int], limit: int) -> Draft:
        return self.propose_batch([(seq_id, token_ids, limit)])[0]

    def propose_batch(self, items: Sequence[ProposeItem],
                      keep: Callable[[list[Draft]], list[int]] | None = None) -> list[Draft]:
        """Drafts for several requests at once, each within its adaptive length and its `limit`; `keep` (the
        adaptive engine, for text proposers, whose drafts are cheap to make) sees the drafts and says how many
        tokens of each to verify."""
        if self.caller_lengths:
            asked = [(seq_id, tokens, limit) for seq_id, tokens, limit in items]
        else:
            asked = [(seq_id, tokens, min(self.draft_len.get(seq_id, 1), limit)) for seq_id, tokens, limit in items]
        wanted = [i for i, (_, _, n) in enumerate(asked) if n > 0]
        drafts = [Draft.empty() for _ in items]
        for i, draft in zip(wanted, propose_many(self.proposer, [asked[i] for i in wanted])):
            drafts[i] = draft
        if keep is not None:
            drafts = [d.truncated(n) for d, n in zip(drafts, keep(drafts))]
        return drafts

    def record(self, seq_id: str, draft: Draft, accepted: list[int], new_tokens: Sequence[int]) -> None:
        """After verification: update statistics, the adaptive length and the proposer's view of the sequence.
        `draft` is what was verified: the statistics count no draft that the grammar trimmed or the scheduler
        dropped before verification."""
        self.stats.drafts += 1
        self.stats.draft_tokens += len(draft)
        self.stats.verify_steps += 1
        self.stats.accepted_tokens += len(accepted)
        per_position = self.stats.accepted_per_position
        while len(per_position) < len(accepted):
            per_position.append(0)
        for depth in range(len(accepted)):
            per_position[depth] += 1
        current = self.draft_len.get(seq_id, 1)
        reached_bottom = bool(accepted) and len(accepted) == max(draft.depths())
        grown = min(self.config.num_speculative_tokens, current * 2)
        self.draft_len[seq_id] = grown if reached_bottom else max(1, len(accepted) + 1)
        if isinstance(self.proposer, HybridProposer):
            self.proposer.verified(seq_id, draft)
        self.proposer.on_tokens_accepted(seq_id, new_tokens)

    def finish(self, seq_id: str, learn: bool, token_ids: Sequence[int]) -> None:
        """`token_ids`: the request's whole sequence, which the proposer learns from (its own view lags)."""
        self.proposer.finish_request(seq_id, learn=learn, token_ids=token_ids)
        self.draft_len.pop(seq_id, None)
        self._learned += learn

    def maybe_save(self) -> None:
        """Called after each engine step: save what the proposer learned every SAVE_EVERY_S, not only at shutdown."""
        if self._learned and self.config.state_dir and time.monotonic() - self._saved_at > SAVE_EVERY_S:
            self.save_state()

    def save_state(self) -> None:
        """Write what the proposer learned (now and then, and at shutdown); a failed write is a warning, so the
        step or the shutdown goes on."""
        self._learned, self._saved_at = 0, time.monotonic()
        if self.config.state_dir and hasattr(self.proposer, "save"):
            try:
                self.proposer.save(self.config.state_dir)
            except OSError as exc:
                logger.warning("could not save the %s proposer's state to %s: %s", self.config.method,
                               self.config.state_dir, exc)

    def stats_dict(self) -> dict[str, Any]:
        """Engine metrics: totals, and per method for a hybrid."""
        stats = self.stats.as_dict(self.config.method)
        if hasattr(self.proposer, "method_stats"):
            stats["per_method"] = self.proposer.method_stats()
        return stats
