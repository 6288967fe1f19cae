"""`reasoning-engine bench serve` and `reasoning-engine bench throughput`. Heavy imports (httpx, torch, matplotlib)
happen inside the command functions so `reasoning-engine --help` stays fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

# The leaderboard's standard shapes (Artificial Analysis measures providers at ~1k, ~10k and ~100k input tokens,
# single requests and 10 in parallel). Explicit flags override a preset's values.
PRESETS: dict[str, dict[str, Any]] = {
    "aa-1k": {"dataset": "synthetic", "input_tokens": 1_000, "output_tokens": 1_000, "concurrency": "1,10"},
    "aa-10k": {"dataset": "synthetic", "input_tokens": 10_000, "output_tokens": 1_500, "concurrency": "1,10"},
    "aa-100k": {"dataset": "synthetic", "input_tokens": 100_000, "output_tokens": 1_500, "concurrency": "1,10"},
}
DEFAULTS: dict[str, Any] = {"dataset": "synthetic", "input_tokens": 256, "output_tokens": 256, "concurrency": "1"}


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="Benchmark a server (bench serve) or the offline engine (bench throughput).")
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)

    serve = commands.add_parser(
        "serve", help="Measure any OpenAI-compatible server with streaming chat completions.",
        description="Measure TTFT, time to first answer token, output speed, latency and throughput of any "
                    "OpenAI-compatible server, per concurrency level, the way public leaderboards measure providers.")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                       help="the server's OpenAI root (a bare http://host:port gets /v1)")
    serve.add_argument("--model", default=None, help="model name (default: the first model the server lists)")
    serve.add_argument("--api-key", default=os.environ.get("REASONING_ENGINE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                       help="bearer token (default: $REASONING_ENGINE_API_KEY, else $OPENAI_API_KEY)")
    serve.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="a standard shape: aa-1k (1k in / 1k out), aa-10k (10k in / 1.5k out), aa-100k "
                            "(100k in / 1.5k out), each at concurrency 1 and 10; explicit flags override it")
    serve.add_argument("--dataset", default=None,
                       help="synthetic (default) | reasoning | agentic (from the shared workloads) | FILE.jsonl of "
                            '{"prompt": ...} or {"messages": [...]} records (records with traj_id and step are '
                            "replayed as sessions)")
    serve.add_argument("--input-tokens", type=int, default=None,
                       help="synthetic: tokens in each prompt (default 256); datasets: cap on each message's tokens")
    serve.add_argument("--output-tokens", type=int, default=None, help="max_tokens of each request (default 256)")
    serve.add_argument("--ignore-eos", action="store_true",
                       help="send ignore_eos=true so every request generates --output-tokens tokens "
                            "(vLLM, SGLang and reasoning-engine accept it; hosted APIs may not)")
    serve.add_argument("--concurrency", default=None,
                       help="comma-separated levels, requests (sessions) in flight at once (default 1)")
    serve.add_argument("--num-prompts", type=int, default=None,
                       help="requests per level; sessions per level for multi-turn data (default: 2 x concurrency, "
                            "at least 8)")
    serve.add_argument("--max-turns", type=int, default=None, help="multi-turn data: replay at most this many turns")
    serve.add_argument("--turn-gap", type=float, default=0.0,
                       help="multi-turn data: mean seconds (exponential) a session waits before each later turn, as "
                            "an agent waits on its tool (default 0)")
    serve.add_argument("--output-spread", type=float, default=0.0,
                       help="each request's max tokens drawn uniformly within --output-tokens x (1 +- this), seeded by "
                            "session and turn (default 0: all the same; with --ignore-eos they then finish together)")
    serve.add_argument("--session-key", action="store_true",
                       help="send each session's id as prompt_cache_key, as agent frameworks do")
    serve.add_argument("--no-reasoning-history", action="store_true",
                       help="multi-turn data: do not send earlier turns' thinking back as reasoning_content")
    serve.add_argument("--seed", type=int, default=None,
                       help="makes the prompts reproducible; without it every run draws a fresh seed (written to the "
                            "JSON), so no server cache has seen the prompts")
    serve.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first (default 1)")
    serve.add_argument("--tokenizer", default=None,
                       help="tokenizer folder for exact token counts (default: the served model's folder when the "
                            "server reports a local one, else an estimate of ~4 characters per token)")
    serve.add_argument("--workloads-dir", default=None,
                       help="where the reasoning and agentic sets live (default: ../shared/workloads from the repo)")
    serve.add_argument("--extra-body", default=None,
                       help='JSON object merged into every request, e.g. \'{"thinking_token_budget": 64}\'')
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    serve.add_argument("--json", dest="json_path", default=None, help="write every record and aggregate here")
    serve.add_argument("--plot", default=None, help="write the PNG charts here")
    serve.add_argument("--markdown", default=None, help="write the command, setup and tables as Markdown here")
    serve.set_defaults(func=serve_command)

    tput = commands.add_parser(
        "throughput", help="Offline engine throughput on prompts of a fixed shape (optionally vs transformers).",
        description="Offline generation throughput of MODEL_PATH with the in-process engine; --compare transformers "
                    "runs transformers' generate on the same prompts, machine and batch size and prints the ratio.")
    tput.add_argument("model", help="checkpoint folder")
    tput.add_argument("--input-tokens", type=int, default=128)
    tput.add_argument("--output-tokens", type=int, default=128)
    tput.add_argument("--num-prompts", type=int, default=16)
    tput.add_argument("--concurrency", type=int, default=8, help="sequences batched together (default 8)")
    tput.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    tput.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    tput.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode batches")
    tput.add_argument("--compare", choices=("transformers",), default=None)
    tput.add_argument("--seed", type=int, default=0)
    tput.add_argument("--json", dest="json_path", default=None)
    tput.set_defaults(func=throughput_command)


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Explicit flag > preset > default, and the checks argparse cannot express."""
    preset = PRESETS.get(args.preset or "", {})
    settings = {key: getattr(args, key) if getattr(args, key) is not None else preset.get(key, default)
                for key, default in DEFAULTS.items()}
    try:
        levels = [int(c) for c in str(settings["concurrency"]).split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency: expected comma-separated integers, got {settings['concurrency']!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError("--concurrency: every level must be >= 1")
    settings["concurrency"] = levels
    for key in ("input_tokens", "output_tokens", "num_prompts", "max_turns"):
        value = settings.get(key, getattr(args, key))
        if value is not None and value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1")
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    settings["extra_body"] = extra
    if settings["dataset"] == "synthetic":
        settings["max_prompt_tokens"] = None
    else:  # datasets keep their own lengths; --input-tokens caps each message only when given explicitly
        settings["input_tokens"] = settings["max_prompt_tokens"] = args.input_tokens
    return settings


def serve_command(args: argparse.Namespace) -> int:
    import asyncio

    import httpx

    from reasoning_engine.bench.serve import BenchError, api_root

    try:
        settings = _resolve(args)
        return asyncio.run(_serve(args, settings))
    except httpx.HTTPError as exc:
        print(f"error: {api_root(args.base_url)}: {exc}", file=sys.stderr)
    except (BenchError, ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    return 2


async def _serve(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    import secrets
    from pathlib import Path

    import httpx
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from reasoning_engine.bench import datasets, report
    from reasoning_engine.bench.serve import BenchError, Runner, ServeConfig, api_root, list_models
    from reasoning_engine.bench.tokens import resolve_counter

    root = api_root(args.base_url)
    async with httpx.AsyncClient(timeout=30.0) as client:
        try:
            models = await list_models(client, root, args.api_key)
        except (BenchError, httpx.HTTPStatusError, ValueError):
            if args.model is None:
                raise
            models = []  # a server without a usable /models still works when the name is given
    if args.model is None and not models:
        raise BenchError(f"{root}/models lists no model; pass --model")
    model = args.model or str(models[0]["id"])
    entry = next((m for m in models if m.get("id") == model), {})
    counter = resolve_counter(args.tokenizer, [str(entry.get("root") or ""), model])
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    per_level = [args.num_prompts or max(8, 2 * c) for c in settings["concurrency"]]
    if settings["dataset"] == "synthetic":
        workload = datasets.synthetic(counter, settings["input_tokens"], per_level, seed)
    else:
        workloads_dir = Path(args.workloads_dir) if args.workloads_dir else datasets.default_workloads_dir()
        workload = datasets.from_dataset(settings["dataset"], counter, per_level, seed, workloads_dir,
                                         settings["max_prompt_tokens"])
    max_model_len = entry.get("max_model_len") if isinstance(entry.get("max_model_len"), int) else None
    config = ServeConfig(base_url=root, model=model, output_tokens=settings["output_tokens"],
                         concurrency=settings["concurrency"], api_key=args.api_key, max_turns=args.max_turns,
                         ignore_eos=args.ignore_eos, reasoning_history=not args.no_reasoning_history,
                         extra_body=settings["extra_body"], timeout_s=args.timeout, max_model_len=max_model_len,
                         turn_gap_s=args.turn_gap, session_key=args.session_key, output_spread=args.output_spread)

    err = Console(stderr=True)
    err.print(f"[bold]{workload.name}[/]: {workload.description}; seed {seed}"
              f"{'' if args.seed is not None else ' (drawn for this run)'}; tokens: {counter.source}")
    for note in workload.notes:
        err.print(f"[yellow]note:[/] {note}")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err) as progress:
        levels = await Runner(config, counter, progress).run(workload, args.warmup)

    result = report.build_result(
        argv=sys.argv, server={"base_url": root, "model": model, "max_model_len": max_model_len,
                               "models": [m.get("id") for m in models]},
        config={"preset": args.preset, "dataset": settings["dataset"], "input_tokens": settings["input_tokens"],
                "output_tokens": settings["output_tokens"], "output_spread": args.output_spread,
                "concurrency": settings["concurrency"],
                "num_prompts_per_level": per_level, "seed": seed, "seed_explicit": args.seed is not None,
                "warmup": args.warmup, "max_turns": args.max_turns, "ignore_eos": args.ignore_eos,
                "reasoning_history": config.reasoning_history, "extra_body": settings["extra_body"],
                "max_prompt_tokens": settings["max_prompt_tokens"], "timeout_s": args.timeout},
        workload=workload, token_counter=counter.source, tokens_exact=counter.exact, levels=levels)
    out = Console(width=None if sys.stdout.isatty() else 160)  # piped output: do not squeeze the table to 80
    for table in report.summary_tables(result):
        out.print(table)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        out.print(f"wrote {args.json_path}")
    if args.markdown:
        Path(args.markdown).write_text(report.markdown_report(result), encoding="utf-8")
        out.print(f"wrote {args.markdown}")
    if args.plot:
        from reasoning_engine.bench.plots import plot

        plot(result, args.plot)
        out.print(f"wrote {args.plot}")
    return 0 if any(level["completed"] for level in result["levels"]) else 1


def throughput_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from reasoning_engine.bench.throughput import summary_table, throughput

    for key in ("input_tokens", "output_tokens", "num_prompts", "concurrency"):
        if getattr(args, key) < 1:
            print(f"error: --{key.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        summary = throughput(args.model, args.input_tokens, args.output_tokens, args.num_prompts, args.concurrency,
                             args.dtype, args.device, args.compare, args.seed, enforce_eager=args.enforce_eager)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console = Console()
    console.print(summary_table(summary))
    if "speedup_output_tps" in summary:
        console.print(f"reasoning-engine / transformers output tokens/s: [bold]{summary['speedup_output_tps']:.2f}x[/]")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        console.print(f"wrote {args.json_path}")
    return 0
