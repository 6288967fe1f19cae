"""Stored Responses API responses behind the router (reasoning_engine/router/stored.py): a request that names one
goes to the replica holding it, whatever the policy would pick; an id the router never saw is looked up; the holder
gone is an error naming the response."""

from __future__ import annotations

import httpx

from reasoning_engine.router.proxy import ProxyConfig
from reasoning_engine.router.stored import MAX_ID_CHARS, ResponseOwners, referenced_response, response_id
from server.helpers import LiveServer

from .fake_replicas import fake_replica
from .test_proxy import FAST, routed


def _create(url: str, stream: bool = False, previous: str | None = None) -> httpx.Response:
    body = {"model": "fake", "input": "hi", "stream": stream}
    if previous is not None:
        body["previous_response_id"] = previous
    return httpx.post(f"{url}/v1/responses", json=body, timeout=10)


def test_follow_ups_reads_and_deletes_go_to_the_replica_holding_the_response() -> None:
    with routed([fake_replica("a"), fake_replica("b")]) as (url, _):  # round-robin
        for stream in (False, True):
            first = _create(url, stream)
            assert first.status_code == 200
            holder = first.headers["x-replica"]
            made = response_id(first.content.split(b"\n\n")[0])  # the JSON body, or the stream's first event
            assert made is not None and made.startswith(f"resp_{holder}_")
            for _ in range(3):  # round-robin alone would send every other one to the replica without it
                again = _create(url, previous=made)
                assert again.status_code == 200 and again.headers["x-replica"] == holder, again.text
            read = httpx.get(f"{url}/v1/responses/{made}", timeout=10)
            assert read.status_code == 200 and read.json()["replica"] == holder
        gone = httpx.delete(f"{url}/v1/responses/{made}", timeout=10)
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        assert httpx.get(f"{url}/v1/responses/{made}", timeout=10).status_code == 404


def test_a_response_the_router_never_saw_is_found_by_asking_the_replicas() -> None:
    with LiveServer(fake_replica("a")) as a, LiveServer(fake_replica("b")) as b:
        made = _create(b.url).json()["id"]  # made before the router existed
        with routed([a.url, b.url]) as (url, _):
            for _ in range(3):
                again = _create(url, previous=made)
                assert again.status_code == 200 and again.headers["x-replica"] == "b"
            missing = _create(url, previous="resp_nobody")  # held nowhere: a replica's own 404
            assert missing.status_code == 404 and "previous_response_id" in missing.text


def test_the_holder_gone_is_an_error_naming_the_response_not_a_404_elsewhere() -> None:
    doomed = LiveServer(fake_replica("a"))
    slow_checks = ProxyConfig(connect_timeout=1.0, read_timeout=1.0, health_interval=60)
    with doomed, LiveServer(fake_replica("b")) as b, routed([doomed.url, b.url], proxy=slow_checks) as (url, _):
        made = next(r.json()["id"] for r in (_create(url), _create(url)) if r.headers["x-replica"] == "a")
        doomed.__exit__()
        again = _create(url, previous=made)
        assert again.status_code == 502 and made in again.json()["error"]["message"]
        assert _create(url).status_code == 200  # new conversations go on


def test_ids_are_read_only_where_a_request_names_a_stored_response() -> None:
    assert referenced_response("POST", "/v1/responses", b'{"previous_response_id": "resp_1"}') == "resp_1"
    assert referenced_response("GET", "/v1/responses/resp_2", b"") == "resp_2"
    assert referenced_response("GET", "/v1/responses/resp_3/input_items", b"") == "resp_3"
    assert referenced_response("DELETE", "/v1/responses/resp_4", b"") == "resp_4"
    assert referenced_response("POST", "/v1/chat/completions", b'{"previous_response_id": "resp_1"}') is None
    for hostile in (b"not json", b"[" * 100000, b'{"previous_response_id": 7}', b'{"previous_response_id": ""}',
                    b'{"previous_response_id": "' + b"x" * (MAX_ID_CHARS + 1) + b'"}'):
        assert referenced_response("POST", "/v1/responses", hostile) is None
    assert response_id(b'{"id": "resp_9", "object": "response"}') == "resp_9"
    assert response_id(b'event: response.created\ndata: {"type": "response.created", "response": '
                       b'{"id": "resp_8", "object": "response"}}\n\n') == "resp_8"
    assert response_id(b'{"id": "chatcmpl-1", "object": "chat.completion"}') is None
    assert response_id(b"[" * 100000) is None


def test_the_owner_table_is_bounded() -> None:
    owners = ResponseOwners(limit=3)
    for i in range(5):
        owners.note(f"resp_{i}", "http://a")
    assert len(owners) == 3 and owners.get("resp_0") is None and owners.get("resp_4") == "http://a"
    owners.forget("resp_4")
    assert owners.get("resp_4") is None
