"""The router's HTTP app: every route but its own /health and /metrics is forwarded to the replica the policy picks,
bytes unchanged, streams event by event.

Nothing hangs: connecting and every read from a replica have timeouts. A request that has not yet sent the client a
byte (connection refused or reset, a timeout, a 502/503/504, a stream that broke before its first event) is retried
on another healthy replica, at most `max_attempts` replicas in all, and the replica that failed is marked down until
a health check (GET /health every `health_interval` s) finds it answering again. A stream that breaks once events
reached the client ends with an in-band error event in the API's shape (and `[DONE]` where the API has one).
A generation request is safe to retry: a replica that failed before answering left nothing behind the client sees
(except a /v1/responses `store` it may have kept). A request that needs a stored response (router/stored.py) goes to
the replica that made it and nowhere else: if that one fails, the error names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import FastAPI
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from reasoning_engine.router.errors import error_response, stream_error
from reasoning_engine.router.metrics import RouterMetrics
from reasoning_engine.router.policy import ReplicaState, RoundRobin, RoutingConfig, choose
from reasoning_engine.router.prefix import DEFAULT_BLOCK_CHARS, DEFAULT_MAX_BLOCKS, block_hashes, prompt_text
from reasoning_engine.router.stored import ResponseOwners, referenced_response, response_id

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})  # the replica could not serve it: another one may
ID_EVENTS = 4  # a new response's stream names it in its first event (response.created); looked for in so many
# hop-by-hop headers (RFC 9110 section 7.6.1) and those httpx / the ASGI server set again
_DROP_REQUEST_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                                   "upgrade", "proxy-connection"})
_DROP_RESPONSE_HEADERS = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date",
                                    "server"})


@dataclass(frozen=True)
class ProxyConfig:
    connect_timeout: float = 5.0
    read_timeout: float = 600.0  # the longest a replica may stay silent: before a whole answer, or between events
    health_interval: float = 2.0
    health_timeout: float = 2.0
    max_attempts: int = 3
    max_body_bytes: int = 8 * 1024 * 1024
    block_chars: int = DEFAULT_BLOCK_CHARS
    max_blocks: int = DEFAULT_MAX_BLOCKS

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout", "health_interval", "health_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_attempts < 1 or self.max_body_bytes < 1:
            raise ValueError("max_attempts and max_body_bytes must be >= 1")


class Router:
    """The replicas, the policy's state and the HTTP client they share."""

    def __init__(self, urls: list[str], routing: RoutingConfig, proxy: ProxyConfig) -> None:
        if not urls:
            raise ValueError("the router needs at least one replica URL")
        urls = [url.rstrip("/") for url in urls]
        if len(set(urls)) != len(urls):
            raise ValueError("replica URLs must be distinct")
        self.replicas = [ReplicaState(url, max_blocks=proxy.max_blocks) for url in urls]
        self.routing, self.proxy = routing, proxy
        self.turn = RoundRobin()
        self.metrics = RouterMetrics(self.replicas)
        self.client: httpx.AsyncClient | None = None
        self.owners = ResponseOwners()  # stored responses' replicas

    async def owner_of(self, response: str) -> ReplicaState | None:
        """The replica holding stored response `response`: as noted, else the first that answers GET
        /v1/responses/{id} with 200 (noted then); None if none does (the policy picks, and that replica's 404 names
        the parameter)."""
        url = self.owners.get(response)
        known = next((r for r in self.replicas if r.url == url), None)
        if known is not None:
            return known
        assert self.client is not None
        for replica in sorted(self.replicas, key=lambda r: not r.healthy):
            try:
                answer = await self.client.get(f"{replica.url}/v1/responses/{quote(response, safe='')}",
                                               timeout=self.proxy.health_timeout)
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                self.owners.note(response, replica.url)
                return replica
        return None

    def open(self) -> None:
        timeout = httpx.Timeout(self.proxy.read_timeout, connect=self.proxy.connect_timeout)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                               max_keepalive_connections=64))

    def mark_down(self, replica: ReplicaState, reason: str) -> None:
        if replica.healthy:
            logger.warning("replica %s marked down: %s", replica.url, reason)
        replica.healthy = False

    async def check(self, replica: ReplicaState) -> None:
        """One health check; a replica that comes back has lost its cache as far as the router knows."""
        assert self.client is not None
        try:
            response = await self.client.get(f"{replica.url}/health", timeout=self.proxy.health_timeout)
            healthy = response.status_code == 200
        except httpx.HTTPError as exc:
            healthy, response = False, exc
        if healthy and not replica.healthy:
            logger.warning("replica %s is up", replica.url)
            replica.prefix.clear()
        elif not healthy:
            self.mark_down(replica, f"health check: {response}")
        replica.healthy = healthy

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(replica) for replica in self.replicas))
            await asyncio.sleep(self.proxy.health_interval)


