"""The browser playground: a static page at `/` that chats with the API of the same server.

`mount_playground(app)` adds the page, its assets and `GET /playground/info`. The page itself holds no secret and is
useful only with the API, so its paths (PUBLIC_PATHS) belong among the server's public paths; `/playground/info`
stays behind the API key like the API.

What the routes read from `app.state` (set by `build_app`):
- `app.state.serving.engine`: the AsyncLLM; `.engine.config.speculative_config` is the speculative setting (absent
  or empty: speculation off) and `.stats().spec_decode` its counters, of which `draft_tokens` and `accepted_tokens`
  are used.
- `app.state.serving.vision`: whether the model takes images (the page offers to attach one only then).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.responses import FileResponse, JSONResponse, Response

from reasoning_engine.server.engine_client import EngineClient
from reasoning_engine.server.errors import APIError

STATIC_DIR = Path(__file__).resolve().parent / "static"
_ASSETS = {"app.js": "text/javascript", "markdown.js": "text/javascript", "style.css": "text/css"}
PUBLIC_PATHS: tuple[str, ...] = ("/", *(f"/static/{name}" for name in _ASSETS))

# The page loads nothing but its own files and talks only to this origin.
_SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate (ETag) so an upgraded server never runs a stale script
}


def _speculative_setting(engine: EngineClient) -> dict[str, Any] | None:
    """The engine's speculative setting, where it has one (an LLMEngine behind it, as AsyncLLM has)."""
    config = getattr(getattr(getattr(engine, "engine", None), "config", None), "speculative_config", None)
    if not config:
        return None
    return {"method": config.get("method"), "num_speculative_tokens": config.get("num_speculative_tokens")}


def mount_playground(app: FastAPI) -> None:
    """Serve the playground at `/` and its assets under `/static/`; call once, after `build_app` made the app."""

    @app.get("/", include_in_schema=False)
    async def playground_page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_SECURITY_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def playground_asset(name: str) -> Response:
        if name not in _ASSETS:  # only the known files: no path ever reaches the file system unchecked
            raise APIError(404, f"no playground asset {name!r}", code="not_found")
        return FileResponse(STATIC_DIR / name, media_type=_ASSETS[name], headers=_SECURITY_HEADERS)

    @app.get("/playground/info", include_in_schema=False)
    async def playground_info() -> Response:
        """Server facts the page cannot learn from the OpenAI API: the speculative setting (there is no
        per-request switch, so the page shows it read-only), the server-wide draft and accepted token counts,
        which the page reads before and after a reply to show that reply's acceptance, and whether the model has a
        vision tower (the page hides its image control otherwise)."""
        serving = app.state.serving
        counters = serving.engine.stats().spec_decode
        return JSONResponse({"speculative": _speculative_setting(serving.engine),
                             "draft_tokens": int(counters.get("draft_tokens", 0)),
                             "accepted_tokens": int(counters.get("accepted_tokens", 0)),
                             "vision": serving.vision})
