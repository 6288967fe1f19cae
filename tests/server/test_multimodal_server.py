"""Images through the real `reasoning-engine serve` on the tiny Kimi K2.5 checkpoint (tests/multimodal/
kimi_checkpoint.py): the unmodified openai client against the offline `LLM.chat`, streaming against non-streaming,
usage, the media flags (allowed hosts on a local http.server, the local folder, the per-request limit, the size
limit), every bad-media case as a 400 naming the part, hostile media refused before anything large is decoded
(tests/multimodal/hostile_media.py), slow hosts that hold no thread, and the encoder-cache metrics. One server for
the module, started with the flags under test; greedy decoding, a few tokens per request. The bundled model (images,
no video) runs in-process for the checks that need a model without video and the token counts.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from multimodal.hostile_media import canvas_gif, huge_png
from multimodal.kimi_checkpoint import KimiK25Checkpoint, build_kimi_k25, noise_image
from reasoning_engine import LLM, SamplingParams
from reasoning_engine.server.app import ServerConfig, build_app

from .helpers import LiveServer, metric_value, run_coroutine, save_random_checkpoint, wait_for

pytestmark = pytest.mark.slow  # servers decoding media

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 6
MEDIA_MAX_BYTES = 64 * 1024
FETCH_TIMEOUT_S = 3.0
MAX_IMAGE_PIXELS = 4_000_000
SLOW_S = 12.0  # how long /slow.png keeps sending its header, a byte every 0.25 s
PREFIX = "reasoning_engine:"
MODEL = "kimi-k25-tiny"


def png(width: int, height: int, seed: int) -> bytes:
    out = io.BytesIO()
    noise_image(width, height, seed).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


IMAGE = png(40, 28, seed=1)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: str | dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}]


GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> KimiK25Checkpoint:
    return build_kimi_k25(tmp_path_factory.mktemp("kimi_k25_server"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder `--allowed-local-media-path` names, with one image in it."""
    folder = tmp_path_factory.mktemp("allowed_media")
    (folder / "image.png").write_bytes(IMAGE)
    return folder


class _QuietHandler(SimpleHTTPRequestHandler):
    """The folder's files, and /slow.png: a header sent a byte every 0.25 s for SLOW_S (`slow_requests` counts
    them), which no per-read timeout ever ends."""

    slow_requests = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path != "/slow.png":
            super().do_GET()
            return
        _QuietHandler.slow_requests += 1
        start = time.monotonic()
        try:
            for byte in b"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\nX-Padding: " + b"a" * 200:
                if time.monotonic() - start > SLOW_S:
                    break
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.25)
        except OSError:  # the fetch gave up and hung up
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def http_media(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local http.server on 127.0.0.1 serving image.png: the host `--allowed-media-domains` allows."""
    folder = tmp_path_factory.mktemp("http_media")
    (folder / "image.png").write_bytes(IMAGE)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


ENGINE_ARGS = {"device": "cpu", "kv_cache_blocks": 128, "block_size": 16, "max_model_len": 1024}


@pytest.fixture(scope="module")
def server(kimi: KimiK25Checkpoint, media_dir: Path) -> Iterator[str]:
    port = _free_port()
    log = tempfile.TemporaryFile("w+")
    engine_flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items()]
    # no parsers: the random model's text is all answer, compared as it is with the offline text
    proc = subprocess.Popen(
        [sys.executable, "-m", "reasoning_engine.cli", "serve", str(kimi.path), "--host", "127.0.0.1",
         "--port", str(port), "--served-model-name", MODEL, *engine_flags, "--reasoning-parser", "none",
         "--tool-call-parser", "none", "--allowed-media-domains", "127.0.0.1",
         "--allowed-local-media-path", str(media_dir), "--limit-mm-per-prompt", "image=1",
         "--media-max-bytes", str(MEDIA_MAX_BYTES), "--media-fetch-timeout", str(FETCH_TIMEOUT_S),
         "--max-image-pixels", str(MAX_IMAGE_PIXELS), "--log-level", "warning"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    try:
        if not wait_for(up, timeout=120, interval=0.2) or proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server did not start:\n{log.read()[-4000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(kimi: KimiK25Checkpoint) -> Iterator[LLM]:
    with LLM(str(kimi.path), **ENGINE_ARGS) as llm:
        yield llm


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    sampling = {**GREEDY, **kwargs}
    ignore_eos = sampling.pop("ignore_eos")
    return client.chat.completions.create(model=MODEL, messages=messages, extra_body={"ignore_eos": ignore_eos},
                                          **sampling)


def refused(server: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The error of a chat request that must be a 400, streamed or not (a streamed one fails before any event)."""
    errors = []
    for stream in (False, True):
        response = httpx.post(f"{server}/v1/chat/completions", json={"messages": messages, "stream": stream,
                                                                     "max_tokens": 2}, timeout=60)
        assert response.status_code == 400, response.text
        errors.append(response.json()["error"])
    assert errors[0] == errors[1]
    assert errors[0]["type"] == "invalid_request_error"
    return errors[0]


def test_image_data_url_matches_offline_chat(client: openai.OpenAI, offline: LLM) -> None:
    messages = user("describe what you see in the picture", image_part(data_url(IMAGE)))
    result = chat(client, messages)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert result.choices[0].message.content == want.outputs[0].text != ""
    assert result.usage.completion_tokens == MAX_TOKENS
    pad = offline.tokenizer.convert_tokens_to_ids("<|media_pad|>")
    placeholders = want.prompt_token_ids.count(pad)
    assert placeholders == want.num_image_tokens > 1
    assert result.usage.prompt_tokens == len(want.prompt_token_ids)
    details = result.usage.prompt_tokens_details
    assert details.image_tokens == placeholders
    assert getattr(details, "video_tokens", None) is None


def test_streamed_content_equals_non_streamed(client: openai.OpenAI) -> None:
    messages = user(image_part(data_url(IMAGE)), "what colour is it?")
    full = chat(client, messages)
    content, usage = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}, max_tokens=MAX_TOKENS,
                                                temperature=0):
        usage = chunk.usage or usage
        content += "".join(choice.delta.content or "" for choice in chunk.choices)
    assert content == full.choices[0].message.content
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.prompt_tokens_details.image_tokens == full.usage.prompt_tokens_details.image_tokens > 0


