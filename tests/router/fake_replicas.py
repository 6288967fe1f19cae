"""Stand-in replicas for the router's HTTP tests: small apps that answer, stream, go silent or break a stream."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse


def fake_replica(name: str, mode: str = "ok", events: int = 3) -> FastAPI:
    """`mode`: ok; silent (never answers a generation request); cut (a stream breaks after two events, a
    non-streamed answer is dropped); unavailable (503)."""
    app = FastAPI()
    app.state.prompts = []

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"}, status_code=503 if mode == "unavailable" else 200)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": name}]})

    @app.post("/v1/chat/completions")
    @app.post("/v1/messages")
    async def generate(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):
            return JSONResponse({"error": {"message": "the body is not JSON"}}, status_code=400)
        app.state.prompts.append(body)
        if mode == "silent":
            await asyncio.sleep(3600)
        if mode == "unavailable":
            return JSONResponse({"error": {"message": "engine down"}}, status_code=503)
        if not body.get("stream"):
            if mode == "cut":  # the connection drops half-way through the answer
                return StreamingResponse(half_answer(), media_type="application/json")
            return JSONResponse({"replica": name, "content": "hello"}, headers={"x-replica": name})
        return StreamingResponse(stream_events(name, mode, events), media_type="text/event-stream",
                                 headers={"x-replica": name})

    app.state.responses = {}

    @app.post("/v1/responses")
    async def respond(request: Request) -> Response:
        """A stored response per call, named after the replica; 404 for a previous_response_id it does not hold."""
        body = json.loads(await request.body())
        previous = body.get("previous_response_id")
        if previous is not None and previous not in app.state.responses:
            return JSONResponse({"error": {"message": "no stored response", "param": "previous_response_id"}},
                                status_code=404)
        made = {"id": f"resp_{name}_{len(app.state.responses)}", "object": "response", "replica": name}
        app.state.responses[made["id"]] = made
        if not body.get("stream"):
            return JSONResponse(made, headers={"x-replica": name})

        async def created() -> AsyncIterator[bytes]:
            yield f"event: response.created\ndata: {json.dumps({'type': 'response.created', 'response': made})}\n\n".encode()
            yield b'event: response.completed\ndata: {"type": "response.completed"}\n\n'
        return StreamingResponse(created(), media_type="text/event-stream", headers={"x-replica": name})

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    async def stored(response_id: str, request: Request) -> Response:
        held = app.state.responses.get(response_id)
        if held is None:
            return JSONResponse({"error": {"message": "no stored response"}}, status_code=404)
        if request.method == "DELETE":
            del app.state.responses[response_id]
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        return JSONResponse(held, headers={"x-replica": name})

    return app


def event(name: str, index: int) -> bytes:
    return f"data: {json.dumps({'replica': name, 'index': index})}\n\n".encode()


async def half_answer() -> AsyncIterator[bytes]:
    yield b'{"replica": '
    raise ConnectionResetError("replica died")


async def stream_events(name: str, mode: str, count: int) -> AsyncIterator[bytes]:
    for index in range(count):
        if mode == "cut" and index == 2:
            raise ConnectionResetError("replica died mid-stream")
        yield event(name, index)
        await asyncio.sleep(0.01)
    yield b"data: [DONE]\n\n"


def dead_url() -> str:
    """A loopback URL nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def chat(stream: bool, text: str = "hi") -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": text}], "stream": stream}
