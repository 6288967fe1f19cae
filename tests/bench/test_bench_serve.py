"""`bench serve` against a real `reasoning-engine serve` subprocess on loopback.

The model is the bundled tiny reasoning model when its files exist, else a tiny random llama with a thinking chat
template (tests/bench/checkpoint.py). A thinking budget in every request makes the answer arrive, so both the
reasoning and the answer timings are exercised. The server's own /metrics counters check the benchmark's token
accounting independently of the usage it read.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx
import pytest

from reasoning_engine.bench.report import LATENCY_METRICS, TOKEN_METRICS
from reasoning_engine.bench.serve import RequestRecord, ServeConfig
from reasoning_engine.cli import main
from reasoning_engine.config import load_model_config
from reasoning_engine.tiny import BUNDLED_MODEL_DIR

from .checkpoint import build_checkpoint

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # slow: benchmark runs against live servers
BUDGET = '{"thinking_token_budget": 8}'


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if (BUNDLED_MODEL_DIR / "config.json").is_file():
        model, extra = BUNDLED_MODEL_DIR, []
    else:
        model, extra = build_checkpoint(tmp_path_factory.mktemp("bench_model")), ["--reasoning-parser", "kimi_k2"]
    context = min(1024, load_model_config(model).max_position_embeddings)
    port = _free_port()
    log = tmp_path_factory.mktemp("bench_server") / "server.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "reasoning_engine.cli", "serve", str(model), "--host", "127.0.0.1",
                                 "--port", str(port), "--device", "cpu", "--max-model-len", str(context),
                                 "--log-level", "warning", *extra],
                                stdout=sink, stderr=subprocess.STDOUT,
                                # one OpenMP thread: on a shared, oversubscribed CPU torch's default slows it 5-30x
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not become healthy:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _counter(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"reasoning_engine:{name}_total{{"):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name}_total missing from /metrics")


def _run(url: str, tmp_path: Path, *argv: str) -> dict[str, Any]:
    out, plot, markdown = tmp_path / "result.json", tmp_path / "result.png", tmp_path / "result.md"
    assert main(["bench", "serve", "--base-url", url, "--warmup", "0", "--extra-body", BUDGET, "--json", str(out),
                 "--plot", str(plot), "--markdown", str(markdown), *argv]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    result = json.loads(out.read_text())
    table_rows = [line for line in markdown.read_text().splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table_rows) == len(result["levels"]) + sum(len(level.get("per_turn", [])) for level in result["levels"])
    return result


def _check_records(result: dict[str, Any], max_tokens: int) -> None:
    names = {f.name for f in fields(RequestRecord)}
    answered = 0
    for r in result["requests"]:
        assert set(r) == names
        assert r["error"] is None, r["error"]
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        if r["ttfa_s"] is not None:
            answered += 1
            assert r["ttft_s"] <= r["ttfa_s"] <= r["e2e_s"]
            assert r["answer_tokens"] > 0
        assert r["token_source"] == "usage"
        assert r["output_tokens"] == r["reasoning_tokens"] + r["answer_tokens"] <= max_tokens
        assert r["prompt_tokens"] > 0 and r["cached_tokens"] is not None
    assert answered > 0, "the thinking budget should make answers arrive"


def test_bench_serve_synthetic(server: str, tmp_path: Path) -> None:
    generated, reasoning = _counter(server, "generation_tokens"), _counter(server, "reasoning_tokens")
    result = _run(server, tmp_path, "--input-tokens", "48", "--output-tokens", "24", "--concurrency", "1,2",
                  "--num-prompts", "3", "--seed", "7")
    assert {"benchmark", "version", "created", "argv", "server", "config", "workload", "tokens", "definitions",
            "levels", "requests"} <= set(result)
    assert result["config"]["seed"] == 7 and result["config"]["seed_explicit"]
    assert result["tokens"]["exact"] and "served model" in result["tokens"]["counter"]
    assert [level["concurrency"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert level["completed"] == 3 and level["errors"] == 0
        for key in ("request_throughput_rps", "output_throughput_tps", "total_token_throughput_tps", "duration_s"):
            assert level[key] > 0
        for metric in LATENCY_METRICS + TOKEN_METRICS:
            assert set(level["metrics"][metric]) == {"mean", "p50", "p90", "p99", "count"}
        ttft = level["metrics"]["ttft_s"]
        assert ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    assert len(result["requests"]) == 6
    _check_records(result, 24)
    # the benchmark's token accounting agrees with the server's own counters
    records = result["requests"]
    assert _counter(server, "generation_tokens") - generated == sum(r["output_tokens"] for r in records)
    assert _counter(server, "reasoning_tokens") - reasoning == sum(r["reasoning_tokens"] for r in records)


def test_bench_serve_multi_turn_sessions(server: str, tmp_path: Path) -> None:
    data = tmp_path / "sessions.jsonl"
    lines = [json.dumps({"traj_id": f"t{t}", "step": s,
                         "prompt": f"Session {t} step {s}: list the files, then read the largest one and summarise it."})
             for t in range(2) for s in range(3)]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = _run(server, tmp_path, "--dataset", str(data), "--output-tokens", "16", "--concurrency", "1",
                  "--num-prompts", "2", "--seed", "1")
    assert result["workload"]["multi_turn"]
    _check_records(result, 16)
    level = result["levels"][0]
    assert level["completed"] == 6 and level["sessions_cut_short"] == 0
    turns = level["per_turn"]
    assert [row["turn"] for row in turns] == [0, 1, 2]
    assert turns[0]["prompt_tokens_mean"] < turns[1]["prompt_tokens_mean"] < turns[2]["prompt_tokens_mean"]
    assert turns[2]["cache_hit_rate"] > 0, "a later turn reuses the earlier turns' prefix"


def test_bench_serve_output_spread_draws_each_turns_length_within_its_bounds(server: str, tmp_path: Path) -> None:
    """With EOS ignored every request runs to its max_tokens: one fixed length finishes closed-loop sessions in
    lockstep, so --output-spread draws each turn's own, the same on every run."""
    data = tmp_path / "sessions.jsonl"
    lines = [json.dumps({"traj_id": f"t{t}", "step": s, "prompt": f"Session {t} step {s}: count the files."})
             for t in range(3) for s in range(2)]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = _run(server, tmp_path, "--dataset", str(data), "--output-tokens", "16", "--output-spread", "0.5",
                  "--ignore-eos", "--concurrency", "2", "--num-prompts", "3", "--seed", "1")
    assert result["config"]["output_spread"] == 0.5
    config = ServeConfig(base_url=server, model="m", output_tokens=16, concurrency=[2], output_spread=0.5)
    lengths = [r["output_tokens"] for r in result["requests"]]
    assert lengths == [config.turn_output_tokens(r["session"], r["turn"]) for r in result["requests"]]
    assert all(8 <= n <= 24 for n in lengths) and len(set(lengths)) > 1
    assert "max output tokens 16 +- 50% (ignore_eos)" in (tmp_path / "result.md").read_text()
    with pytest.raises(ValueError, match="--output-spread"):
        ServeConfig(base_url=server, model="m", output_tokens=16, concurrency=[2], output_spread=1.0)