def test_allowed_http_host_and_refused_hosts(client: openai.OpenAI, server: str, http_media: str) -> None:
    from_http = chat(client, user("describe", image_part(f"{http_media}/image.png")))
    from_data = chat(client, user("describe", image_part(data_url(IMAGE))))
    assert from_http.choices[0].message.content == from_data.choices[0].message.content
    assert from_http.usage.prompt_tokens_details.image_tokens > 0
    for url in ("http://images.example.com/cat.png", http_media.replace("127.0.0.1", "localhost") + "/image.png"):
        error = refused(server, user("describe", image_part(url)))
        assert error["param"] == "messages[0].content[1]"
        assert "is not allowed" in error["message"]


def test_local_files_only_inside_the_allowed_folder(client: openai.OpenAI, server: str, media_dir: Path,
                                                    tmp_path: Path) -> None:
    inside = chat(client, user(image_part((media_dir / "image.png").as_uri()), "describe"))
    assert inside.usage.prompt_tokens_details.image_tokens > 0
    outside = tmp_path / "image.png"
    outside.write_bytes(IMAGE)
    error = refused(server, user(image_part(outside.as_uri()), "describe"))
    assert error["param"] == "messages[0].content[0]" and "outside the allowed media folder" in error["message"]
    escape = f"{media_dir.as_uri()}/../{outside.parent.name}/image.png"
    assert "outside the allowed media folder" in refused(server, user(image_part(escape)))["message"]


