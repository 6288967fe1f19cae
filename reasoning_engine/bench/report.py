"""Aggregates, the JSON document and the terminal summary of a `bench serve` run.

Everything downstream (table, charts, README tables) is computed from the JSON-shaped result, so a saved JSON can
be re-plotted or compared with another server's without re-running anything.
"""

from __future__ import annotations

import datetime
import json
import shlex
from collections import defaultdict
from dataclasses import asdict
from typing import Any

import numpy as np

from reasoning_engine import __version__
from reasoning_engine.bench.datasets import Workload
from reasoning_engine.bench.serve import LevelRun, RequestRecord

LATENCY_METRICS = ("ttft_s", "ttfa_s", "e2e_s", "output_speed_tps")
TOKEN_METRICS = ("prompt_tokens", "output_tokens", "reasoning_tokens", "answer_tokens")
DEFINITIONS = {
    "ttft_s": "seconds from sending the request to the first streamed token of any kind (thinking included)",
    "ttfa_s": "seconds to the first answer token (first content or tool-call delta after the thinking); "
              "requests without an answer are left out",
    "e2e_s": "seconds from sending the request to the end of the stream",
    "output_speed_tps": "output tokens (thinking + answer) / (e2e_s - ttft_s): generation speed once tokens flow",
    "request_throughput_rps": "successful requests / wall time of the level",
    "output_throughput_tps": "output tokens of all successful requests / wall time of the level",
    "total_token_throughput_tps": "(prompt + output tokens) / wall time of the level",
    "cache_hit_rate": "cached prompt tokens / prompt tokens, as the server reports them (prompt_tokens_details)",
}


def stats(values: list[float]) -> dict[str, float | None]:
    """Mean and P50/P90/P99 (linear interpolation); None for an empty list so JSON keeps every key."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}
    array = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"mean": float(array.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "count": len(values)}


def _values(records: list[RequestRecord], name: str) -> list[float]:
    return [getattr(r, name) for r in records if getattr(r, name) is not None]


def _per_turn(records: list[RequestRecord]) -> list[dict[str, Any]]:
    """Figures by turn index: how prefix caching (cache hit rate, TTFT) and speculation (output speed) pay off as
    an agent's conversation grows."""
    by_turn: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_turn[r.turn].append(r)
    rows = []
    for turn in sorted(by_turn):
        group = by_turn[turn]
        prompt = sum(r.prompt_tokens or 0 for r in group)
        cached = [r.cached_tokens for r in group if r.cached_tokens is not None]
        rows.append({
            "turn": turn, "requests": len(group),
            "ttft_s_p50": stats(_values(group, "ttft_s"))["p50"],
            "ttfa_s_p50": stats(_values(group, "ttfa_s"))["p50"],
            "output_speed_tps_p50": stats(_values(group, "output_speed_tps"))["p50"],
            "prompt_tokens_mean": prompt / len(group),
            "cache_hit_rate": (sum(cached) / prompt) if cached and prompt else None,
        })
    return rows


