"""The router's HTTP proxy over stand-in replicas: bytes pass through, failures are retried or reported, nothing
hangs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx

from reasoning_engine.router.policy import RoutingConfig
from reasoning_engine.router.proxy import ProxyConfig, build_router_app
from server.helpers import LiveServer, metric_value, sse_events, wait_for

from .fake_replicas import chat, dead_url, event, fake_replica

FAST = ProxyConfig(connect_timeout=1.0, read_timeout=1.0, health_interval=0.2, health_timeout=0.5)


@contextmanager
def routed(replicas: list, policy: str = "round-robin", proxy: ProxyConfig = FAST) -> Iterator[tuple[str, list]]:
    """(router URL, the replica apps) with each app in `replicas` live (a str is a URL used as it is)."""
    with ExitStack() as stack:
        urls = [item if isinstance(item, str) else stack.enter_context(LiveServer(item)).url for item in replicas]
        router = stack.enter_context(LiveServer(build_router_app(urls, RoutingConfig(policy), proxy)))
        yield router.url, urls


def test_answers_and_streams_pass_through_unchanged() -> None:
    with routed([fake_replica("a"), fake_replica("b")]) as (url, urls):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat(True), timeout=10) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            raw = b"".join(response.iter_raw())
        name = response.headers["x-replica"]
        assert raw == event(name, 0) + event(name, 1) + event(name, 2) + b"data: [DONE]\n\n"
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat(False), timeout=10)
        assert answer.status_code == 200 and answer.json()["replica"] != name  # round-robin: the other one
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "fake"
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["replicas_up"] == 2
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        counts = [metric_value(metrics, "reasoning_engine:router_replica_requests_total", replica=u) for u in urls]
        assert sorted(counts) == [1.0, 2.0]  # two generations, one /v1/models
        assert metric_value(metrics, "reasoning_engine:router_replica_in_flight", replica=urls[0]) == 0.0


def test_a_dead_replica_is_retried_elsewhere_and_marked_down() -> None:
    doomed = LiveServer(fake_replica("a"))
    slow_checks = ProxyConfig(connect_timeout=1.0, read_timeout=1.0, health_interval=60)
    with doomed, routed([doomed.url, fake_replica("b")], proxy=slow_checks) as (url, _):
        assert httpx.get(f"{url}/health", timeout=10).json()["replicas_up"] == 2
        doomed.__exit__()  # it stops between health checks: the first request sent there finds it gone
        dead = doomed.url
        for stream in (False, True, False, True):
            response = httpx.post(f"{url}/v1/chat/completions", json=chat(stream), timeout=10)
            assert response.status_code == 200, response.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert metric_value(metrics, "reasoning_engine:router_replica_up", replica=dead) == 0.0
        assert metric_value(metrics, "reasoning_engine:router_replica_failures_total", replica=dead) == 1.0
        assert httpx.get(f"{url}/health", timeout=10).json()["replicas_up"] == 1


def test_a_silent_or_unavailable_replica_times_out_and_the_request_goes_elsewhere() -> None:
    for mode in ("silent", "unavailable"):
        with routed([fake_replica("a", mode), fake_replica("b")]) as (url, _):
            for stream in (False, True):
                start = time.monotonic()
                response = httpx.post(f"{url}/v1/chat/completions", json=chat(stream), timeout=30)
                assert response.status_code == 200 and response.headers["x-replica"] == "b"
                assert time.monotonic() - start < 5  # the read timeout (1 s), not the client's


def test_a_stream_cut_midway_ends_with_an_in_band_error() -> None:
    with routed([fake_replica("a", "cut")]) as (url, _):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat(True), timeout=10) as response:
            events = sse_events(response)
        assert events[:2] == [{"replica": "a", "index": 0}, {"replica": "a", "index": 1}]
        assert events[2]["error"]["code"] == "replica_failed" and "mid-way" in events[2]["error"]["message"]
        assert events[3:] == ["[DONE]"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503  # marked down by the broken stream
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, timeout=5)
        with httpx.stream("POST", f"{url}/v1/messages", json=chat(True), timeout=10) as response:
            text = response.read().decode()
        assert text.endswith('event: error\ndata: {"type":"error","error":{"type":"api_error","message":"the '
                             'replica serving this stream failed mid-way (RemoteProtocolError); the request may be '
                             'sent again"}}\n\n')
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert metric_value(metrics, "reasoning_engine:router_broken_streams_total") == 2.0


def test_no_replica_left_is_a_clear_error_not_a_hang() -> None:
    with routed([dead_url(), fake_replica("a", "cut")]) as (url, urls):
        response = httpx.post(f"{url}/v1/chat/completions", json=chat(False), timeout=10)
        assert response.status_code == 502
        message = response.json()["error"]["message"]
        assert message.startswith("no replica could serve the request") and all(u in message for u in urls)
        response = httpx.post(f"{url}/v1/messages", json=chat(False), timeout=10)
        assert response.status_code == 502 and response.json()["type"] == "error"  # Anthropic's shape there
    with routed([dead_url()]) as (url, _):
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, timeout=5)


def test_an_oversized_body_is_refused() -> None:
    proxy = ProxyConfig(connect_timeout=1.0, read_timeout=1.0, max_body_bytes=1000)
    with routed([fake_replica("a")], proxy=proxy) as (url, _):
        response = httpx.post(f"{url}/v1/chat/completions", json=chat(False, "x" * 2000), timeout=10)
        assert response.status_code == 413 and "1000 bytes" in response.json()["error"]["message"]


def test_cache_aware_keeps_a_conversation_on_its_replica() -> None:
    with routed([fake_replica("a"), fake_replica("b")], policy="cache-aware") as (url, _):
        placed = {}
        for turn in range(3):
            for session in range(4):
                messages = [{"role": "user", "content": f"session {session} " * 30}]
                messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}] * turn
                body = {"model": "fake", "messages": messages}
                replica = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).json()["replica"]
                assert placed.setdefault(session, replica) == replica
        assert sorted(placed.values()) == ["a", "a", "b", "b"]  # new sessions spread over the replicas


def test_a_client_leaving_a_stream_frees_its_slot() -> None:
    with routed([fake_replica("a", events=10_000)]) as (url, urls):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat(True), timeout=10) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            in_flight = metric_value(httpx.get(f"{url}/metrics", timeout=5).text,
                                     "reasoning_engine:router_replica_in_flight", replica=urls[0])
            assert in_flight == 1.0
        assert wait_for(lambda: metric_value(httpx.get(f"{url}/metrics", timeout=5).text,
                                             "reasoning_engine:router_replica_in_flight", replica=urls[0]) == 0.0,
                        timeout=5)


def test_bodies_the_router_cannot_read_go_to_the_replica_to_refuse() -> None:
    with routed([fake_replica("a")], policy="cache-aware") as (url, _):
        for body in (b"{not json", b"[" * 100_000, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
            response = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=10,
                                  headers={"content-type": "application/json"})
            assert response.status_code == 400 and "not JSON" in response.text  # the replica's answer, not a 500
