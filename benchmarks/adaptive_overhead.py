"""Adaptive against `--no-adaptive` on one server each, alternated (the order swapped every round), at one concurrency:
the bundled model's development task types (`--part held-out` only to report; the split is
benchmarks/adaptive_heldout.py's), suffix speculation with 8 draft tokens, one thread per server. Prints output tok/s
by wall clock and per server CPU second, and for the adaptive server its steps per policy arm and the gate's buckets:
where it runs the default arm on nearly every step, the ratio is the adaptive engine's own cost.

    python benchmarks/adaptive_overhead.py [--part dev] [--concurrency 1] [--requests 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaptive import SUFFIX, Server  # noqa: E402
from adaptive_heldout import cpu_seconds, task_prompts  # noqa: E402


async def drive(url: str, prompts: list[dict], concurrency: int, pid: int) -> tuple[int, float, float]:
    """Every prompt through the chat API, `concurrency` at once, after one warm-up request: output tokens, wall
    seconds and the server's CPU seconds."""
    gate = asyncio.Semaphore(concurrency)
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(prompt: dict) -> int:
            async with gate:
                body = {**prompt, "max_tokens": 128, "temperature": 0}
                response = await http.post("/v1/chat/completions", json=body)
                return response.json()["usage"]["completion_tokens"]

        await one(prompts[0])
        cpu, start = cpu_seconds(pid), time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return tokens, time.perf_counter() - start, cpu_seconds(pid) - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("dev", "held-out"), default="dev")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    prompts = task_prompts(args.part, args.requests)[:args.requests]
    for round_ in range(args.rounds):
        rates = {}
        servers = [("adaptive", []), ("fixed", ["--no-adaptive"])]
        for name, flags in servers if round_ % 2 == 0 else servers[::-1]:
            server = Server(None, [*flags, "--speculative-config", SUFFIX.format(k=8)], 2048)
            try:
                tokens, wall, cpu = asyncio.run(drive(server.url, prompts, args.concurrency, server.proc.pid))
                if name == "adaptive":
                    speculation = httpx.get(f"{server.url}/v1/engine/adaptive", timeout=10).json()["speculation"]
                    print(f"round {round_ + 1} adaptive steps by arm: {speculation['policy_steps']}")
            finally:
                server.close()
            rates[name] = (tokens / wall, tokens / cpu)
        (aw, ac), (fw, fc) = rates["adaptive"], rates["fixed"]
        print(f"round {round_ + 1}: adaptive {aw:.1f} tok/s ({ac:.1f} per CPU s), fixed {fw:.1f} ({fc:.1f}): "
              f"{aw / fw:.2f}x wall, {ac / fc:.2f}x CPU", flush=True)


if __name__ == "__main__":
    main()