@pytest.mark.parametrize("url,message", [
    (data_url(IMAGE[: len(IMAGE) // 2]), "cannot decode image"),
    (data_url(b"plain text", "text/plain"), "unsupported media type"),
    (data_url(png(200, 200, seed=2)), "-byte limit"),
    ("ftp://127.0.0.1/image.png", "unsupported URL scheme"),
], ids=["truncated", "media-type", "too-large", "scheme"])
def test_bad_media_is_400_naming_the_part(server: str, url: str, message: str) -> None:
    assert len(png(200, 200, seed=2)) > MEDIA_MAX_BYTES
    messages = [{"role": "system", "content": "be brief"}, *user("look:", image_part(url))]
    error = refused(server, messages)
    assert error["param"] == "messages[1].content[1]"
    assert error["message"].startswith("messages[1].content[1]: ") and message in error["message"]


def test_more_images_than_the_limit(server: str) -> None:
    error = refused(server, user(image_part(data_url(IMAGE)), "and", image_part(data_url(IMAGE))))
    assert error["param"] == "messages[0].content[2]" and "at most 1 image" in error["message"]


def test_bad_request_leaves_a_concurrent_good_one_alone(client: openai.OpenAI, server: str) -> None:
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(chat, client, user("describe", image_part(data_url(IMAGE))), max_tokens=24)
        bad = pool.submit(refused, server, user("describe", image_part(data_url(IMAGE[:100]))))
        assert bad.result()["param"] == "messages[0].content[1]"
        result = good.result()
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 24


def test_encoder_cache_metrics(client: openai.OpenAI, server: str) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{server}/metrics", timeout=30).text
        return {name: metric_value(text, f"{PREFIX}{name}_total") for name in
                ("encoder_cache_hits", "encoder_cache_misses", "encoder_seconds")}

    before = scrape()
    assert None not in before.values(), before
    fresh = data_url(png(32, 32, seed=3))
    for text in ("red", "green"):  # the text before the image differs, so the prefix cache cannot hold it
        chat(client, user(text, image_part(fresh)), max_tokens=1)
    after = scrape()
    assert after["encoder_cache_misses"] >= before["encoder_cache_misses"] + 1
    assert after["encoder_cache_hits"] >= before["encoder_cache_hits"] + 1
    assert after["encoder_seconds"] > before["encoder_seconds"]


@pytest.fixture(scope="module")
def text_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A text-only model (a tiny random llama; the bundled model has a vision tower), in-process."""
    from reasoning_engine.engine.async_engine import AsyncLLM

    model = save_random_checkpoint(tmp_path_factory.mktemp("random_kimi_llama"))
    engine = AsyncLLM(model=str(model), device="cpu", kv_cache_blocks=32, block_size=16, max_model_len=512)
    try:
        with LiveServer(build_app(engine, ServerConfig(shutdown_engine=False))) as live:
            yield live.url
    finally:
        engine.shutdown_sync()


def test_text_model_refuses_images(text_server: str) -> None:
    error = refused(text_server, user("describe", image_part(data_url(IMAGE))))
    assert error["param"] == "messages[0].content[1]" and "has no vision tower" in error["message"]
    info = httpx.get(f"{text_server}/playground/info", timeout=10).json()
    assert info["vision"] is False
    text = httpx.post(f"{text_server}/v1/chat/completions", timeout=60, json={
        "messages": user("What is 2 + 2?"), "max_tokens": 2})
    assert text.status_code == 200 and "image_tokens" not in text.json()["usage"]["prompt_tokens_details"]


def video_part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def test_huge_image_refused_from_its_header(server: str) -> None:
    """A 21 KB PNG of 13000 x 13000 (169 M pixels) is refused from its header, well within the time a decode would
    take, naming the part."""
    start = time.monotonic()
    error = refused(server, user("describe", image_part(data_url(huge_png(13000, 13000)))))
    assert time.monotonic() - start < 10.0  # two requests (streamed and not); a decode takes seconds each
    assert error["param"] == "messages[0].content[1]" and error["code"] == "invalid_media"
    assert error["message"] == ("messages[0].content[1]: image is 13000x13000 (169000000 pixels), over the limit of "
                                f"{MAX_IMAGE_PIXELS} pixels")


def test_animated_gif_canvas_refused_before_decoding(server: str) -> None:
    """60 one-pixel frames on a 2000 x 2000 canvas (1.4 KB) as a video: its frames x canvas pixels are over the
    limit, refused from the frame headers."""
    error = refused(server, user("describe", video_part(data_url(canvas_gif(2000, 2000, 60, 100), "image/gif"))))
    assert error["param"] == "messages[0].content[1]" and error["code"] == "invalid_media"
    assert "60 frames of 2000x2000 is 240000000 pixels" in error["message"]


def test_slow_hosts_hold_no_thread(server: str, http_media: str) -> None:
    """More slow fetches than asyncio's default pool has threads, each held by a host that sends a header byte every
    0.25 s: an image request by data URL is still answered at once, and every slow fetch ends at the fetch timeout
    with a 400 naming its part."""
    slow_count = min(32, (os.cpu_count() or 1) + 4) + 2
    slow_body = {"messages": user("describe", image_part(f"{http_media}/slow.png")), "max_tokens": 2}
    quick_body = {"messages": user("describe", image_part(data_url(IMAGE))), "max_tokens": 2}

    async def run() -> tuple[float, list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            before = _QuietHandler.slow_requests
            slow = [asyncio.create_task(http.post("/v1/chat/completions", json=slow_body))
                    for _ in range(slow_count)]
            deadline = time.monotonic() + SLOW_S / 2
            while _QuietHandler.slow_requests - before < slow_count and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _QuietHandler.slow_requests - before == slow_count, "the slow fetches did not all start"
            start = time.monotonic()
            quick = await http.post("/v1/chat/completions", json=quick_body)
            elapsed = time.monotonic() - start
            return elapsed, await asyncio.gather(*slow), quick

    elapsed, slow, quick = run_coroutine(run())
    assert quick.status_code == 200, quick.text
    assert elapsed < SLOW_S / 2, f"a data-URL image waited {elapsed:.1f} s behind slow fetches"
    for response in slow:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages[0].content[1]" and error["code"] == "invalid_media"
        assert f"took longer than {FETCH_TIMEOUT_S:g} s" in error["message"]


BUNDLED_REQUEST_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def bundled_server(http_media: str) -> Iterator[str]:
    """The bundled model (a vision tower; its tokenizer has no video placeholder), in-process, with a short
    per-request media deadline and a long fetch timeout."""
    from reasoning_engine.engine.async_engine import AsyncLLM

    engine = AsyncLLM(device="cpu", kv_cache_blocks=64, block_size=16, max_model_len=1024)
    config = ServerConfig(shutdown_engine=False, allowed_media_domains=["127.0.0.1"], media_fetch_timeout=30.0,
                          media_request_timeout=BUNDLED_REQUEST_TIMEOUT_S)
    try:
        with LiveServer(build_app(engine, config)) as live:
            yield live.url
    finally:
        engine.shutdown_sync()


def test_video_refused_before_loading_by_a_model_without_video(bundled_server: str) -> None:
    """A model without a video placeholder refuses a video part before fetching or decoding it: bytes that are no
    video at all get the same answer as a real one."""
    for url in (data_url(b"\0" * 64, "video/mp4"), data_url(canvas_gif(8, 8, 3, 500), "image/gif")):
        error = refused(bundled_server, user("describe", video_part(url)))
        assert error["param"] == "messages[0].content[1]" and error["code"] == "media_not_supported"
        assert "no video" in error["message"]


def test_media_request_deadline(bundled_server: str, http_media: str) -> None:
    """The per-request media deadline ends a fetch that its own (longer) fetch timeout would still allow."""
    start = time.monotonic()
    error = refused(bundled_server, user("describe", image_part(f"{http_media}/slow.png")))
    assert time.monotonic() - start < 2 * BUNDLED_REQUEST_TIMEOUT_S + SLOW_S / 2
    assert error["param"] == "messages[0].content[1]" and error["code"] == "media_timeout"
    assert f"longer than {BUNDLED_REQUEST_TIMEOUT_S:g} s" in error["message"]


def test_token_counts_include_each_image_run(bundled_server: str) -> None:
    """/tokenize and Anthropic's count_tokens count an image as the run of tokens the engine gives it: equal to the
    chat's prompt_tokens and to the Messages API's input tokens."""
    text = "describe what you see in the picture"
    messages = user(text, image_part(data_url(IMAGE)))
    chat_usage = httpx.post(f"{bundled_server}/v1/chat/completions", timeout=60,
                            json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert chat_usage["prompt_tokens_details"]["image_tokens"] > 1
    tokenized = httpx.post(f"{bundled_server}/tokenize", json={"messages": messages}, timeout=60).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == chat_usage["prompt_tokens"]

    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGE).decode()}
    anthropic_messages = [{"role": "user", "content": [{"type": "text", "text": text},
                                                       {"type": "image", "source": source}]}]
    counted = httpx.post(f"{bundled_server}/v1/messages/count_tokens", timeout=60,
                         json={"model": "tiny-reasoner", "messages": anthropic_messages}).json()
    reply = httpx.post(f"{bundled_server}/v1/messages", timeout=60,
                       json={"model": "tiny-reasoner", "messages": anthropic_messages, "max_tokens": 1}).json()
    usage = reply["usage"]
    assert counted["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert counted["input_tokens"] > chat_usage["prompt_tokens_details"]["image_tokens"]
