"""Real replicas: `reasoning-engine serve` of the bundled model in child processes behind the router; one is killed
mid-load and every request still ends, with an answer or a clear error, and the service keeps serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from reasoning_engine.router.local import free_port, start_replicas, stop_replicas
from reasoning_engine.router.policy import RoutingConfig
from reasoning_engine.router.proxy import ProxyConfig, build_router_app
from server.helpers import LiveServer, alive, child_pids, metric_value, wait_for

pytestmark = pytest.mark.slow  # servers in subprocesses

ROOT = Path(__file__).resolve().parents[2]
SERVE_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-blocks", "96",
              "--log-level", "warning"]


def ask(url: str, index: int, stream: bool, outcomes: dict[int, str]) -> None:
    """One request through the router; its outcome: "answer", or "error: ..." for a clear error (an HTTP error
    object, or an error event that ends the stream)."""
    body = {"model": "tiny-reasoner", "messages": [{"role": "user", "content": f"Count to {index + 5}."}],
            "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": stream}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
            if response.status_code != 200:
                outcomes[index] = f"error: {json.loads(response.read())['error']['message']}"
                return
            if not stream:
                answer = json.loads(response.read())
                outcomes[index] = "answer" if answer["choices"][0]["finish_reason"] == "length" else str(answer)
                return
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            outcomes[index] = f"error: {last['error']['message']}" if "error" in last else "answer"
    except Exception as exc:  # noqa: BLE001 - anything else is what the test must not see
        outcomes[index] = f"unclear: {type(exc).__name__} {exc}"


def test_a_replica_killed_mid_load_leaves_no_request_hanging_and_the_service_serving() -> None:
    replicas = start_replicas(2, SERVE_ARGS, timeout=300, log=subprocess.DEVNULL)
    pids = [pid for r in replicas for pid in (r.process.pid, *child_pids(r.process.pid))]
    try:
        proxy = ProxyConfig(connect_timeout=2.0, read_timeout=60.0, health_interval=0.5, health_timeout=2.0)
        app = build_router_app([r.url for r in replicas], RoutingConfig("round-robin"), proxy)
        with LiveServer(app) as router:
            # a stored response's follow-ups reach the replica holding it, though round-robin alternates
            turn = {"model": "tiny-reasoner", "input": "Count to 3.", "max_output_tokens": 8, "temperature": 0}
            previous = httpx.post(f"{router.url}/v1/responses", json=turn, timeout=60).json()["id"]
            for stream in (False, True, False):
                again = httpx.post(f"{router.url}/v1/responses", timeout=60,
                                   json={**turn, "previous_response_id": previous, "stream": stream})
                assert again.status_code == 200, again.text
            assert httpx.get(f"{router.url}/v1/responses/{previous}", timeout=10).status_code == 200
            outcomes: dict[int, str] = {}
            threads = [threading.Thread(target=ask, args=(router.url, i, i % 2 == 0, outcomes)) for i in range(8)]
            for thread in threads:
                thread.start()
            victim = replicas[0]
            metrics = lambda: httpx.get(f"{router.url}/metrics", timeout=5).text  # noqa: E731
            assert wait_for(lambda: metric_value(metrics(), "reasoning_engine:router_replica_in_flight",
                                                 replica=victim.url) >= 2, timeout=60)
            os.killpg(victim.process.pid, signal.SIGKILL)  # the replica and its ranks, mid-generation
            for thread in threads:
                thread.join(timeout=150)
            assert not any(thread.is_alive() for thread in threads), "a request hung"
            assert sorted(outcomes) == list(range(8))
            assert all(o == "answer" or o.startswith("error: ") for o in outcomes.values()), outcomes
            assert any(o == "answer" for o in outcomes.values())
            errors = [o for o in outcomes.values() if o != "answer"]
            assert all("failed mid-way" in e or "no replica could serve" in e for e in errors), errors
            # the service keeps serving, on the replica left
            assert httpx.get(f"{router.url}/health", timeout=5).json()["replicas_up"] == 1
            again: dict[int, str] = {}
            for i, stream in enumerate((False, True)):
                ask(router.url, i, stream, again)
            assert list(again.values()) == ["answer", "answer"]
            assert metric_value(metrics(), "reasoning_engine:router_replica_up", replica=victim.url) == 0.0
    finally:
        stop_replicas(replicas)
    assert not [pid for pid in pids if alive(pid)]


def test_the_router_command_needs_replicas() -> None:
    run = subprocess.run([sys.executable, "-m", "reasoning_engine.cli", "router"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "--replica URL" in run.stderr
    run = subprocess.run([sys.executable, "-m", "reasoning_engine.cli", "router", "--local-replicas", "1", "--",
                          "--port", "9"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--port" in run.stderr


def test_the_router_command_stops_its_local_replicas_on_sigterm_and_sigkill() -> None:
    def router(port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "reasoning_engine.cli", "router", "--port", str(port),
                                 "--local-replicas", "1", "--log-level", "warning", "--", *SERVE_ARGS],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def up(url: str) -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    for sig in (signal.SIGTERM, signal.SIGKILL):
        port = free_port()
        process = router(port)
        try:
            assert wait_for(lambda: up(f"http://127.0.0.1:{port}"), timeout=180, interval=0.5)
            replicas = child_pids(process.pid)
            assert len(replicas) == 1
            replica_pids = [*replicas, *child_pids(replicas[0])]
            process.send_signal(sig)
            process.wait(timeout=60)
            assert wait_for(lambda: not any(alive(pid) for pid in replica_pids), timeout=60), sig
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
