"""Offline replay: how much would speculation have helped on recorded outputs?

Each recorded output is replayed as greedy decoding in which the target emits exactly the recorded tokens: per verify
step the proposer drafts up to K nodes, the longest draft path that matches the record is accepted, and the target adds
one more token (the bonus) unless the output is complete. `mean_accepted_tokens` is output tokens per verify step (1.0
means no gain); `acceptance_rate` is accepted draft nodes over drafted nodes (every node of a tree counts).

Records sharing `traj_id` form one conversation in file order: a turn's context is every earlier prompt and output of its
trajectory, then its own prompt (each piece tokenized on its own). Records without `traj_id` stand alone. One proposer
serves the whole file, so the suffix proposer's global store learns across records in file order; `--state-dir` loads it
before the replay and saves it after, which is how learning carries from one file (or restart) to the next.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from reasoning_engine.speculative.draft import Proposer


@dataclass
class ReplayItem:
    """One record, tokenized: `traj` groups the turns of a conversation (None: a record on its own)."""

    traj: str | None
    prompt: list[int]
    output: list[int]


@dataclass
class ReplayStats:
    k: int
    records: int = 0
    steps: int = 0
    tokens: int = 0
    draft_steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    accepted_hist: list[int] = field(default_factory=list)  # accepted_hist[a]: steps that accepted a draft nodes
    propose_s: float = 0.0
    update_s: float = 0.0
    request_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.accepted_hist:
            self.accepted_hist = [0] * (self.k + 1)

    def summary(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        reach = [sum(self.accepted_hist[a:]) for a in range(1, self.k + 1)]
        return {
            "mean_accepted_tokens": self.tokens / steps,
            "acceptance_rate": self.accepted_draft_tokens / max(self.draft_tokens, 1),
            "steps": self.steps,
            "tokens": self.tokens,
            "records": self.records,
            "k": self.k,
            "draft_steps": self.draft_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "accepted_per_position": [r / max(self.draft_steps, 1) for r in reach],
            "propose_us_per_step": 1e6 * self.propose_s / steps,
            "update_us_per_step": 1e6 * self.update_s / steps,
            "request_ms_per_record": 1e3 * self.request_s / max(self.records, 1),
        }


def replay(items: Iterable[ReplayItem], proposer: Proposer, k: int,
           progress: Callable[[ReplayStats], None] | None = None) -> ReplayStats:
    """Replay every item in order through one proposer; see the module docstring for the accounting."""
    stats = ReplayStats(k=k)
    histories: dict[str, list[int]] = {}
    clock = time.perf_counter
    for number, item in enumerate(items):
        request_id = f"replay-{number}"
        context = (histories.get(item.traj, []) if item.traj is not None else []) + item.prompt
        started = clock()
        proposer.start_request(request_id, context)
        stats.request_s += clock() - started
        sequence = list(context)
        output, pos = item.output, 0
        while pos < len(output):
            t0 = clock()
            draft = proposer.propose(request_id, sequence, k)
            t1 = clock()
            if len(draft) > k:
                raise RuntimeError(f"{proposer.method} drafted {len(draft)} nodes with a budget of {k}")
            accepted = len(draft.match(output[pos:pos + len(draft)])) if len(draft) else 0
            new = output[pos:pos + accepted + 1]
            sequence.extend(new)
            t2 = clock()
            proposer.on_tokens_accepted(request_id, new)
            stats.update_s += clock() - t2
            stats.propose_s += t1 - t0
            stats.steps += 1
            stats.tokens += len(new)
            if len(draft):
                stats.draft_steps += 1
                stats.draft_tokens += len(draft)
                stats.accepted_draft_tokens += accepted
                stats.accepted_hist[accepted] += 1
            pos += len(new)
        started = clock()
        proposer.finish_request(request_id, token_ids=sequence)
        stats.request_s += clock() - started
        if item.traj is not None:
            histories[item.traj] = sequence
        stats.records += 1
        if progress is not None:
            progress(stats)
    return stats


def read_records(path: str | Path, max_dup_line_frac: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """JSONL records in file order; `max_dup_line_frac` drops records whose `dup_line_frac` is above it."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            record = json.loads(line)
            if max_dup_line_frac is not None and float(record.get("dup_line_frac", 0.0)) > max_dup_line_frac:
                continue
            records.append(record)
            if limit is not None and len(records) >= limit:
                break
    return records


def load_tokenizer(path: str | Path) -> Any:
    """A `tokenizers.Tokenizer` from an HF tokenizer folder (its tokenizer.json) or from the file itself."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


def tokenize_records(records: Sequence[dict[str, Any]], tokenizer: Any) -> list[ReplayItem]:
    texts = [r.get("prompt") or "" for r in records] + [r.get("output") or "" for r in records]
    encoded = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    n = len(records)
    return [ReplayItem(None if r.get("traj_id") is None else str(r["traj_id"]), encoded[i], encoded[n + i])
            for i, r in enumerate(records)]


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "spec-replay", help="replay recorded outputs through a speculative proposer and report accepted tokens per step",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", required=True, choices=["ngram", "lookup", "suffix"])
    parser.add_argument("--input", required=True, help="JSONL with prompt, output and optionally traj_id per record")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer folder (tokenizer.json) or the file itself")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=16, help="draft budget K (tree nodes count)")
    parser.add_argument("--speculative-config", default="{}",
                        help="JSON of proposer options, e.g. '{\"tree\": false, \"min_token_prob\": 0.2}'")
    parser.add_argument("--state-dir", help="suffix: load the global store from here if present, save it after")
    parser.add_argument("--max-dup-line-frac", type=float, help="skip records whose dup_line_frac is above this")
    parser.add_argument("--limit", type=int, help="replay only the first N records (after filtering)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (the last line)")
    parser.add_argument("--progress", action="store_true", help="report progress on stderr")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from reasoning_engine.speculative import build_proposer

    if args.num_speculative_tokens < 1:
        raise SystemExit("--num-speculative-tokens must be >= 1")
    if args.state_dir and args.method != "suffix":
        raise SystemExit("--state-dir applies to --method suffix only")
    options = json.loads(args.speculative_config)
    proposer = build_proposer({"method": args.method, **options}, state_dir=args.state_dir)
    records = read_records(args.input, args.max_dup_line_frac, args.limit)
    items = tokenize_records(records, load_tokenizer(args.tokenizer))

    def progress(stats: ReplayStats) -> None:
        if stats.records % 100 == 0 or stats.records == len(items):
            print(f"{stats.records}/{len(items)} records, {stats.tokens} tokens, "
                  f"{stats.tokens / max(stats.steps, 1):.3f} tokens/step", file=sys.stderr, flush=True)

    started = time.perf_counter()
    stats = replay(items, proposer, args.num_speculative_tokens, progress if args.progress else None)
    result = {"method": args.method, "input": str(args.input), **stats.summary(),
              "wall_s": round(time.perf_counter() - started, 3)}
    if args.state_dir:
        proposer.save(args.state_dir)
        result["global_tokens"] = proposer.global_tokens
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.method}: {result['mean_accepted_tokens']:.3f} tokens/step, acceptance {result['acceptance_rate']:.3f}, "
              f"{result['steps']} steps, {result['tokens']} tokens over {result['records']} records")
    return 0
