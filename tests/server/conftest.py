"""Fixtures: the Kimi-format test tokenizer and live servers around the fake engine (HTTP-layer tests).
The real engine's fixtures live in test_real_server.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from reasoning_engine.server.app import ServerConfig, build_app

from .fake_engine import FakeEngine
from .helpers import LiveServer, save_kimi_tokenizer


@pytest.fixture(scope="session")
def kimi_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return save_kimi_tokenizer(tmp_path_factory.mktemp("kimi_tokenizer"))


@pytest.fixture
def fake_server(kimi_tokenizer: Any) -> Iterator[Callable[..., tuple[FakeEngine, str]]]:
    """`fake_server(script, **config)` -> (engine, base url) of a live server around a FakeEngine; `script` is the
    text every choice generates (a string, or a function of (prompt ids, params, choice index))."""
    servers: list[LiveServer] = []

    def start(script: Any = "", *, engine_options: dict[str, Any] | None = None,
              **config: Any) -> tuple[FakeEngine, str]:
        fn = script if callable(script) else (lambda _prompt, _params, _index: script)
        engine = FakeEngine(kimi_tokenizer, fn, **(engine_options or {}))
        server = LiveServer(build_app(engine, ServerConfig(**config))).__enter__()
        servers.append(server)
        return engine, server.url

    yield start
    for server in servers:
        server.__exit__(None, None, None)
