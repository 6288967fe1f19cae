"""`reasoning-engine chat`: a terminal client for any OpenAI-compatible server.

It streams the thinking dimmed and the answer plain, shows tool calls, and keeps the conversation (with each
turn's reasoning_content passed back, as interleaved-thinking templates expect). httpx only, so it needs nothing
beyond the package's own dependencies.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

import httpx
from rich.console import Console

_THINKING_STYLE = "dim italic"


class ChatError(Exception):
    pass


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_text(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text or response.reason_phrase


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """Server-sent events' JSON payloads, up to `data: [DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ChatError(event["error"].get("message", "error"))
        yield event


class ChatSession:
    """One conversation with a server; `send` streams a reply to the console and records it in the history."""

    def __init__(self, client: httpx.Client, console: Console, *, model: str, system: str | None,
                 request_options: dict[str, Any], show_thinking: bool) -> None:
        self.client = client
        self.console = console
        self.model = model
        self.options = request_options
        self.show_thinking = show_thinking
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []

    def send(self, text: str) -> dict[str, Any]:
        """Stream one reply; a failed or interrupted turn leaves the history as it was."""
        self.messages.append({"role": "user", "content": text})
        try:
            reply = self._stream_reply()
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append(reply)
        return reply

    def _stream_reply(self) -> dict[str, Any]:
        body = {"model": self.model, "messages": self.messages, "stream": True,
                "stream_options": {"include_usage": True}, **self.options}
        reasoning: list[str] = []
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] = {}
        in_thinking = False
        with self.client.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise ChatError(f"{response.status_code}: {_error_text(response)}")
            for event in _events(response):
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("reasoning_content"):
                        if self.show_thinking:
                            in_thinking = True
                            self.console.print(delta["reasoning_content"], style=_THINKING_STYLE, end="",
                                               markup=False, highlight=False)
                        reasoning.append(delta["reasoning_content"])
                    if delta.get("content"):
                        if in_thinking:
                            self.console.print("\n")
                            in_thinking = False
                        self.console.print(delta["content"], end="", markup=False, highlight=False)
                        content.append(delta["content"])
                    for call in delta.get("tool_calls") or []:
                        slot = calls.setdefault(call["index"], {"id": None, "type": "function",
                                                                "function": {"name": "", "arguments": ""}})
                        slot["id"] = call.get("id") or slot["id"]
                        function = call.get("function") or {}
                        slot["function"]["name"] += function.get("name") or ""
                        slot["function"]["arguments"] += function.get("arguments") or ""
        for call in calls.values():
            self.console.print(f"\n[tool call] {call['function']['name']}({call['function']['arguments']})",
                               style="cyan", markup=False, highlight=False)
        self.console.print()
        if usage:
            details = usage.get("completion_tokens_details") or {}
            self.console.print(f"[{usage.get('completion_tokens', 0)} tokens, "
                               f"{details.get('reasoning_tokens', 0)} thinking]", style="dim", markup=False)
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if reasoning:
            reply["reasoning_content"] = "".join(reasoning)
        if calls:
            reply["tool_calls"] = [calls[i] for i in sorted(calls)]
        return reply


def _request_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.no_thinking:
        options["chat_template_kwargs"] = {"thinking": False, "enable_thinking": False}
    if args.max_thinking_tokens is not None:
        options["thinking_token_budget"] = args.max_thinking_tokens
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        options["temperature"] = args.temperature
    return options


def run_chat(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    with httpx.Client(base_url=args.base_url.rstrip("/"), headers=_headers(args.api_key),
                      timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        try:
            model = args.model or _first_model(client)
        except (httpx.HTTPError, ChatError) as exc:
            console.print(f"error: cannot reach {args.base_url}: {exc}", style="red", markup=False)
            return 1
        session = ChatSession(client, console, model=model, system=args.system, request_options=_request_options(args),
                              show_thinking=not args.hide_thinking)
        if args.message:
            for message in args.message:
                if not _turn(session, console, message):
                    return 1
            return 0
        console.print(f"Chatting with {model} at {args.base_url}. /reset clears the conversation, /exit quits.",
                      style="bold", markup=False)
        while True:
            try:
                text = console.input("[bold green]> [/]").strip()
            except (EOFError, KeyboardInterrupt):
                console.print()
                return 0
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                session.messages = session.messages[:1] if args.system else []
                continue
            if text:
                try:
                    _turn(session, console, text)
                except KeyboardInterrupt:
                    console.print("\n[interrupted]", style="yellow", markup=False)


def _turn(session: ChatSession, console: Console, text: str) -> bool:
    try:
        session.send(text)
        return True
    except (httpx.HTTPError, ChatError) as exc:
        console.print(f"\nerror: {exc}", style="red", markup=False)
        return False


def _first_model(client: httpx.Client) -> str:
    response = client.get("/models")
    if response.status_code != 200:
        raise ChatError(f"{response.status_code}: {_error_text(response)}")
    return response.json()["data"][0]["id"]
