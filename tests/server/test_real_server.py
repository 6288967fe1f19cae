"""The real server with the real engine on loopback, through the real openai client and httpx.

The model is $SERVER_TEST_MODEL when set (any Kimi-format checkpoint folder), else the bundled tiny reasoning model
when its files are present, else a tiny random llama speaking through a Kimi-format tokenizer; tests that need the
model to answer correctly (the calculator call) run only with the bundled model. Greedy decoding, small max_tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from reasoning_engine.server.app import ServerConfig, build_app

from .helpers import LiveServer, metric_value, save_random_checkpoint, stream_chat, wait_for

pytestmark = pytest.mark.slow  # servers in subprocesses

ROOT = Path(__file__).resolve().parents[2]


def _bundled_dir() -> Path | None:
    try:
        from reasoning_engine.tiny import BUNDLED_MODEL_DIR
    except ImportError:
        return None
    return Path(BUNDLED_MODEL_DIR) if (Path(BUNDLED_MODEL_DIR) / "config.json").is_file() else None


BUNDLED = _bundled_dir()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("SERVER_TEST_MODEL"):
        return Path(os.environ["SERVER_TEST_MODEL"])
    return BUNDLED or save_random_checkpoint(tmp_path_factory.mktemp("random_kimi_llama"))


def context_length(model_dir: Path, cap: int = 1024) -> int:
    return min(cap, json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", cap))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Any]:
    from reasoning_engine.engine.async_engine import AsyncLLM

    llm = AsyncLLM(model=str(model_dir), device="cpu", max_model_len=context_length(model_dir), kv_cache_blocks=128,
                   block_size=16, max_num_seqs=8)
    yield llm
    llm.shutdown_sync()


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[LiveServer]:
    with LiveServer(build_app(engine, ServerConfig(shutdown_engine=False))) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


MSG = [{"role": "user", "content": "What is 347 + 589?"}]


def metrics(server: LiveServer) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def test_chat_stream_matches_non_stream(client: openai.OpenAI, model_name: str) -> None:
    kwargs = {"model": model_name, "messages": MSG, "max_tokens": 24, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert 0 <= full.usage.completion_tokens_details.reasoning_tokens <= full.usage.completion_tokens
    streamed = stream_chat(client, **kwargs)
    assert streamed["reasoning"] == (choice.message.reasoning_content or "")
    assert streamed["content"] == (choice.message.content or "")
    assert streamed["finish"] == choice.finish_reason
    assert streamed["usage"].completion_tokens == full.usage.completion_tokens
    assert (streamed["usage"].completion_tokens_details.reasoning_tokens
            == full.usage.completion_tokens_details.reasoning_tokens)


def test_thinking_off(client: openai.OpenAI, model_name: str, server: LiveServer) -> None:
    off = {"chat_template_kwargs": {"thinking": False}}
    result = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=12, temperature=0,
                                            extra_body=off)
    assert result.choices[0].message.reasoning_content is None
    assert result.usage.completion_tokens_details.reasoning_tokens == 0
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": MSG, **off}, timeout=30).json()
    assert result.usage.prompt_tokens == tokens["count"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()["prompt"]
    assert text.endswith("<think></think>")


def test_thinking_budget(client: openai.OpenAI, model_name: str, server: LiveServer) -> None:
    base = {"model": model_name, "messages": MSG, "max_tokens": 16, "temperature": 0}
    free = client.chat.completions.create(**base, extra_body={"ignore_eos": True})
    budget = stream_chat(client, **base, extra_body={"ignore_eos": True, "thinking_token_budget": 3})
    assert budget["usage"].completion_tokens == 16
    reasoning = budget["usage"].completion_tokens_details.reasoning_tokens
    assert reasoning <= 4, "3 thinking tokens, then the forced </think>"
    assert reasoning <= free.usage.completion_tokens_details.reasoning_tokens
    # a zero budget with thinking on behaves like thinking off: same prompt, no thinking
    zero = client.chat.completions.create(**base, extra_body={"thinking_token_budget": 0})
    off = client.chat.completions.create(**base, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert zero.usage.completion_tokens_details.reasoning_tokens == 0
    assert zero.usage.prompt_tokens == off.usage.prompt_tokens
    assert zero.choices[0].message.content == off.choices[0].message.content


def test_logprobs_and_n(client: openai.OpenAI, model_name: str) -> None:
    result = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=2, extra_body={"ignore_eos": True})
    entries = result.choices[0].logprobs.content
    assert len(entries) == 6
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)
    streamed = []
    for chunk in client.chat.completions.create(model=model_name, messages=MSG, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True,
                                                extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, entries, strict=True))
    sampled = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=5, n=3, temperature=1.0,
                                             seed=7)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]


def test_completions(client: openai.OpenAI, model_name: str) -> None:
    kwargs = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kwargs, logprobs=1)
    assert full.usage.completion_tokens == 10
    assert len(full.choices[0].logprobs.tokens) == 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    echoed = client.completions.create(**kwargs, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + full.choices[0].text


def test_cache_salt_keeps_prefixes_apart(client: openai.OpenAI, server: LiveServer, model_name: str) -> None:
    """Requests share cached prompt blocks only under the same cache_salt (chat, streamed completions, responses);
    a salt the engine refuses is a 400 naming it."""
    messages = [{"role": "user", "content": "Which of 12, 5 and 9 is the largest? Say why in one sentence."}]

    def chat(salt: str) -> int:
        out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1, temperature=0,
                                             extra_body={"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    def streamed_completion(salt: str) -> int:
        chunks = client.completions.create(model=model_name, prompt="The quick brown fox jumps over the lazy dog.",
                                           max_tokens=1, stream=True, stream_options={"include_usage": True},
                                           extra_body={"cache_salt": salt})
        return [c.usage for c in chunks if c.usage][-1].prompt_tokens_details.cached_tokens

    def response(salt: str) -> int:
        out = client.responses.create(model=model_name, input="Name three prime numbers below twenty, please.",
                                      max_output_tokens=1, extra_body={"cache_salt": salt})
        return out.usage.input_tokens_details.cached_tokens

    for run in (chat, streamed_completion, response):
        first, again, other = run("tenant-a"), run("tenant-a"), run("tenant-b")
        assert first == 0 and again >= 16 and other == 0, (run.__name__, first, again, other)
    refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                         json={"model": model_name, "messages": messages, "cache_salt": ""})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"


def test_user_errors_with_the_real_engine(server: LiveServer, model_name: str) -> None:
    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", json={"model": model_name, "messages": MSG, **body},
                          timeout=60)

    for body, param in [({"max_tokens": 5000}, "max_tokens"), ({"temperature": -1}, "temperature"),
                        ({"messages": [{"role": "user", "content": "7" * 2000}]}, "messages"),
                        ({"n": 0}, "n"), ({"tool_choice": "maybe", "tools": []}, "tool_choice")]:
        response = post(body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)
    for body in [{"top_k": 10**9}, {"stop_token_ids": [10**9]}, {"seed": 2**63 - 1}, {"seed": -5}, {"min_p": 1.0},
                 {"repetition_penalty": 0.01}, {"stop": ["a", "b", "c", "d", "e"]}, {"top_p": 1e-9},
                 {"presence_penalty": 2, "frequency_penalty": -2}, {"temperature": 1e-9}, {"temperature": 100}]:
        response = post({**body, "max_tokens": 4})
        assert response.status_code in (200, 400), (body, response.text)


def test_concurrent_streams(client: openai.OpenAI, model_name: str) -> None:
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results.append(stream_chat(client, model=model_name, messages=[{"role": "user", "content": f"Hi {i}"}],
                                       max_tokens=12, temperature=0))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 5, errors
    assert all(r["finish"] in ("stop", "length") for r in results)


def test_disconnect_frees_blocks_and_metrics(server: LiveServer, model_name: str) -> None:
    context = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    body = {"model": model_name, "messages": MSG, "max_tokens": context - 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(8):
            next(lines)
        assert metric_value(metrics(server), "reasoning_engine:kv_cache_usage_perc") > 0
    assert wait_for(lambda: metric_value(metrics(server), "reasoning_engine:kv_cache_usage_perc") == 0, timeout=60)
    text = metrics(server)
    assert metric_value(text, "reasoning_engine:kv_cache_free_blocks") == metric_value(
        text, "reasoning_engine:kv_cache_total_blocks")
    assert metric_value(text, "reasoning_engine:num_requests_running") == 0
    assert metric_value(text, "reasoning_engine:request_success_total", finished_reason="abort") >= 1
    for name in ["num_requests_waiting", "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total", "reasoning_tokens_total", "time_to_first_token_seconds_count",
                 "time_to_first_answer_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"]:
        assert metric_value(text, f"reasoning_engine:{name}") is not None, name
    assert metric_value(text, "reasoning_engine:generation_tokens_total") > 0
    assert metric_value(text, "reasoning_engine:prefix_cache_queries_total") > 0


def test_adaptive_gauges_and_counters_in_metrics(client: openai.OpenAI, server: LiveServer, model_name: str) -> None:
    """The adaptive engine in /metrics: gauges of what it measured and holds now, counters of what it decided. A turn
    with a session key (`user`) has its blocks kept, which the counter of protected turns shows."""
    before = metric_value(metrics(server), "reasoning_engine:adaptive_protected_turns_total") or 0
    client.chat.completions.create(model=model_name, messages=MSG, max_tokens=8, user="agent-1")
    assert wait_for(lambda: (metric_value(metrics(server), "reasoning_engine:adaptive_protected_turns_total") or 0)
                    == before + 1, timeout=30)
    text = metrics(server)
    assert "# TYPE reasoning_engine:adaptive_protected_turns_total counter" in text
    assert "# TYPE reasoning_engine:adaptive_protected_blocks gauge" in text
    assert metric_value(text, "reasoning_engine:adaptive_protected_blocks") > 0
    assert metric_value(text, "reasoning_engine:adaptive_cost_seconds_per_step") >= 0
    for name in ["decided_steps", "verifying_steps", "gated_steps", "plain_check_steps", "probed_requests",
                 "chosen_draft_tokens", "retention_hit_tokens", "default_policy_steps", "adaptive_policy_steps",
                 "plain_policy_steps", "offered_draft_tokens", "verified_draft_tokens", "accepted_draft_tokens",
                 "default_asked_draft_tokens"]:
        assert metric_value(text, f"reasoning_engine:adaptive_{name}_total") is not None, name


def test_chat_cli_one_shot(server: LiveServer) -> None:
    run = subprocess.run([sys.executable, "-m", "reasoning_engine.server.cli", "chat", "--base-url",
                          f"{server.url}/v1", "--max-tokens", "16", "--temperature", "0", "-m", "What is 2 + 3?"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "tokens" in run.stdout and "thinking]" in run.stdout, (run.stdout, run.stderr)


def test_serve_without_bundled_model_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from reasoning_engine.server import cli

    monkeypatch.setattr("reasoning_engine.config.BUNDLED_MODEL_DIR", tmp_path)
    assert cli.main(["serve"]) == 2
    assert "bundled tiny model" in capsys.readouterr().err


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_finishes_in_flight_stream_then_exits(model_dir: Path) -> None:
    port = _free_port()
    env = {**os.environ, "REASONING_ENGINE_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "reasoning_engine.server.cli", "serve", str(model_dir), "--port",
                             str(port), "--device", "cpu", "--max-model-len", str(context_length(model_dir, 512)),
                             "--kv-cache-blocks", "64",
                             "--log-level", "info"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _healthy(url), timeout=120), "server did not come up"
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{url}/", timeout=10).status_code == 200, "the playground page is public"
        body = {"messages": MSG, "max_tokens": 60, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer k"}) as response:
            lines = response.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            events = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                      for line in [first, *lines] if line.startswith("data: ")]
        assert events[-1] == "[DONE]", "the in-flight stream completed"
        assert any(isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"] == "length"
                   for e in events)
        # uvicorn re-raises the captured SIGTERM once it has shut down gracefully
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        output = proc.stdout.read()
        assert "Application shutdown complete" in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_engine_has_every_member_the_server_calls(engine: Any) -> None:
    from reasoning_engine.server.engine_client import EngineClient

    members = [name for name in vars(EngineClient) if not name.startswith("_")]
    assert [name for name in members if not hasattr(engine, name)] == [] and engine.is_running


def test_health_is_503_once_the_engine_loop_has_died(model_dir: Path) -> None:
    """The engine loop dies as it does when a rank of a distributed engine exits (a step fails and the executor
    reports the failure): the request in flight is a 503, the loop thread ends, and /health answers 503 from then
    on, where it used to say ok."""
    from reasoning_engine.engine.async_engine import AsyncLLM

    llm = AsyncLLM(model=str(model_dir), device="cpu", max_model_len=context_length(model_dir, 256),
                   kv_cache_blocks=32, block_size=16, max_num_seqs=2)
    try:
        with LiveServer(build_app(llm, ServerConfig(shutdown_engine=False))) as live:
            assert httpx.get(f"{live.url}/health", timeout=30).status_code == 200

            def failing_step() -> None:
                llm.engine.runner.executor.failure = "rank 1 exited"
                raise RuntimeError("collective timed out")

            llm.engine.step = failing_step  # type: ignore[method-assign]
            reply = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 4},
                               timeout=60)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "engine_unavailable"
            assert wait_for(lambda: not llm._thread.is_alive(), timeout=30)
            health = httpx.get(f"{live.url}/health", timeout=30)
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    finally:
        llm.shutdown_sync()


def test_bundled_model_answers_with_thinking(client: openai.OpenAI, model_name: str) -> None:
    assert model_name == "tiny-reasoner"
    result = client.chat.completions.create(model=model_name, messages=MSG, temperature=0)
    message = result.choices[0].message
    assert message.reasoning_content, "the bundled model thinks first"
    assert (message.content or "").strip() and "</think>" not in message.content
    assert result.usage.completion_tokens_details.reasoning_tokens > 0


CALCULATOR = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def test_bundled_model_calls_the_calculator(client: openai.OpenAI, model_name: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 4821 * 377?"}]
    kwargs = {"model": model_name, "tools": CALCULATOR, "temperature": 0}
    streamed = stream_chat(client, messages=messages, **kwargs)
    assert streamed["finish"] == "tool_calls"
    call = streamed["calls"][0]
    assert call["name"] == "calculator" and call["id"].startswith("functions.calculator:")
    assert json.loads(call["arguments"]) == {"expression": "4821 * 377"}

    result = client.chat.completions.create(messages=messages, **kwargs)
    message = result.choices[0].message
    assert result.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["calculator"]
    assert json.loads(message.tool_calls[0].function.arguments) == json.loads(call["arguments"])  # stream == whole
    messages += [
        {"role": "assistant", "content": message.content, "reasoning_content": message.reasoning_content,
         "tool_calls": [c.model_dump() for c in message.tool_calls]},
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": str(4821 * 377)},
    ]
    answer = client.chat.completions.create(messages=messages, **kwargs)
    assert answer.choices[0].finish_reason == "stop"
    assert (answer.choices[0].message.reasoning_content or "").strip()  # it thinks about the tool result
    assert "1817517" in (answer.choices[0].message.content or "")
