"""The playground's routes without a browser: what is public, what needs the key, what /playground/info reports."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from reasoning_engine.server.app import ServerConfig, build_app
from reasoning_engine.server.playground import PUBLIC_PATHS, STATIC_DIR
from server.fake_engine import FakeEngine
from server.helpers import save_kimi_tokenizer

KEY = "route-test-key"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return save_kimi_tokenizer(tmp_path_factory.mktemp("kimi_tokenizer"))


def client(tokenizer: Any, engine: FakeEngine | None = None, **config: Any) -> TestClient:
    engine = engine or FakeEngine(tokenizer, lambda *_: "")
    return TestClient(build_app(engine, ServerConfig(shutdown_engine=False, **config)))


def test_page_and_assets_are_public_and_locked_down(tokenizer: Any) -> None:
    http = client(tokenizer, api_key=KEY)
    for path in PUBLIC_PATHS:
        response = http.get(path)
        assert response.status_code == 200, path
        assert "script-src 'self'" in response.headers["content-security-policy"]
        assert KEY not in response.text
    assert http.get("/").headers["content-type"].startswith("text/html")
    assert http.get("/static/app.js").headers["content-type"].startswith("text/javascript")


@pytest.mark.parametrize("path", ["/static/index.html", "/static/..%2Fplayground.py", "/static/missing.js"])
def test_only_the_known_assets_are_served(tokenizer: Any, path: str) -> None:
    response = client(tokenizer).get(path)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_info_needs_the_key_like_the_api(tokenizer: Any) -> None:
    http = client(tokenizer, api_key=KEY)
    assert http.get("/playground/info").status_code == 401
    info = http.get("/playground/info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info == {"speculative": None, "draft_tokens": 0, "accepted_tokens": 0, "vision": False}


def test_info_reports_speculative_setting_and_counters(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, lambda *_: "")
    engine.engine = SimpleNamespace(config=SimpleNamespace(
        speculative_config={"method": "suffix", "num_speculative_tokens": 4}))
    stats = engine.stats()
    engine.stats = lambda: dataclasses.replace(stats, spec_decode={"draft_tokens": 12, "accepted_tokens": 9})
    assert client(tokenizer, engine).get("/playground/info").json() == {
        "speculative": {"method": "suffix", "num_speculative_tokens": 4}, "draft_tokens": 12, "accepted_tokens": 9,
        "vision": False}


def test_every_static_file_is_served() -> None:
    """A file added to static/ but not to the served list would be a 404 behind the page."""
    served = {"index.html", *(path.removeprefix("/static/") for path in PUBLIC_PATHS if path != "/")}
    assert {p.name for p in STATIC_DIR.iterdir()} == served
