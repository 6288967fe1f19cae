"""The policy gate (reasoning_engine/adaptive/gate.py) on scores as noisy as real ones: what it loses or gains over
a few hundred steps when the other policies are worse or better than the fixed default.

Step 1 serves the development task types (benchmarks/adaptive_heldout.py's split) at concurrency 1 with the bundled
model and records every score the gate is given (its spread comes from what each step's drafts happened to match).
Step 2 runs the gate alone on bootstrap draws of the default's recorded scores, scaled per policy to the case's
relative means, for many seeds, and prints each case's mean and worst ratio to always running the default.
`--gate FILE` simulates another version of gate.py (e.g. `git show REV:reasoning_engine/adaptive/gate.py > old.py`),
so two versions compare on the same draws.

    python benchmarks/gate_bootstrap.py [--prompts 120] [--scores FILE] [--gate FILE ...] [--seeds 60]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

CASES = {"adaptive worse, plain worse": {"default": 1.0, "adaptive": 0.7, "plain": 0.55},
         "adaptive slightly worse": {"default": 1.0, "adaptive": 0.93, "plain": 0.55},
         "adaptive better": {"default": 1.0, "adaptive": 1.3, "plain": 0.55},
         "plain better": {"default": 1.0, "adaptive": 1.05, "plain": 1.6}}
TOKENS_PER_DECODE = {"default": 2.0, "adaptive": 2.0, "plain": 1.0}


def record_scores(prompts: int, path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from adaptive_heldout import task_prompts

    from reasoning_engine import LLM, SamplingParams
    from reasoning_engine.adaptive import gate

    scores = []
    add = gate.Bucket.add

    def recording(self, arm: str, score: float, tokens_per_decode: float = 1.0) -> None:  # type: ignore[no-untyped-def]
        scores.append((arm, score, tokens_per_decode))
        add(self, arm, score, tokens_per_decode)

    gate.Bucket.add = recording  # type: ignore[method-assign]
    llm = LLM(speculative_config={"method": "suffix", "num_speculative_tokens": 8}, state_dir=tempfile.mkdtemp())
    for p in task_prompts("dev", prompts)[:prompts]:
        llm.chat([p["messages"]], SamplingParams(temperature=0, max_tokens=256), use_tqdm=False)
    path.write_text(json.dumps(scores))


def load_gate(path: str, name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def simulate(gate, base: list[float], relative: dict[str, float], horizon: int, seed: int) -> float:  # type: ignore[no-untyped-def]
    rng, bucket, total = random.Random(seed), gate.Bucket(), 0.0
    for _ in range(horizon):
        arm = bucket.choose()
        bucket.add(arm, rng.choice(base) * relative[arm], TOKENS_PER_DECODE[arm])
        total += relative[arm]
    return total / horizon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=120)
    parser.add_argument("--scores", default=None, help="recorded scores to reuse (else recorded now)")
    parser.add_argument("--gate", action="append", default=None, help="gate.py versions to compare (default: this)")
    parser.add_argument("--seeds", type=int, default=60)
    parser.add_argument("--horizons", default="300,700,2000")
    args = parser.parse_args()
    path = Path(args.scores or tempfile.mktemp(suffix=".json"))
    if args.scores is None:
        record_scores(args.prompts, path)
    recorded = json.loads(path.read_text())
    base = [s for arm, s, _ in recorded if arm == "default"]
    base = [s / statistics.mean(base) for s in base]
    print(f"{len(recorded)} recorded scores; the default's: spread {statistics.pstdev(base):.2f} of the mean")
    files = args.gate or [str(Path(__file__).resolve().parents[1] / "reasoning_engine" / "adaptive" / "gate.py")]
    gates = {f: load_gate(f, f"gate_{i}") for i, f in enumerate(files)}
    for name, relative in CASES.items():
        for horizon in (int(h) for h in args.horizons.split(",")):
            cells = []
            for f, gate in gates.items():
                runs = [simulate(gate, base, relative, horizon, seed) for seed in range(args.seeds)]
                cells.append(f"{Path(f).name}: mean {statistics.mean(runs):.3f} worst {min(runs):.3f}")
            print(f"{name:28s} {horizon:5d} steps  " + "  |  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
