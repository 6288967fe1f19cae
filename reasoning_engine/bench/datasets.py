"""What `bench serve` sends: synthetic prompts of exact token length, the shared reasoning and agentic workloads, or
any JSONL of prompts.

Every workload is a list of sessions; a session is a list of turns and a turn is the messages it adds to the
conversation. Single prompts are one-turn sessions, so the runner has one code path: it replays each session turn by
turn, feeding back the model's own replies from this run, which is what exercises prefix caching and suffix
speculation on multi-turn agent traffic.

Freshness rule: prompts are a pure function of the seed and the concurrency level. `--seed S` makes a run
reproducible (and a re-run against the same server hits its prefix cache, by design of the user); without `--seed`
a seed is drawn from the OS for every run and written into the JSON. Each concurrency level gets its own prompts
(synthetic: generated from (seed, level); datasets: disjoint slices of a seeded shuffle, reused only when the
dataset runs out), so one level never warms the cache for the next.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reasoning_engine.bench.tokens import TokenCounter

Message = dict[str, Any]
DATASETS = ("synthetic", "reasoning", "agentic")
REASONING_FILES = ("reasoning/skyt1_27b_math.jsonl",)
# Common short English words: each is one token (with its leading space) in the usual BPE vocabularies, so a
# synthetic prompt built from them is close to its target length even when no tokenizer is at hand.
_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue side "
          "kind head house service friend father power hour game line end member law car city community name team "
          "minute idea kid body information back parent face others level office door health person art war history "
          "party result change morning reason research girl guy moment air teacher force education").split()


def default_workloads_dir() -> Path:
    """`../shared/workloads` relative to the repository root (the checkout this package is installed from)."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "workloads"


@dataclass
class Session:
    """One conversation: `turns[i]` holds the messages turn i appends after the replies to the earlier turns."""

    id: str
    turns: list[list[Message]]


@dataclass
class Workload:
    """The sessions of each concurrency level, and how they were made (written into the JSON)."""

    name: str
    levels: list[list[Session]]
    multi_turn: bool
    description: str
    notes: list[str] = field(default_factory=list)


def _user(text: str) -> list[Message]:
    return [{"role": "user", "content": text}]


class SyntheticPrompts:
    """Random text of an exact token count under the model's tokenizer (estimated without one)."""

    def __init__(self, counter: TokenCounter) -> None:
        self.counter = counter
        self._candidates = self._word_tokens() if counter.exact else []

    def _word_tokens(self) -> list[int]:
        """Ids that decode to plain ASCII letters: random sequences of them read as words and re-tokenize stably,
        where byte fragments and special tokens would not."""
        tokenizer = self.counter.tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        size = len(tokenizer)
        pieces = tokenizer.batch_decode([[i] for i in range(size)])
        ids = [i for i, piece in enumerate(pieces)
               if i not in special and piece.strip().isalpha() and piece.isascii()]
        if len(ids) < 16:
            raise ValueError(f"the tokenizer ({self.counter.source}) has too few plain word tokens for synthetic prompts")
        return ids

    def make(self, num_tokens: int, rng: random.Random) -> str:
        if not self.counter.exact:
            return " ".join(rng.choice(_WORDS) for _ in range(num_tokens))
        tokenizer = self.counter.tokenizer
        for _ in range(8):
            ids = rng.choices(self._candidates, k=num_tokens)
            for _ in range(16):
                # decode -> encode is not the identity (pieces merge across boundaries): iterate to a fixed point
                text = tokenizer.decode(ids)
                encoded = tokenizer.encode(text, add_special_tokens=False)
                if len(encoded) == num_tokens:
                    return text
                if len(encoded) > num_tokens:
                    ids = encoded[:num_tokens]
                else:
                    ids = encoded + rng.choices(self._candidates, k=num_tokens - len(encoded))
        raise RuntimeError(f"could not build a prompt of exactly {num_tokens} tokens with {self.counter.source}")


def synthetic(counter: TokenCounter, input_tokens: int, per_level: list[int], seed: int) -> Workload:
    maker = SyntheticPrompts(counter)
    levels = []
    for level, count in enumerate(per_level):
        rng = random.Random(f"synthetic:{seed}:{level}")
        levels.append([Session(f"L{level}-{i}", [_user(maker.make(input_tokens, rng))]) for i in range(count)])
    exact = "exactly" if counter.exact else "about (estimated)"
    return Workload("synthetic", levels, False,
                    f"random word-token prompts of {exact} {input_tokens} tokens in the user message "
                    f"({counter.source}); the chat template adds its own tokens, reported as prompt_tokens")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
    return records


