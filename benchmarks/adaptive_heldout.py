"""The adaptive engine against fixed settings on workloads split, before any tuning, into a development part and a
held-out part. Tune on `--part dev`; report both parts.

The split is fixed by a SHA-256 of each item's key, so it never moves with what is tuned:
- `tasks`: the bundled model's own task mix at temperature 0 (one-turn chats from `tiny.data`'s eval generator,
  EOS ends them): development tasks are addition, comparison and letter counting; held-out ones subtraction,
  multiplication and sorting (a task type, not a prompt, is held out);
- `agentic`: the shared agent traces (mini-swe-agent, tau-bench) replayed turn by turn with tool gaps, split by
  trajectory;
- `reasoning`: the shared long reasoning traces, split by problem;
- `copy`: copy-heavy and rewrite prompts (repeat a text, rename a word throughout it, re-indent code), built from the
  shared traces' texts: development prompts use the first two instructions, held-out ones the other two, each over its
  own texts (split by text) — for SmolLM2 (`--model smollm2`), where copying pays.

Servers, one at a time on this machine, configurations alternated round by round (each round's order rotated):
adaptive cold (a fresh `--state-dir`; its first minute is reported apart), adaptive warm (a copy of the state an
adaptive server wrote serving the development part, suffix trees included), the fixed default (`--no-adaptive`, suffix speculation with 8 draft tokens) and a small grid of
fixed settings (no speculation, 2 and 4 draft tokens). Per workload and concurrency: total output tok/s (median over
rounds, every round listed), adaptive / default and adaptive / best fixed ratios. Each server gets one thread
(`--threads`): two cores shared by two processes with two OpenMP threads each stall steps many times over.

    python benchmarks/adaptive_heldout.py [--part held-out] [--workloads tasks,agentic] [--concurrency 1,4,16]
                                          [--rounds 3] [--model DIR|smollm2] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaptive import REPO, SUFFIX, Server, median_figures, smollm2_folder, static, summarize  # noqa: E402

from reasoning_engine.bench.datasets import default_workloads_dir, from_dataset  # noqa: E402
from reasoning_engine.bench.serve import Runner, ServeConfig  # noqa: E402
from reasoning_engine.bench.tokens import TokenCounter  # noqa: E402

DEV_TASKS = ("addition", "comparison", "letters")
HELD_OUT_TASKS = ("subtraction", "multiplication", "sorting")
COPY_INSTRUCTIONS = {
    "dev": ("Repeat the following text exactly, with nothing before or after it:\n\n{text}",
            "Rewrite the following text with every '{old}' replaced by '{new}', changing nothing else:\n\n{text}"),
    "held-out": ("Copy this text word for word:\n\n{text}",
                 "Return the text below in full, but indent every line by two more spaces:\n\n{text}"),
}


def part_of(key: str) -> str:
    """The fixed split: "held-out" for half of all keys, "dev" for the other half."""
    return "held-out" if hashlib.sha256(key.encode()).digest()[0] & 1 else "dev"


def task_prompts(part: str, count: int) -> list[dict[str, Any]]:
    from reasoning_engine.tiny.data import EVAL_SEED, eval_samples

    tasks = DEV_TASKS if part == "dev" else HELD_OUT_TASKS
    samples = [s for s in eval_samples(per_task=count, seed=EVAL_SEED + 7) if s.task in tasks]
    random.Random(f"tasks:{part}").shuffle(samples)
    return [{"messages": s.messages} for s in samples]


def trace_records(dataset: str, part: str) -> list[dict[str, Any]]:
    """The shared traces' records of one part: agentic by trajectory, reasoning by problem."""
    root = default_workloads_dir()
    files = sorted((root / "agentic").glob("*.jsonl")) if dataset == "agentic" else [
        root / "reasoning" / "skyt1_27b_math.jsonl"]
    out = []
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            key = f"{path.stem}:{record['traj_id']}" if dataset == "agentic" else str(record["prompt"])
            if part_of(key) == part:
                out.append(record)
    return out


def copy_prompts(part: str, count: int) -> list[dict[str, Any]]:
    """Copy-heavy and rewrite prompts over the traces' texts of this part (200-1200 characters each)."""
    rng = random.Random(f"copy:{part}")
    texts = [r["output"] for r in trace_records("agentic", part) if 200 <= len(r.get("output", "")) <= 1200]
    rng.shuffle(texts)
    prompts = []
    for i, text in enumerate(texts[:count]):
        instruction = COPY_INSTRUCTIONS[part][i % 2]
        words = [w for w in text.split() if w.isalpha() and len(w) > 3]
        old = rng.choice(words) if words else "the"
        prompt = instruction.format(text=text, old=old, new=old.upper())
        prompts.append({"messages": [{"role": "user", "content": prompt}]})
    return prompts


