"""KV tiers on an agentic replay: prefix hit rate and TTFT with a host-memory tier under a device cache smaller than
the agents' working set, against the same engine without it; then a restart over a disk tier.

Each trajectory of ../shared/workloads/agentic/*.jsonl is an agent's multi-turn chat: turn k's prompt is the tokens
of every earlier prompt and output of the trajectory, then its own prompt (the README's definition), with the bundled
model's tokenizer; each prompt and output is cut to `--chars` characters so that several turns fit the bundled
model's 2,048-token context, and a trajectory stops before a turn past `--max-context` tokens. `--agents` agents run
at once, one turn each per round: while an agent waits on its tool (between its turns) the others' turns fill the
device cache, so its context is evicted unless a lower tier keeps it. Each turn generates `--max-tokens` greedy
tokens (the next turn's prompt carries the recorded output, as a replay does).

Runs, one engine each, the same turns in the same order: `device` (the device cache alone), `host` (plus a host tier
of `--host-mib`), `disk-write` (a host tier of `--disk-host-blocks` blocks over a fresh folder, the rest on disk) and
`disk-restart` (a new engine over that folder replays every agent's last turn: its context comes from disk). Reported:
prompt tokens, hit tokens and hit rate (the prefix cache's own counters), hits per tier, TTFT p50 (arrival to first
token, per turn), and whether every turn's tokens equal the `device` run's.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_tiers.py --kv-blocks 128 \
        --out benchmarks/results/kv_tiers_bundled_agentic_cpu_2026-12-07
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT.parent / "shared" / "workloads" / "agentic"


def trajectories(tokenizer, files: list[Path], count: int, chars: int, max_context: int) -> list[list[list[int]]]:
    """Per trajectory, its turns' prompts as token ids (the same number of trajectories from each file)."""
    out = []
    for file in files:
        convs: dict[str, list[dict]] = {}
        for line in file.read_text().splitlines():
            record = json.loads(line)
            convs.setdefault(str(record["traj_id"]), []).append(record)
        for key in sorted(convs)[: count // len(files)]:
            turns, context = [], []
            for record in sorted(convs[key], key=lambda r: r["step"]):
                prompt = context + tokenizer.encode(record["prompt"][:chars], add_special_tokens=False)
                if len(prompt) > max_context:
                    break
                turns.append(prompt)
                context = prompt + tokenizer.encode(record["output"][:chars], add_special_tokens=False)
            if len(turns) > 1:
                out.append(turns)
    return out


def replay(llm, agents: list[list[list[int]]], concurrent: int, max_tokens: int,
           turns_of: str = "all") -> dict[str, object]:
    """Agents `concurrent` at a time, one turn of each per round; `turns_of="last"` replays only each one's last."""
    from reasoning_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttfts, outputs = [], []
    began = time.perf_counter()
    for start in range(0, len(agents), concurrent):
        group = agents[start : start + concurrent]
        rounds = [[c[-1] for c in group]] if turns_of == "last" else [
            [c[t] for c in group if t < len(c)] for t in range(max(len(c) for c in group))]
        for prompts in rounds:
            for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params):
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
                outputs.append(out.outputs[0].token_ids)
    stats = llm.engine.stats()
    return {"prompt_tokens": stats.prefix_cache_queries, "hit_tokens": stats.prefix_cache_hits,
            "hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
            "host_hit_tokens": stats.kv_offload_host_hits, "disk_hit_tokens": stats.kv_offload_disk_hits,
            "host_stored_blocks": stats.kv_offload_host_stored_blocks,
            "disk_stored_blocks": stats.kv_offload_disk_stored_blocks,
            "damaged_entries": stats.kv_offload_damaged_entries, "kv_usage_after": stats.kv_cache_usage,
            "host_bytes": stats.kv_offload_host_bytes, "disk_bytes": stats.kv_offload_disk_bytes,
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "turns": len(outputs),
            "seconds": time.perf_counter() - began, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--agents", type=int, default=8, help="agents running at once")
    parser.add_argument("--chars", type=int, default=300, help="characters kept of each prompt and output")
    parser.add_argument("--max-context", type=int, default=1900)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=160, help="device cache blocks of 16 tokens")
    parser.add_argument("--host-mib", type=float, default=64.0)
    parser.add_argument("--disk-host-blocks", type=int, default=32)
    parser.add_argument("--files", nargs="*", default=["tau_bench_airline_gpt4o.jsonl",
                                                       "mini_swe_agent_deepseek_chat_dev.jsonl"])
    parser.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from reasoning_engine import LLM

    def engine(**tiers) -> LLM:
        return LLM(dtype="float32", device="cpu", block_size=16, kv_cache_blocks=args.kv_blocks,
                   max_model_len=args.max_context + args.max_tokens + 16,
                   max_num_seqs=args.agents, adaptive=False, **tiers)

    first = engine()
    agents = trajectories(first.get_tokenizer(), [WORKLOADS / f for f in args.files], args.trajectories, args.chars,
                          args.max_context)
    working_set = sum(max(len(t) for t in c) for c in agents[: args.agents])
    results = {"device": replay(first, agents, args.agents, args.max_tokens)}
    del first
    results["host"] = replay(engine(kv_offload_size=int(args.host_mib * 2**20)), agents, args.agents, args.max_tokens)
    with tempfile.TemporaryDirectory() as folder:
        probe = engine(kv_offload_size=int(args.host_mib * 2**20))
        block_bytes = probe.engine.runner.worker.tier_store.entry_bytes
        del probe
        disk = dict(kv_offload_size=args.disk_host_blocks * block_bytes, kv_offload_dir=folder)
        results["disk-write"] = replay(engine(**disk), agents, args.agents, args.max_tokens)
        results["disk-restart"] = replay(engine(**disk), agents, args.agents, args.max_tokens, turns_of="last")
        baseline_last = replay(engine(), agents, args.agents, args.max_tokens, turns_of="last")
    device = results["device"]
    device_outputs = device["outputs"]
    for name, r in results.items():
        reference = baseline_last["outputs"] if name == "disk-restart" else device_outputs
        r["identical_outputs"] = r.pop("outputs") == reference
    results["disk-restart-baseline"] = {k: v for k, v in baseline_last.items() if k != "outputs"}
    ratio = results["host"]["hit_rate"] / max(device["hit_rate"], 1e-9)
    ttft_ratio = results["host"]["ttft_p50_ms"] / device["ttft_p50_ms"]
    turns = sum(len(c) for c in agents)
    header = (f"{len(agents)} trajectories ({', '.join(args.files)}), {turns} turns, {args.agents} agents at a time; "
              f"device cache {args.kv_blocks} blocks of 16 tokens ({args.kv_blocks * 16} tokens) against a working "
              f"set of {working_set} tokens (the first {args.agents} agents' last contexts); host tier "
              f"{args.host_mib:g} MiB; disk runs: a host tier of {args.disk_host_blocks} blocks over a folder; "
              f"bundled model, float32, CPU ({platform.processor() or platform.machine()}, 1 thread)")
    lines = [header, "",
             "| run | prompt tokens | hit tokens | hit rate | host hits | disk hits | damaged | TTFT p50 ms | "
             "identical outputs | KV usage after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if name == "disk-restart-baseline":
            continue
        lines.append(f"| {name} | {r['prompt_tokens']} | {r['hit_tokens']} | {r['hit_rate']:.4f} | "
                     f"{r['host_hit_tokens']} | {r['disk_hit_tokens']} | {r['damaged_entries']} | "
                     f"{r['ttft_p50_ms']:.1f} | {r['identical_outputs']} | {r['kv_usage_after']:.2f} |")
    lines += ["", f"host / device hit rate: {ratio:.2f}x; host / device TTFT p50: {ttft_ratio:.2f}",
              f"disk restart: {results['disk-restart']['disk_hit_tokens']} prompt tokens of "
              f"{results['disk-restart']['prompt_tokens']} read from disk (TTFT p50 "
              f"{results['disk-restart']['ttft_p50_ms']:.1f} ms against {baseline_last['ttft_p50_ms']:.1f} ms for a "
              f"fresh engine without tiers)"]
    print("\n".join(lines))
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "results": results,
                                                        "hit_rate_ratio": ratio, "ttft_p50_ratio": ttft_ratio},
                                                       indent=2))
        command = "PYTHONPATH=. /work/heavy .venv/bin/python benchmarks/kv_tiers.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()
            if v is not None)
        Path(args.out + ".md").write_text(f"# KV tiers, agentic replay (2026-12-07, CPU)\n\n`{command}`\n\n"
                                          + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
