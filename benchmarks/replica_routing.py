"""Two replicas of the bundled model behind `reasoning-engine router`: prefix-cache hit rate and TTFT with the
cache-aware policy against round-robin, on agentic multi-turn traffic, and greedy outputs against one replica.

Sessions are the trajectories of ../shared/workloads/agentic/tau_bench_airline_gpt4o.jsonl (an airline agent: one
long system prompt shared by all, then user and tool turns). Turn k of a session is a chat request whose messages
are the trajectory's earlier prompts (user) and recorded outputs (assistant), then its own prompt, so the traffic
does not depend on what the tiny model answers. Texts are cut to fit the bundled model's 2048-position context (the
system prompt to `--system-chars`, each turn to `--turn-chars`, at most `--turns` turns), keeping the traffic's
shape: a shared prefix, contexts growing turn by turn, sessions interleaved. Trajectories are split by the SHA-256
of their id into dev (settings were chosen on it) and held-out (reported); `--sessions` of the split's
trajectories run, `--concurrent` at a time, each turn streamed with `--max-tokens` greedy tokens.

The hit rate is each replica's prefix_cache_hits / prefix_cache_queries (prompt tokens) over the run, read from its
/metrics; TTFT is the client's, arrival to the first streamed token. Every configuration gets fresh replicas with
`--kv-cache-blocks` each, so one replica holds about half the sessions' contexts: round-robin sends every session to
both and they evict each other's, cache-aware keeps each session where its history is.

    .venv/bin/python benchmarks/replica_routing.py --split heldout
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx

from reasoning_engine.router.local import LocalReplica, free_port, start_replicas, stop_replicas

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "workloads" / "agentic" / "tau_bench_airline_gpt4o.jsonl"
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "tiny-reasoner"


def sessions(split: str, count: int, turns: int, system_chars: int, turn_chars: int) -> list[list[list[dict]]]:
    """Each session: the message list of each turn."""
    by_traj: dict[str, list[dict]] = {}
    for line in TRACE.read_text().splitlines():
        record = json.loads(line)
        by_traj.setdefault(str(record["traj_id"]), []).append(record)
    chosen = [t for t in sorted(by_traj) if (hashlib.sha256(t.encode()).digest()[0] % 2 == 0) == (split == "dev")]
    out = []
    for traj in chosen[:count]:
        steps = sorted(by_traj[traj], key=lambda r: r["step"])[:turns]
        history: list[dict] = []
        session = []
        for record in steps:
            if record["step"] == 0:  # the system prompt and the task
                system, _, task = record["prompt"].rpartition("\n\n")
                history.append({"role": "system", "content": system[:system_chars]})
                prompt = task
            else:
                prompt = record["prompt"]
            history.append({"role": "user", "content": prompt[:turn_chars]})
            session.append(list(history))
            history.append({"role": "assistant", "content": record["output"][:turn_chars]})
        out.append(session)
    return out


async def run_turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "skip_special_tokens": False}
    start = time.perf_counter()
    first, text = None, []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                piece = (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece)
    return (first if first is not None else time.perf_counter() - start), "".join(text)


async def replay(url: str, convs: list[list[list[dict]]], concurrent: int, max_tokens: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrent)
    ttfts: list[float] = []
    outputs: dict[str, str] = {}

    async def session(index: int, turns: list[list[dict]]) -> None:
        async with gate:
            for turn, messages in enumerate(turns):
                ttft, text = await run_turn(client, url, messages, max_tokens)
                ttfts.append(ttft)
                outputs[f"{index}/{turn}"] = text

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(session(i, turns) for i, turns in enumerate(convs)))
        wall = time.perf_counter() - start
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_mean_s": statistics.fmean(ttfts), "requests": len(ttfts), "wall_s": wall, "outputs": outputs}


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the replicas."""
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("reasoning_engine:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("reasoning_engine:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def routed_counts(router_url: str) -> list[float]:
    """Requests the router sent each replica, from its /metrics."""
    return [float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{router_url}/metrics", timeout=10).text.splitlines()
            if line.startswith("reasoning_engine:router_replica_requests_total{")]


def start_router(urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "reasoning_engine.cli", "router", "--port", str(port),
                                "--policy", policy, "--log-level", "warning",
                                *[arg for url in urls for arg in ("--replica", url)]], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the router did not start")


def configuration(name: str, replicas: int, policy: str | None, serve_args: list[str], convs: list,
                  args: argparse.Namespace) -> dict[str, Any]:
    """Fresh replicas (empty caches), the workload through the router (or straight to a single replica)."""
    started: list[LocalReplica] = start_replicas(replicas, serve_args, log=subprocess.DEVNULL)
    router = None
    try:
        urls = [r.url for r in started]
        url = urls[0]
        if policy is not None:
            router, url = start_router(urls, policy)
        before = prefix_counters(urls)
        result = asyncio.run(replay(url, convs, args.concurrent, args.max_tokens))
        after = prefix_counters(urls)
        if router is not None:
            result["requests_per_replica"] = routed_counts(url)
        hits, queries = after[0] - before[0], after[1] - before[1]
        result.update(name=name, hit_rate=hits / queries if queries else 0.0, hit_tokens=hits, query_tokens=queries)
        print(f"{name}: hit rate {result['hit_rate']:.3f}, TTFT p50 {result['ttft_p50_s'] * 1000:.0f} ms "
              f"(mean {result['ttft_mean_s'] * 1000:.0f} ms), "
              f"{result['requests']} requests in {result['wall_s']:.1f} s, per replica "
              f"{result.get('requests_per_replica', [result['requests']])}", flush=True)
        return result
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        stop_replicas(started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", choices=("dev", "heldout"), default="heldout")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-chars", type=int, default=700)
    parser.add_argument("--turn-chars", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-blocks", type=int, default=256)
    parser.add_argument("--out", default=None, help="results file stem (default: replica_routing_<split>_cpu_DATE)")
    args = parser.parse_args()
    convs = sessions(args.split, args.sessions, args.turns, args.system_chars, args.turn_chars)
    serve_args = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-blocks",
                  str(args.kv_cache_blocks), "--block-size", "16", "--log-level", "warning"]
    single = configuration("one replica", 1, None, serve_args, convs, args)
    round_robin = configuration("2 replicas, round-robin", 2, "round-robin", serve_args, convs, args)
    cache_aware = configuration("2 replicas, cache-aware", 2, "cache-aware", serve_args, convs, args)
    same = sum(cache_aware["outputs"][k] == v for k, v in single["outputs"].items())
    same_rr = sum(round_robin["outputs"][k] == v for k, v in single["outputs"].items())
    summary = {
        "command": "python benchmarks/replica_routing.py " + " ".join(sys.argv[1:]),
        "settings": vars(args), "date": date.today().isoformat(), "device": "cpu",
        "hit_rate_ratio_cache_aware_vs_round_robin": cache_aware["hit_rate"] / max(round_robin["hit_rate"], 1e-9),
        "ttft_p50_ratio_cache_aware_vs_round_robin": cache_aware["ttft_p50_s"] / round_robin["ttft_p50_s"],
        "ttft_mean_ratio_cache_aware_vs_round_robin": cache_aware["ttft_mean_s"] / round_robin["ttft_mean_s"],
        "wall_ratio_cache_aware_vs_round_robin": cache_aware["wall_s"] / round_robin["wall_s"],
        "greedy_outputs_equal_to_one_replica": {"cache-aware": f"{same}/{len(single['outputs'])}",
                                                "round-robin": f"{same_rr}/{len(single['outputs'])}"},
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in (single, round_robin, cache_aware)],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    stem = args.out or f"replica_routing_{args.split}_cpu_{date.today().isoformat()}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