def workload_file(name: str, part: str, folder: Path, count: int) -> Path:
    path = folder / f"{name}_{part}.jsonl"
    if name == "tasks":
        records = task_prompts(part, count)
    elif name == "copy":
        records = copy_prompts(part, count)
    else:
        records = trace_records(name, part)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def configurations(grid: tuple[int, ...]) -> dict[str, list[str]]:
    spec = ["--speculative-config", SUFFIX.format(k=8)]
    configs = {"adaptive cold": spec, "adaptive warm": spec, "fixed default": ["--no-adaptive", *spec]}
    configs.update({f"fixed k={k}": static(k, 2048) for k in grid})
    return configs


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_server(args: argparse.Namespace, counter: TokenCounter, workload: Any, levels: list[int],
               flags: list[str], multi_turn: bool, adaptive: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """One fresh server over every level: per level its figures (adaptive runs: also those of the first minute) and,
    for an adaptive server, what its snapshot says it did (steps per policy arm, draft tokens, the gate)."""
    server = Server(args.model, flags, args.max_model_len)
    runs, snapshots, cpu = [], {}, {}
    try:
        for level, sessions in zip(levels, workload.levels):
            config = ServeConfig(base_url=server.url, model=server.model_name(), output_tokens=args.output_tokens,
                                 concurrency=[level], max_turns=args.max_turns, ignore_eos=multi_turn,
                                 max_model_len=args.max_model_len, turn_gap_s=args.turn_gap if multi_turn else 0.0,
                                 session_key=multi_turn, extra_body={"temperature": 0})
            before = cpu_seconds(server.proc.pid)
            runs += asyncio.run(Runner(config, counter).run(dataclasses.replace(workload, levels=[sessions]),
                                                            warmup=1))
            cpu[str(level)] = cpu_seconds(server.proc.pid) - before
            if adaptive:
                import httpx

                speculation = httpx.get(f"{server.url}/v1/engine/adaptive", timeout=10).json().get("speculation", {})
                snapshots[str(level)] = {k: speculation.get(k) for k in ("policy_steps", "draft_tokens", "gate")}
    finally:
        server.close()
    out = {"": {str(run.concurrency): summarize(run, multi_turn) for run in runs}}
    for run in runs:  # the warm-up request's CPU time is in, its tokens are not (in every configuration alike)
        figures = out[""][str(run.concurrency)]
        figures["cpu_tps"] = (figures["total_tps"] or 0.0) * run.duration_s / max(cpu[str(run.concurrency)], 1e-9)
    if adaptive:
        out[" (first minute)"] = {str(run.concurrency): summarize(run, multi_turn, True) for run in runs}
    return out, snapshots


def compare(args: argparse.Namespace, counter: TokenCounter, name: str, path: Path, dev_path: Path) -> dict[str, Any]:
    """Every configuration over every level, rounds alternated. Adaptive warm starts from a copy of the state one
    adaptive server wrote serving the development part (suffix trees included), never from a run on the same
    prompts; adaptive cold starts from nothing each round."""
    levels = [int(c) for c in args.concurrency.split(",")]
    sessions = [c * args.sessions for c in levels]
    workload = from_dataset(str(path), counter, sessions, 0, path.parent, args.max_prompt_tokens)
    dev = from_dataset(str(dev_path), counter, sessions, 0, dev_path.parent, args.max_prompt_tokens)
    configs = configurations(tuple(int(k) for k in args.grid.split(",")))
    names = list(configs)
    rounds: dict[str, list[dict[str, Any]]] = {}
    decisions: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="adaptive_heldout_") as states:
        learned = tempfile.mkdtemp(dir=states)
        run_server(args, counter, dev, levels, ["--state-dir", learned, *configs["adaptive warm"]], dev.multi_turn, True)
        print(f"{name}: adaptive state learned on the development part", flush=True)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for config in names[shift:] + names[:shift]:
                flags = configs[config]
                if config == "adaptive cold":
                    flags = ["--state-dir", tempfile.mkdtemp(dir=states), *flags]
                elif config == "adaptive warm":
                    warm = tempfile.mkdtemp(dir=states)
                    shutil.copytree(learned, warm, dirs_exist_ok=True)
                    flags = ["--state-dir", warm, *flags]
                figures, snapshots = run_server(args, counter, workload, levels, flags, workload.multi_turn,
                                                config.startswith("adaptive"))
                for key, per_level in figures.items():
                    rounds.setdefault(config + key, []).append(per_level)
                if snapshots:
                    decisions.setdefault(config, []).append(snapshots)
                print(f"{name} round {round_ + 1} {config}: " + ", ".join(
                    f"c{c} {r['total_tps']:.1f} tok/s" for c, r in rounds[config][-1].items()), flush=True)
    return {"description": workload.description,
            "results": {config: {level: median_figures([r[level] for r in runs]) for level in runs[0]}
                        for config, runs in rounds.items()},
            "adaptive": decisions}


