"""The server over a distributed engine: `serve --tensor-parallel-size 2` of the bundled
model answers the unmodified openai client as one process does; a killed rank fails the in-flight request with an
error and the server exits non-zero within 30 s, leaving no process behind; SIGTERM stops every rank."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from reasoning_engine.engine.async_engine import AsyncLLM
from reasoning_engine.server.app import ServerConfig, build_app

from .helpers import LiveServer, alive, child_pids, stream_chat, wait_for

pytestmark = pytest.mark.slow  # servers over ranks in subprocesses

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=512, kv_cache_blocks=96, block_size=16)
QUESTIONS = ["What is 347 + 589?", "Sort these numbers: 42, 7, 19, 88", "How many r's are in strawberry?"]
CALCULATOR = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def one_process_client() -> Iterator[openai.OpenAI]:
    engine = AsyncLLM(**ENGINE)
    try:
        with LiveServer(build_app(engine, ServerConfig())) as live:
            yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        engine.shutdown_sync()


def _answers(client: openai.OpenAI) -> list[Any]:
    """Greedy answers to the questions (whole and streamed) and a calculator call. A streamed answer's chunking is
    left out: how many tokens a chunk carries follows the adaptive engine's draft lengths, which follow measured step
    times and so differ between any two servers; the order of its parts (reasoning, then content) is kept."""
    out: list[Any] = []
    for question in QUESTIONS:
        message = client.chat.completions.create(model="tiny-reasoner", temperature=0,
                                                 messages=[{"role": "user", "content": question}]).choices[0].message
        out.append((message.reasoning_content, message.content))
    for kwargs in ({"messages": [{"role": "user", "content": QUESTIONS[0]}]},
                   {"messages": [{"role": "user", "content": "What is 4821 * 377?"}], "tools": CALCULATOR}):
        streamed = stream_chat(client, model="tiny-reasoner", temperature=0, **kwargs)
        streamed["order"] = [part for i, part in enumerate(streamed["order"]) if streamed["order"][i - 1:i] != [part]]
        out.append(streamed)
    return out


def http_port() -> int:
    """A free port below Linux's ephemeral range: the server's ranks meet at ports the OS hands out
    (`engine.distributed.free_port`), which could otherwise take this one before uvicorn binds it."""
    for port in random.Random(os.getpid()).sample(range(20000, 32000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


class ServeProcess:
    """`reasoning-engine serve` of the bundled model in a child process, its output collected."""

    def __init__(self, *args: str) -> None:
        self.port = http_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reasoning_engine.cli", "serve", "--port", str(self.port), "--device", "cpu",
             "--dtype", "float32", "--max-model-len", "512", "--kv-cache-blocks", "96", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        assert wait_for(self._healthy, timeout=120), "".join(self.lines)
        self.ranks = child_pids(self.proc.pid)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for pid in self.ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_tensor_parallel_server_answers_as_one_process(one_process_client: openai.OpenAI) -> None:
    server = ServeProcess("--tensor-parallel-size", "2")
    try:
        assert len(server.ranks) == 1  # rank 1; rank 0 is the server itself
        assert _answers(server.client()) == _answers(one_process_client)
    finally:
        server.close()


def test_a_killed_rank_fails_the_request_and_the_server_exits() -> None:
    server = ServeProcess("--tensor-parallel-size", "2", "--enable-expert-parallel")
    try:
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": "tiny-reasoner", "messages": [{"role": "user", "content": QUESTIONS[1]}],
                    "max_tokens": 400, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(timeout=60)
        killed = time.monotonic()
        os.kill(server.ranks[0], signal.SIGKILL)
        reader.join(timeout=30)
        code = server.proc.wait(timeout=30)
        assert time.monotonic() - killed < 30
        assert code == 1
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: "):])["error"]
        assert error["code"] == "engine_unavailable" and "rank 1" in error["message"]
        assert not any(alive(pid) for pid in server.ranks)
        assert "error: the engine stopped" in "".join(server.lines)
    finally:
        server.close()


def test_sigterm_stops_every_rank() -> None:
    server = ServeProcess("--tensor-parallel-size", "2")
    try:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert wait_for(lambda: not any(alive(pid) for pid in server.ranks), timeout=15)
        assert wait_for(lambda: "Finished server process" in "".join(server.lines), timeout=5)  # all output read
        assert "did not take the shutdown call" not in "".join(server.lines)  # the ranks stopped in order
    finally:
        server.close()