def _sessions_from_records(records: list[dict[str, Any]], origin: str) -> tuple[list[Session], bool]:
    """Records with `traj_id` and `step` become multi-turn sessions (the shared workloads' format); `{"messages"}`
    and `{"prompt"}` records become one-turn sessions."""
    if records and all("traj_id" in r and "step" in r and "prompt" in r for r in records):
        grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            grouped[str(r["traj_id"])].append(r)
        sessions = [Session(f"{origin}:{traj}", [_user(str(r["prompt"])) for r in sorted(turns, key=lambda r: r["step"])])
                    for traj, turns in grouped.items()]
        return sessions, True
    sessions = []
    for i, r in enumerate(records):
        if isinstance(r.get("messages"), list) and r["messages"]:
            sessions.append(Session(f"{origin}:{i}", [list(r["messages"])]))
        elif isinstance(r.get("prompt"), str):
            sessions.append(Session(f"{origin}:{i}", [_user(r["prompt"])]))
        else:
            raise ValueError(f"{origin} record {i + 1}: needs a `prompt` string or a `messages` list")
    return sessions, False


def _truncate(sessions: list[Session], counter: TokenCounter, max_tokens: int) -> None:
    """Cap every string message content at `max_tokens` (real prompts can exceed a small model's context); only the
    sessions a run sends, as tokenizing a whole dataset would take longer than a short run."""
    for session in sessions:
        for turn in session.turns:
            for message in turn:
                if isinstance(message.get("content"), str):
                    message["content"] = counter.truncate(message["content"], max_tokens)


def _split(sessions: list[Session], per_level: list[int], seed: int, name: str) -> tuple[list[list[Session]], list[str]]:
    """Disjoint slices of a seeded shuffle, one per level; wraps around (and says so) when the data runs out."""
    if not sessions:
        raise ValueError(f"the {name} dataset is empty")
    order = list(sessions)
    random.Random(f"{name}:{seed}").shuffle(order)
    levels, start = [], 0
    for count in per_level:
        levels.append([order[(start + i) % len(order)] for i in range(count)])
        start += count
    notes = []
    if start > len(order):
        notes.append(f"{name}: {start} sessions requested but {len(order)} exist; some are sent more than once, "
                     "so later ones may hit the prefix cache")
    return levels, notes


def from_dataset(dataset: str, counter: TokenCounter, per_level: list[int], seed: int, workloads_dir: Path,
                 max_prompt_tokens: int | None) -> Workload:
    """`reasoning`, `agentic` (from the shared workloads) or a JSONL path."""
    if dataset == "reasoning":
        files = [workloads_dir / f for f in REASONING_FILES]
    elif dataset == "agentic":
        files = sorted((workloads_dir / "agentic").glob("*.jsonl"))
    else:
        files = [Path(dataset)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise FileNotFoundError(f"dataset {dataset!r}: file(s) not found: {', '.join(missing) or workloads_dir}")
    sessions: list[Session] = []
    multi_turn = False
    for path in files:
        found, multi = _sessions_from_records(_read_jsonl(path), path.stem)
        multi_turn = multi_turn or multi
        sessions.extend(found)
    if dataset == "reasoning":  # the same problem appears once per sampling run; send each once
        unique: dict[str, Session] = {}
        for s in sessions:
            unique.setdefault(json.dumps(s.turns), s)
        sessions = list(unique.values())
    levels, notes = _split(sessions, per_level, seed, dataset)
    if max_prompt_tokens is not None:
        chosen = {id(s): s for level in levels for s in level}
        _truncate(list(chosen.values()), counter, max_prompt_tokens)
    kind = "multi-turn sessions replayed turn by turn" if multi_turn else "single prompts"
    capped = f", each message capped at {max_prompt_tokens} tokens" if max_prompt_tokens is not None else ""
    return Workload(Path(dataset).name if dataset not in DATASETS else dataset, levels, multi_turn,
                    f"{kind} from {', '.join(f.name for f in files)} ({len(sessions)} available{capped})", notes)