def ratio_rows(results: dict[str, Any]) -> list[str]:
    rows = []
    for level in results["fixed default"]:
        default = results["fixed default"][level]["total_tps"] or 1e-9
        fixed = {n: r[level]["total_tps"] or 0.0 for n, r in results.items() if n.startswith("fixed")}
        best = max(fixed, key=fixed.get)
        cold = results["adaptive cold"][level]["total_tps"] or 0.0
        first = results["adaptive cold (first minute)"][level]["total_tps"] or 0.0
        warm = results["adaptive warm"][level]["total_tps"] or 0.0
        per_round = [w / max(d, 1e-9) for w, d in zip(results["adaptive cold"][level]["total_tps_runs"],
                                                         results["fixed default"][level]["total_tps_runs"])]
        cpu = {n: r[level]["cpu_tps"] or 1e-9 for n, r in results.items() if "cpu_tps" in r[level]}
        cpu_best = max((n for n in cpu if n.startswith("fixed")), key=cpu.get)
        rows.append(f"| {level} | {cold / default:.2f}x ({', '.join(f'{r:.2f}' for r in per_round)}) | "
                    f"{first / default:.2f}x | {warm / default:.2f}x | {warm / max(fixed[best], 1e-9):.2f}x | "
                    f"{best} | {cpu['adaptive cold'] / cpu['fixed default']:.2f}x | "
                    f"{cpu['adaptive warm'] / cpu['fixed default']:.2f}x | {cpu['adaptive warm'] / cpu[cpu_best]:.2f}x "
                    f"({cpu_best}) |")
    return rows


def report(data: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"# Adaptive against fixed settings, {args.part} part ({datetime.date.today()}, this machine: "
             f"{os.cpu_count()} cores)", "",
             f"`python benchmarks/adaptive_heldout.py {' '.join(sys.argv[1:])}`: model "
             f"{args.model_label}, float32 on CPU, {args.rounds} rounds with the configurations alternated, "
             f"{args.sessions} sessions per concurrency slot, temperature 0.", ""]
    for name, entry in data.items():
        results = entry["results"]
        lines += [f"## {name} ({args.part})", "", entry["description"], "",
                  "| config | concurrency | total tok/s (median; rounds) | tok per CPU s | per request tok/s | "
                  "TTFT p50 (s) |", "|---|---|---|---|---|---|"]
        for config, levels in results.items():
            for level, r in levels.items():
                runs = ", ".join(f"{v:.1f}" for v in r["total_tps_runs"])
                cpu = f"{r['cpu_tps']:.1f}" if "cpu_tps" in r else "-"
                lines.append(f"| {config} | {level} | {r['total_tps'] or 0:.1f} ({runs}) | {cpu} | "
                             f"{r['per_request_tps'] or 0:.1f} | {r['ttft_p50'] or 0:.2f} |")
        lines += ["", "Ratios of total output tok/s (wall clock), then of output tokens per CPU second of the server "
                  "(less moved by other processes on a shared machine):", "",
                  "| concurrency | adaptive cold / default (per round) | cold's first minute / default | "
                  "adaptive warm / default | warm / best fixed | best fixed | CPU: cold / default | "
                  "CPU: warm / default | CPU: warm / best fixed |", "|---|---|---|---|---|---|---|---|---|"]
        lines += ratio_rows(results)
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("dev", "held-out"), default="dev",
                        help="dev to tune on (the default); held-out only to report")
    parser.add_argument("--workloads", default="tasks,agentic")
    parser.add_argument("--model", default=None, help="checkpoint folder, or 'smollm2' (default: the bundled model)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--sessions", type=int, default=2, help="sessions (prompts) per concurrency slot")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grid", default="0,2,4", help="draft lengths of the fixed grid besides the default's 8")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=128,
                        help="max_tokens per request (agent turns ignore EOS and run to it)")
    parser.add_argument("--turn-gap", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of each server")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit it
    from transformers import AutoTokenizer

    from reasoning_engine.llm import bundled_model_dir

    args.model_label = args.model or "the bundled tiny reasoner"
    if args.model == "smollm2":
        args.model = smollm2_folder(Path(tempfile.gettempdir()) / "smollm2-135m-instruct-hf")
    model_dir = args.model or bundled_model_dir()
    counter = TokenCounter(AutoTokenizer.from_pretrained(model_dir), model_dir)
    data: dict[str, Any] = {}
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="heldout_workloads_") as folder:
        for name in args.workloads.split(","):
            count = sum(levels) * args.sessions
            path = workload_file(name, args.part, Path(folder), count)
            dev_path = path if args.part == "dev" else workload_file(name, "dev", Path(folder), count)
            data[name] = compare(args, counter, name, path, dev_path)
    label = "smollm2" if args.model_label == "smollm2" else "bundled"
    out = args.out or str(REPO / "benchmarks" / "results" /
                          f"adaptive_heldout_{label}_{args.part}_cpu_{datetime.date.today()}")
    Path(out + ".json").write_text(json.dumps(data, indent=1))
    text = report(data, args)
    Path(out + ".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