def aggregate(level: LevelRun, multi_turn: bool) -> dict[str, Any]:
    ok = [r for r in level.records if r.error is None]
    errors = [r.error for r in level.records if r.error is not None]
    output = sum(r.output_tokens or 0 for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    duration = level.duration_s
    result: dict[str, Any] = {
        "concurrency": level.concurrency,
        "requests": len(level.records),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "duration_s": duration,
        "request_throughput_rps": len(ok) / duration if duration > 0 else None,
        "output_throughput_tps": output / duration if duration > 0 else None,
        "total_token_throughput_tps": (prompt + output) / duration if duration > 0 else None,
        "prompt_tokens_total": prompt,
        "output_tokens_total": output,
        "reasoning_tokens_total": sum(r.reasoning_tokens or 0 for r in ok),
        "answer_tokens_total": sum(r.answer_tokens or 0 for r in ok),
        "requests_with_answer": sum(r.ttfa_s is not None for r in ok),
        "metrics": {name: stats(_values(ok, name)) for name in LATENCY_METRICS + TOKEN_METRICS},
    }
    result["metrics"]["inter_token_s"] = stats([gap for r in ok for gap in r.inter_token_s])
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    result["cache_hit_rate"] = sum(cached) / prompt if cached and prompt else None
    if multi_turn:
        result["sessions_cut_short"] = level.sessions_cut_short
        result["per_turn"] = _per_turn(ok)
    return result


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def summary_tables(result: dict[str, Any]) -> list[Any]:
    """The rich tables printed at the end: one row per concurrency level, and per-turn rows for sessions."""
    from rich.table import Table

    server, config = result["server"], result["config"]
    table = Table(title=f"bench serve: {server['model']} at {server['base_url']} - {result['workload']['name']}, "
                        f"{config['output_tokens']} max output tokens", title_justify="left")
    for name in ("conc", "ok/err", "req/s", "out tok/s", "TTFT p50/p90/p99 ms", "TTFA p50/p90/p99 ms",
                 "speed p50/p90 tok/s", "e2e p50/p99 s", "think/answer tok"):
        table.add_column(name, justify="right")
    for level in result["levels"]:
        m = level["metrics"]
        table.add_row(
            str(level["concurrency"]), f"{level['completed']}/{level['errors']}",
            _fmt(level["request_throughput_rps"]), _fmt(level["output_throughput_tps"], 1),
            "/".join(_ms(m["ttft_s"][p]) for p in ("p50", "p90", "p99")),
            "/".join(_ms(m["ttfa_s"][p]) for p in ("p50", "p90", "p99")),
            "/".join(_fmt(m["output_speed_tps"][p], 1) for p in ("p50", "p90")),
            "/".join(_fmt(m["e2e_s"][p]) for p in ("p50", "p99")),
            f"{_fmt(m['reasoning_tokens']['mean'], 0)}/{_fmt(m['answer_tokens']['mean'], 0)}")
    tables = [table]
    for level in result["levels"]:
        if not level.get("per_turn"):
            continue
        turns = Table(title=f"per turn, concurrency {level['concurrency']}", title_justify="left")
        for name in ("turn", "requests", "prompt tok", "cache hit", "TTFT p50 ms", "speed p50 tok/s"):
            turns.add_column(name, justify="right")
        for row in level["per_turn"]:
            hit = row["cache_hit_rate"]
            turns.add_row(str(row["turn"]), str(row["requests"]), _fmt(row["prompt_tokens_mean"], 0),
                          "-" if hit is None else f"{hit:.0%}", _ms(row["ttft_s_p50"]),
                          _fmt(row["output_speed_tps_p50"], 1))
        tables.append(turns)
    return tables


def _command(argv: list[str]) -> str:
    """The command line as a user would type it (the console script's path shortened to its name)."""
    program = "reasoning-engine" if argv and argv[0].endswith("reasoning-engine") else argv[0] if argv else ""
    return shlex.join([program, *argv[1:]])


def markdown_report(result: dict[str, Any]) -> str:
    """The run as Markdown (README and benchmarks/results): the command, the setup, one row per concurrency level
    and, for multi-turn workloads, one row per turn."""
    server, config, tokens = result["server"], result["config"], result["tokens"]
    lines = [f"## bench serve: {server['model']}, {result['workload']['name']}", "",
             "```", _command(result["argv"]), "```", "",
             f"- created {result['created']}, reasoning-engine {result['version']}; server {server['base_url']} "
             f"(context {server['max_model_len'] or 'not reported'})",
             f"- workload: {result['workload']['description']}",
             f"- max output tokens {config['output_tokens']}{_spread(config)}"
             f"{' (ignore_eos)' if config['ignore_eos'] else ''}; "
             f"requests (sessions) per level {config['num_prompts_per_level']}; warm-up {config['warmup']}; "
             f"seed {config['seed']}; extra body {json.dumps(config['extra_body'])}",
             f"- token counts: server usage where reported, else {tokens['counter']}",
             *(f"- note: {note}" for note in result["workload"]["notes"]), "",
             "| concurrency | ok / errors | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | "
             "time to first answer p50 / p90 / p99 (ms) | output speed p50 / p90 (tok/s per request) | "
             "e2e p50 / p99 (s) | thinking / answer tokens (mean) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for level in result["levels"]:
        m = level["metrics"]
        lines.append(
            f"| {level['concurrency']} | {level['completed']} / {level['errors']} | "
            f"{_fmt(level['request_throughput_rps'])} | {_fmt(level['output_throughput_tps'], 1)} | "
            f"{' / '.join(_ms(m['ttft_s'][p]) for p in ('p50', 'p90', 'p99'))} | "
            f"{' / '.join(_ms(m['ttfa_s'][p]) for p in ('p50', 'p90', 'p99'))} | "
            f"{' / '.join(_fmt(m['output_speed_tps'][p], 1) for p in ('p50', 'p90'))} | "
            f"{_fmt(m['e2e_s']['p50'])} / {_fmt(m['e2e_s']['p99'])} | "
            f"{_fmt(m['reasoning_tokens']['mean'], 0)} / {_fmt(m['answer_tokens']['mean'], 0)} |")
    for level in result["levels"]:
        if not level.get("per_turn"):
            continue
        lines += ["", f"Per turn, concurrency {level['concurrency']} ({level['sessions_cut_short']} sessions stopped "
                      "early at the context limit):", "",
                  "| turn | requests | prompt tokens (mean) | prefix cache hit | TTFT p50 (ms) | "
                  "output speed p50 (tok/s) |", "|---:|---:|---:|---:|---:|---:|"]
        for row in level["per_turn"]:
            hit = row["cache_hit_rate"]
            lines.append(f"| {row['turn']} | {row['requests']} | {_fmt(row['prompt_tokens_mean'], 0)} | "
                         f"{'-' if hit is None else f'{hit:.0%}'} | {_ms(row['ttft_s_p50'])} | "
                         f"{_fmt(row['output_speed_tps_p50'], 1)} |")
    return "\n".join(lines) + "\n"


def build_result(*, argv: list[str], server: dict[str, Any], config: dict[str, Any], workload: Workload,
                 token_counter: str, tokens_exact: bool, levels: list[LevelRun]) -> dict[str, Any]:
    """The JSON document: how the run was made, the per-level aggregates and every per-request record."""
    return {
        "benchmark": "reasoning-engine bench serve",
        "version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": argv,
        "server": server,
        "config": config,
        "workload": {"name": workload.name, "description": workload.description, "multi_turn": workload.multi_turn,
                     "notes": workload.notes},
        "tokens": {"counter": token_counter, "exact": tokens_exact},
        "definitions": DEFINITIONS,
        "levels": [aggregate(level, workload.multi_turn) for level in levels],
        "requests": [asdict(r) for level in levels for r in level.records],
    }


def _spread(config: dict[str, Any]) -> str:
    spread = config.get("output_spread") or 0  # absent from results written before the option
    return f" +- {spread:.0%}" if spread else ""
