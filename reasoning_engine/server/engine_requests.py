"""An HTTP request's engine requests, from submission to abort: `EngineRequests` (one per prompt, merged into one
output stream, aborted whatever happens to the client), the streaming response that closes them however it ends,
and the helpers that notice a client that left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from reasoning_engine.engine.async_engine import EngineDeadError
from reasoning_engine.engine.engine import PromptType
from reasoning_engine.outputs import RequestOutput
from reasoning_engine.sampling_params import SamplingParams
from reasoning_engine.server.engine_client import EngineClient
from reasoning_engine.server.errors import APIError, bad_request

T = TypeVar("T")
logger = logging.getLogger(__name__)


async def shielded(awaitable: Awaitable[Any]) -> None:
    """Run cleanup to completion even while the calling task is being cancelled (a client that left, a
    graceful-shutdown timeout): anyio's shield covers Starlette's cancel scopes, asyncio.shield a bare cancel."""
    with anyio.CancelScope(shield=True):
        await asyncio.shield(awaitable)


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (so its cleanup aborts the engine request) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


class EngineStreamResponse(StreamingResponse):
    """A streaming response whose `on_close` runs however the stream ends: finished, client gone, or cancelled."""

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await shielded(self._close())

    async def _close(self) -> None:
        await self.body_iterator.aclose()  # type: ignore[attr-defined]
        await self._on_close()


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def param_of(message: str) -> str | None:
    """SamplingParams and the engine start their ValueError messages with the field at fault."""
    word = message.split(" ", 1)[0].strip(":,")
    return word if word.isidentifier() else None


class EngineRequests:
    """The engine requests behind one HTTP request (one per prompt), merged into one output stream; `close`
    aborts whichever did not finish, which frees their KV blocks."""

    def __init__(self, engine: EngineClient, prompts: Sequence[PromptType], params: SamplingParams, base_id: str,
                 session: str | None = None, workload: str = "default",
                 error_param: Callable[[str], str | None] = param_of) -> None:
        """`session` and `workload`: for the adaptive engine (KV retention, acceptance by class); `error_param`:
        the request parameter an engine ValueError's message is about."""
        self._engine = engine
        self._error_param = error_param
        self.ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        self._gens: list[AsyncGenerator[RequestOutput, None]] = [
            engine.generate(p, params, rid, session_id=session, workload=workload)
            for p, rid in zip(prompts, self.ids, strict=True)]
        self._first: list[RequestOutput] = []
        self._finished = [False] * len(prompts)
        self._tasks: list[asyncio.Future[None]] = []

    async def start(self) -> None:
        """Submit every request and wait for its first output, so a request the engine refuses (ValueError) is a
        clean 400 before any byte of a stream is sent."""
        results = await asyncio.gather(*(anext(g) for g in self._gens), return_exceptions=True)
        for result in results:
            if isinstance(result, ValueError):
                raise bad_request(str(result), param=self._error_param(str(result))) from result
            if isinstance(result, EngineDeadError):
                raise APIError(503, f"the engine is not running: {result}", code="engine_unavailable") from result
            if isinstance(result, BaseException):
                raise result
        self._first = results

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self._gens) == 1:
            out: RequestOutput | None = self._first[0]
            while out is not None:
                self._finished[0] = out.finished
                yield 0, out
                out = None if out.finished else await anext(self._gens[0], None)
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                await queue.put((i, self._first[i]))
                if not self._first[i].finished:
                    async for item in self._gens[i]:
                        await queue.put((i, item))
                        if item.finished:
                            break
                await queue.put((i, None))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
                await queue.put((i, exc))

        tasks = self._tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self._gens))]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self._finished[i] = item.finished
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop the merge tasks, close the engine streams and abort what is unfinished; one failure does not stop
        the rest, since every unfinished request holds KV blocks."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for gen, rid, finished in zip(self._gens, self.ids, self._finished, strict=True):
            try:
                if not finished:
                    await self._engine.abort(rid)
                await gen.aclose()
            except Exception:  # cleanup goes on for the other requests
                logger.exception("closing request %s failed", rid)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
