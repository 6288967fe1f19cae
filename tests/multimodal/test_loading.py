"""`MediaLoader`: data URLs, allow-listed http(s) (served by a local test server, hostile routes included), file://
under one folder, and video decoding (animated GIF through Pillow, mp4 through PyAV, a dependency); the limits that
hold before anything large is decoded (tests/multimodal/hostile_media.py builds the files)."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from reasoning_engine.multimodal.loading import (
    DEFAULT_IMAGE_PIXELS,
    DEFAULT_VIDEO_PIXELS,
    MediaError,
    MediaLoader,
    host_allowed,
    sample_indices,
)
from reasoning_engine.multimodal.processing import PixelSettings, navit_size

from .hostile_media import EPS, canvas_gif, huge_png, nested_gzip

LIMIT = 64 * 1024


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


PNG = encode(noise(16, 12), "PNG")
JPEG = encode(noise(20, 10), "JPEG")


def loader(tmp_path: Path | None = None, domains: list[str] | None = None, **options: float) -> MediaLoader:
    return MediaLoader(allowed_domains=domains, allowed_local_path=tmp_path, max_bytes=LIMIT,
                       **{"timeout_s": 5.0, **options})


BOMB_SIZE = 64 << 20
DRIBBLE_S = 8.0  # how long /dribble keeps sending its header, a byte at a time


class Handler(BaseHTTPRequestHandler):
    """/img.png, /big (over the limit), /unsized (over the limit, no Content-Length), /slow (answers after 2 s),
    /page (HTML), /to-img (redirect, same host), /to-other (redirect to a host not on the list), /bomb (64 MiB of
    zeros as `Content-Encoding: gzip, gzip`, about 1 KB), /dribble (one header byte every 0.1 s for 8 s), anything
    else 404. Every request's path and headers are kept in `seen`."""

    seen: list[tuple[str, dict[str, str]]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        Handler.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        if self.path == "/bomb":
            body = nested_gzip(BOMB_SIZE)
            self.send_response(200)
            for name, value in (("Content-Type", "image/png"), ("Content-Encoding", "gzip, gzip"),
                                ("Content-Length", str(len(body)))):
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path == "/dribble":
            head = b"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\nX-Padding: " + b"a" * 200
            start = time.monotonic()
            try:
                for byte in head:
                    if time.monotonic() - start > DRIBBLE_S:
                        break
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:  # the client hung up
                pass
            return
        if self.path == "/unsized":  # HTTP/1.0: the body runs until the connection closes
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"\0" * (LIMIT + 1))
            return
        if self.path == "/slow":
            time.sleep(2)
        routes = {
            "/img.png": (200, "image/png", PNG),
            "/big": (200, "image/png", b"\0" * (LIMIT + 1)),
            "/page": (200, "text/html", b"<html></html>"),
        }
        redirects = {"/to-img": "/img.png", "/to-other": f"http://localhost:{port}/img.png"}
        if self.path in redirects:
            self.send_response(302)
            self.send_header("Location", redirects[self.path])
            self.end_headers()
            return
        status, media_type, body = routes.get(self.path, (404, "text/plain", b"missing"))
        self.send_response(status)
        self.send_header("Content-Type", media_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the loader hangs up mid-body on purpose (size limit)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_data_url_png_and_jpeg() -> None:
    png = loader().load_image(data_url(PNG, "image/png"))
    assert png.size == (16, 12) and np.array_equal(np.asarray(png), np.asarray(noise(16, 12)))
    jpeg = loader().load_image(data_url(JPEG, "image/jpeg"))
    assert jpeg.size == (20, 10) and jpeg.format == "JPEG"


def test_bad_data_urls() -> None:
    with pytest.raises(MediaError, match="cannot decode image"):
        loader().load_image(data_url(PNG[: len(PNG) // 2], "image/png"))
    with pytest.raises(MediaError, match="unsupported media type 'text/plain'"):
        loader().load_image(data_url(b"hello", "text/plain"))
    with pytest.raises(MediaError, match="unsupported media type 'text/plain'"):
        loader().load_image("data:,hello")
    with pytest.raises(MediaError, match="base64"):
        loader().load_image("data:image/png;base64,not*base64")
    with pytest.raises(MediaError, match="limit"):
        loader().load_image(data_url(b"\0" * (LIMIT + 3), "image/png"))
    with pytest.raises(MediaError, match="scheme"):
        loader().load_image("ftp://example.com/a.png")


def test_host_allow_list() -> None:
    assert host_allowed("example.com", ["example.com"])
    assert host_allowed("cdn.Example.COM", ["example.com"])
    assert not host_allowed("badexample.com", ["example.com"])
    assert not host_allowed("example.com.evil.net", ["example.com"])
    assert host_allowed("127.0.0.1", ["127.0.0.1"]) and not host_allowed("x.127.0.0.1", ["127.0.0.1"])
    assert not host_allowed("example.com", None) and not host_allowed("example.com", [])


def test_disallowed_host_never_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("opened a connection")

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", no_network)
    for url in ("http://example.com/a.png", "https://127.0.0.1.example.com/a.png",
                "http://127.0.0.1@example.com/a.png"):
        with pytest.raises(MediaError, match="not allowed"):
            loader(domains=["127.0.0.1"]).load_image(url)
    with pytest.raises(MediaError, match="not allowed"):
        loader(domains=None).load_image("http://127.0.0.1/a.png")
    with pytest.raises(MediaError, match="invalid URL"):
        loader(domains=["127.0.0.1"]).load_image("http://[::1/a.png")


def test_http_fetch(server: str) -> None:
    allowed = loader(domains=["127.0.0.1"])
    assert np.array_equal(np.asarray(allowed.load_image(f"{server}/img.png")), np.asarray(noise(16, 12)))
    assert allowed.load_image(f"{server}/to-img").size == (16, 12)
    assert allowed.decode(asyncio.run(allowed.afetch(f"{server}/img.png")), "image").size == (16, 12)
    for path in ("/big", "/unsized"):
        with pytest.raises(MediaError, match="limit"):
            allowed.load_image(f"{server}{path}")
    with pytest.raises(MediaError, match="longer than 0.3 s"):
        loader(domains=["127.0.0.1"], timeout_s=0.3).load_image(f"{server}/slow")
    with pytest.raises(MediaError, match="'localhost' is not allowed"):
        allowed.load_image(f"{server}/to-other")
    with pytest.raises(MediaError, match="HTTP 404"):
        allowed.load_image(f"{server}/nothing")
    with pytest.raises(MediaError, match="text/html"):
        allowed.load_image(f"{server}/page")


def test_fetch_failure_is_media_error() -> None:
    closed = httpx.URL("http://127.0.0.1:9/img.png")  # discard port: nothing listens on it
    with pytest.raises(MediaError, match="failed"):
        loader(domains=["127.0.0.1"]).load_image(str(closed))


def test_file_urls(tmp_path: Path) -> None:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "inside.png").symlink_to(root / "sub" / "a.png")
    local = loader(root)

    assert local.load_image(f"file://{root}/sub/a.png").size == (16, 12)
    assert local.load_image(f"file://localhost{root}/inside.png").size == (16, 12)
    for url in (f"file://{tmp_path}/secret.png", f"file://{root}/../secret.png", f"file://{root}/sub/../../secret.png",
                f"file://{root}/escape.png", f"file://{tmp_path}/missing.png", f"file://{root}/../missing.png",
                f"file://{root}/missing/../../secret.png"):
        # one answer outside the folder, whether the file exists or not
        with pytest.raises(MediaError) as refused:
            local.load_image(url)
        assert str(refused.value) == f"{url[len('file://'):]} is outside the allowed media folder"
    with pytest.raises(MediaError, match="cannot open"):
        local.load_image(f"file://{root}/missing.png")
    with pytest.raises(MediaError, match="not a regular file"):
        local.load_image(f"file://{root}/sub")
    with pytest.raises(MediaError, match="host"):
        local.load_image(f"file://example.com{root}/sub/a.png")
    with pytest.raises(MediaError, match="not allowed"):
        loader(None).load_image(f"file://{root}/sub/a.png")
    (root / "big.png").write_bytes(b"\0" * (LIMIT + 1))
    with pytest.raises(MediaError, match="limit"):
        local.load_image(f"file://{root}/big.png")


def test_animated_gif_as_video() -> None:
    frames = [Image.new("RGB", (12, 8), (i * 20, 0, 0)) for i in range(10)]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    video = loader().load_video(data_url(gif, "image/gif"))
    assert video.fps == pytest.approx(10.0)
    assert video.frame_indices == (0, 5)  # 1 s at 10 fps sampled at 2 fps
    assert video.frames.shape == (2, 8, 12, 3) and video.frames.dtype == np.uint8
    assert [int(frame[0, 0, 0]) for frame in video.frames] == [0, 100]
    with pytest.raises(MediaError, match="unsupported media type 'text/plain'"):
        loader().load_video(data_url(gif, "text/plain"))


def test_sampling_matches_transformers(torchvision_reference: object) -> None:
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    for total, fps in ((23, 5.0), (100, 30.0), (3, 2.0), (7, 24.0), (1, 30.0)):
        expected = default_sample_indices_fn(VideoMetadata(total_num_frames=total, fps=fps), fps=2)
        assert sample_indices(total, fps, 2.0) == expected.tolist()
    assert sample_indices(3, 1.0, 2.0) == [0, 1, 2]  # slower than the sampling rate: every frame (transformers raises)


def encode_mp4(count: int, fps: int) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for i in range(count):
            frame = av.VideoFrame.from_ndarray(np.full((24, 32, 3), i * 8, dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def test_mp4_video(tmp_path: Path) -> None:
    mp4 = encode_mp4(25, fps=10)
    video = loader().load_video(data_url(mp4, "video/mp4"))
    assert video.fps == 10.0 and video.frame_indices == tuple(sample_indices(25, 10.0, 2.0))
    assert video.frames.shape == (5, 24, 32, 3)
    assert [round(float(frame.mean()) / 8) for frame in video.frames] == [0, 5, 10, 15, 20]
    (tmp_path / "clip.mp4").write_bytes(mp4)
    assert loader(tmp_path).load_video(f"file://{tmp_path}/clip.mp4").frames.shape == (5, 24, 32, 3)
    with pytest.raises(MediaError, match="too long"):
        loader(max_video_frames=4).load_video(data_url(mp4, "video/mp4"))
    with pytest.raises(MediaError, match="cannot decode video"):
        loader().load_video(data_url(b"\0\0\0\x18ftypmp42" + b"\0" * 64, "video/mp4"))


def test_video_without_pyav(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "av", None)
    with pytest.raises(MediaError, match="PyAV"):
        loader().load_video(data_url(b"\0\0\0\x18ftypmp42" + b"\0" * 64, "video/mp4"))


def test_encoded_body_refused_before_decompressing(server: str) -> None:
    """`Content-Encoding: gzip, gzip` of 64 MiB in about 1 KB: refused before a byte is inflated, so nothing near
    the bomb's size is ever allocated (decoding a whole chunk before checking the cap would allocate all of it)."""
    Handler.seen.clear()
    tracemalloc.start()
    try:
        with pytest.raises(MediaError, match="'gzip, gzip'-encoded"):
            loader(domains=["127.0.0.1"]).load_image(f"{server}/bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20 < BOMB_SIZE, peak
    assert Handler.seen == [("/bomb", Handler.seen[0][1])] and Handler.seen[0][1]["accept-encoding"] == "identity"


def test_fetch_timeout_bounds_the_whole_fetch(server: str) -> None:
    """A host sending one header byte every 0.1 s never trips a per-read timeout; the fetch still ends at its
    deadline."""
    start = time.monotonic()
    with pytest.raises(MediaError, match="longer than 1 s"):
        loader(domains=["127.0.0.1"], timeout_s=1.0).load_image(f"{server}/dribble")
    assert time.monotonic() - start < DRIBBLE_S / 2


@pytest.mark.parametrize("pixel_data", [True, False], ids=["valid", "header-only"])
def test_image_dimensions_checked_before_decoding(pixel_data: bool) -> None:
    """A 21 KB PNG of 13000 x 13000 (169 M pixels) is refused from its header. The header-only variant has no pixel
    data at all, so any decode attempt would fail with another message: this one proves nothing but the header was
    read."""
    bomb = huge_png(13000, 13000, pixel_data)
    assert len(bomb) < 32 << 10 and 13000 * 13000 > DEFAULT_IMAGE_PIXELS
    start = time.monotonic()
    with pytest.raises(MediaError, match=f"13000x13000 .* over the limit of {DEFAULT_IMAGE_PIXELS} pixels"):
        loader().load_image(data_url(bomb, "image/png"))
    assert time.monotonic() - start < 2.0
    with pytest.raises(MediaError, match="16x12 .* over the limit of 191 pixels"):
        loader(max_image_pixels=191).load_image(data_url(PNG[:60], "image/png"))  # the header, cut short after it
    assert loader(max_image_pixels=16 * 12).load_image(data_url(PNG, "image/png")).size == (16, 12)


def test_jpeg_decodes_at_the_scale_the_model_needs() -> None:
    """With the model's settings a large JPEG decodes at a libjpeg scale that still covers the model's size; the
    pixel limit holds for the size as stored."""
    big = encode(Image.linear_gradient("L").resize((2048, 1536)).convert("RGB"), "JPEG", quality=40)
    fit = PixelSettings(patch_size=14, max_patches=64, max_patches_per_side=16)
    (need_h, need_w), _ = navit_size(1536, 2048, fit)
    scale = max(s for s in (1, 2, 4, 8) if 2048 // need_w >= s and 1536 // need_h >= s)
    assert scale == 8
    small = loader(fit=fit).load_image(data_url(big, "image/jpeg"))
    assert small.size == (2048 // 8, 1536 // 8) and small.width >= need_w and small.height >= need_h
    assert loader().load_image(data_url(big, "image/jpeg")).size == (2048, 1536)
    with pytest.raises(MediaError, match="2048x1536"):
        loader(max_image_pixels=2048 * 1536 - 1, fit=fit).load_image(data_url(big, "image/jpeg"))


def test_only_the_image_formats_models_take() -> None:
    """PNG, JPEG, WebP, GIF, BMP and TIFF open; nothing else reaches a Pillow plugin (EPS would run Ghostscript on
    the file), and no answer carries a memory address."""
    image = noise(9, 7)
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):
        assert loader().load_image(data_url(encode(image, fmt), "application/octet-stream")).size == (9, 7), fmt
    for data in (EPS, encode(image, "ICO"), encode(image, "PCX"), b"not an image at all"):
        with pytest.raises(MediaError) as refused:
            loader().load_image(data_url(data, "application/octet-stream"))
        assert str(refused.value) == "not an image in an accepted format (PNG, JPEG, WebP, GIF, BMP or TIFF)"
    with pytest.raises(MediaError) as broken:
        loader().load_image(data_url(PNG[:200], "image/png"))
    assert "cannot decode image" in str(broken.value) and "0x" not in str(broken.value)


def test_animated_image_pixels_checked_before_decoding() -> None:
    """An 1.4 KB GIF of 60 one-pixel frames on a 2000 x 2000 canvas decodes the whole canvas per frame (240 M
    pixels): refused from the frame headers, at once. A frame that widens the canvas mid-file is refused when it is
    reached, before it is drawn."""
    bomb = canvas_gif(2000, 2000, frames=60, duration_ms=100)
    assert 60 * 2000 * 2000 > DEFAULT_VIDEO_PIXELS
    start = time.monotonic()
    with pytest.raises(MediaError, match="60 frames of 2000x2000 is 240000000 pixels"):
        loader().load_video(data_url(bomb, "image/gif"))
    assert time.monotonic() - start < 2.0
    widening = canvas_gif(16, 16, frames=3, duration_ms=100, last_frame_at=(3000, 3000))
    with pytest.raises(MediaError, match="3 frames of 3001x3001"):
        loader(max_video_pixels=1_000_000).load_video(data_url(widening, "image/gif"))
    assert loader(max_video_pixels=3 * 16 * 16).load_video(data_url(canvas_gif(16, 16, 3, 500), "image/gif")) \
        .frames.shape == (3, 16, 16, 3)


def test_video_file_pixels_and_format_checked_before_decoding(server: str) -> None:
    """A video file's sampled frames x frame size (from its header) are bounded before decoding; only MP4/MOV,
    Matroska and AVI demuxers run, chosen from the magic bytes, so a playlist never makes FFmpeg open its URLs."""
    mp4 = encode_mp4(25, fps=10)  # 5 frames of 32 x 24 kept
    with pytest.raises(MediaError, match="5 sampled frames of 32x24 is 3840 pixels"):
        loader(max_video_pixels=3839).load_video(data_url(mp4, "video/mp4"))
    assert loader(max_video_pixels=3840).load_video(data_url(mp4, "video/mp4")).frames.shape == (5, 24, 32, 3)
    Handler.seen.clear()
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\n{server}/segment.ts\n#EXT-X-ENDLIST\n".encode()
    with pytest.raises(MediaError, match="not a video in an accepted format"):
        loader().load_video(data_url(playlist, "video/mp4"))
    assert Handler.seen == []


def test_decoding_stops_at_the_deadline() -> None:
    gif = canvas_gif(16, 16, frames=3, duration_ms=100)
    with pytest.raises(MediaError, match="deadline"):
        loader().decode(data_url(gif, "image/gif"), "video", deadline=time.monotonic() - 1)
    with pytest.raises(MediaError, match="deadline"):
        loader().decode(data_url(encode_mp4(5, fps=10), "video/mp4"), "video", deadline=time.monotonic() - 1)