def build_router_app(urls: list[str], routing: RoutingConfig | None = None,
                     proxy: ProxyConfig | None = None) -> FastAPI:
    router = Router(urls, routing or RoutingConfig(), proxy or ProxyConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router.open()
        checks = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks
            assert router.client is not None
            await router.client.aclose()

    app = FastAPI(title="reasoning-engine router", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        """200 while some replica is up; 503 when none is."""
        up = [r.url for r in router.replicas if r.healthy]
        if not up:
            return error_response("/health", 503, "no replica is up")
        return JSONResponse({"status": "ok", "replicas_up": len(up), "replicas": len(router.replicas)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(request: Request) -> Response:
        return await _forward(router, request)

    return app


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None when it is over `limit` bytes (read no further than that)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _prompt_hashes(body: bytes, block_chars: int) -> list[bytes]:
    """The prompt's block hashes; [] for a body that is not JSON or nests too deeply to read (the replica answers
    it with its own 400)."""
    try:
        return block_hashes(prompt_text(json.loads(body) if body else None), block_chars)
    except (ValueError, RecursionError):
        return []


async def _forward(router: Router, request: Request) -> Response:
    path = request.url.path
    try:
        body = await _read_body(request, router.proxy.max_body_bytes)
    except ClientDisconnect:
        return Response(status_code=499)
    if body is None:
        return error_response(path, 413, f"request body over {router.proxy.max_body_bytes} bytes")
    hashes = _prompt_hashes(body, router.proxy.block_chars) if request.method == "POST" else []
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST_HEADERS]
    assert router.client is not None
    stored = referenced_response(request.method, path, body)
    owner = await router.owner_of(stored) if stored is not None else None
    creates = request.method == "POST" and path == "/v1/responses"  # its answer names a response to note
    tried: set[str] = set()
    failures: list[str] = []
    while len(tried) < router.proxy.max_attempts:
        if owner is not None:  # only the replica holding the stored response can serve it
            replica = owner if owner.url not in tried else None
        else:
            replica = choose(router.replicas, hashes, router.routing, router.turn, frozenset(tried))
        if replica is None:
            break
        tried.add(replica.url)
        replica.requests += 1
        replica.in_flight += 1
        replica.active_blocks += len(hashes)
        replica.prefix.add(hashes)  # the next turn of this conversation finds it here, even while this one runs
        lease = _Lease(replica, len(hashes))
        upstream: httpx.Response | None = None
        try:
            upstream = await router.client.send(
                router.client.build_request(request.method, replica.url + path, params=request.query_params,
                                            headers=headers, content=body), stream=True)
            if upstream.status_code in RETRY_STATUSES:
                await upstream.aclose()
                raise _ReplicaFailed(f"answered {upstream.status_code}")
            chunks = upstream.aiter_raw()
            if "text/event-stream" not in upstream.headers.get("content-type", ""):
                content = b"".join([chunk async for chunk in chunks])
                await upstream.aclose()
                if upstream.status_code == 200:
                    _note_stored(router, replica, request.method, stored, creates, content)
                return Response(content, status_code=upstream.status_code, headers=_response_headers(upstream))
            events = _events(chunks)
            first = await anext(events, b"")  # a stream that breaks before its first event is retried elsewhere
            lease.upstream = upstream
            relay = _relay(router, lease, path, first, events, creates and upstream.status_code == 200)
            return StreamingResponse(relay, status_code=upstream.status_code,
                                     headers=_response_headers(upstream), background=BackgroundTask(lease.release))
        except (httpx.HTTPError, _ReplicaFailed) as exc:
            replica.failures += 1
            router.metrics.retries.inc()
            router.mark_down(replica, f"{type(exc).__name__}: {exc}")
            failures.append(f"{replica.url}: {type(exc).__name__} {exc}".strip())
            if upstream is not None:
                await upstream.aclose()
        finally:
            if lease.upstream is None:
                await lease.release()
    detail = "; ".join(failures) if failures else "every replica is down"
    if owner is not None:
        return error_response(path, 502, f"the replica holding response {stored} could not serve the request "
                                         f"({detail})")
    return error_response(path, 503 if not failures else 502, f"no replica could serve the request ({detail})")


def _note_stored(router: Router, replica: ReplicaState, method: str, stored: str | None, creates: bool,
                 content: bytes) -> None:
    """After a 200: a new response's id noted on its replica, a deleted one forgotten."""
    if creates:
        made = response_id(content)
        if made is not None:
            router.owners.note(made, replica.url)
    elif method == "DELETE" and stored is not None:
        router.owners.forget(stored)


class _ReplicaFailed(Exception):
    """A replica answered with a status another replica may not."""


def _response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS}


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Server-sent events, whole (ending in a blank line), so a stream cut mid-event never hands the client half
    of one; the bytes are the replica's."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        end = max(pending.rfind(b"\n\n"), pending.rfind(b"\r\n\r\n"))
        if end < 0:
            continue
        cut = end + (4 if pending[end:end + 4] == b"\r\n\r\n" else 2)
        yield pending[:cut]
        pending = pending[cut:]
    if pending:
        yield pending


class _Lease:
    """A request's slot on its replica, given back once, by whichever comes first: the stream's end (or the client
    leaving it) or the response's background task."""

    def __init__(self, replica: ReplicaState, blocks: int) -> None:
        self.replica, self.blocks = replica, blocks
        self.upstream: httpx.Response | None = None  # set once a stream is handed to the client
        self._released = False

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.replica.in_flight -= 1
        self.replica.active_blocks -= self.blocks
        if self.upstream is not None:
            await self.upstream.aclose()  # closing the connection aborts the replica's request


async def _relay(router: Router, lease: _Lease, path: str, first: bytes, events: AsyncIterator[bytes],
                 creates: bool = False) -> AsyncIterator[bytes]:
    """The replica's stream; if it breaks, an in-band error ends it. `creates`: a new response's stream, whose id
    (in its first events) is noted on the replica."""
    replica = lease.replica
    looking = ID_EVENTS if creates else 0  # events left to find the new response's id in
    try:
        if first:
            looking = _note_created(router, replica, first, looking)
            yield first
        async for event in events:
            looking = _note_created(router, replica, event, looking)
            yield event
    except httpx.HTTPError as exc:
        replica.failures += 1
        router.metrics.broken_streams.inc()
        router.mark_down(replica, f"stream broke: {type(exc).__name__}")
        yield stream_error(path, f"the replica serving this stream failed mid-way ({type(exc).__name__}); "
                                 "the request may be sent again")
    finally:
        await lease.release()


def _note_created(router: Router, replica: ReplicaState, event: bytes, looking: int) -> int:
    """While `looking` (events left to look in), note the response id `event` carries on `replica`; what is left to
    look in after it (0 once found)."""
    if looking <= 0:
        return 0
    made = response_id(event)
    if made is None:
        return looking - 1
    router.owners.note(made, replica.url)
    return 0
