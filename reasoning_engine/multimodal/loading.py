"""Fetching and decoding the media a request names, under the server's safety policy.

Sources: `data:` URLs (base64 or percent-encoded), `http(s)://` only for hosts on the allow list (exact host or a
subdomain; redirects are followed hop by hop and each hop is checked), and `file://` only under one local folder
(after resolving `..` and symlinks). Every source is capped at `max_bytes` and remote fetches at `timeout_s` in total.
Any failure is a `MediaError`, a ValueError whose message says what was wrong, so the server can answer 400.

Video: animated images (GIF, WebP, APNG) decode with Pillow; real video containers (mp4, webm, ...) need PyAV (the
`av` package) and fail with a MediaError naming it when it is missing. Frames are sampled while decoding, so a long
video never sits in memory whole.

The loader is stateless and thread-safe; `aload_image` / `aload_video` run the blocking work in a thread for async
handlers.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes

import httpx
import numpy as np
from PIL import Image, ImageSequence

from reasoning_engine.multimodal.processing import VideoInput, sample_indices

MAX_REDIRECTS = 5


class MediaError(ValueError):
    """A media URL that cannot be used: not allowed, unreachable, too large, or not decodable media."""


@dataclass(frozen=True)
class Fetched:
    """Raw bytes of a media source and the media type it declared (None when the source declares none)."""

    data: bytes
    media_type: str | None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def host_allowed(host: str, allowed_domains: list[str] | tuple[str, ...] | None) -> bool:
    """Exact host, or a subdomain of an allowed domain name (IP addresses match only exactly)."""
    host = host.lower().rstrip(".")
    for domain in allowed_domains or ():
        domain = domain.lower().rstrip(".")
        if host == domain or (not _is_ip(domain) and host.endswith("." + domain)):
            return True
    return False


def _main_type(media_type: str | None) -> str:
    return (media_type or "").split(";")[0].strip().lower()


def _check_media_type(media_type: str | None, kind: str) -> None:
    """Reject a declared type that cannot be the requested kind; undeclared or generic binary types are sniffed."""
    main = _main_type(media_type)
    if not main or main == "application/octet-stream":
        return
    if kind == "image" and not main.startswith("image/"):
        raise MediaError(f"unsupported media type {main!r} for an image")
    if kind == "video" and not main.startswith(("video/", "image/")):
        raise MediaError(f"unsupported media type {main!r} for a video")


def decode_image(data: bytes) -> Image.Image:
    """Fully decode (not just sniff the header), so truncated or corrupt files fail here, not in the processor."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"cannot decode image: {exc}") from exc
    return image


def _check_frame_count(count: int, max_frames: int) -> None:
    if count > max_frames:
        raise MediaError(f"video too long: {count} frames after sampling, the limit is {max_frames}")


def _decode_animated_image(data: bytes, fps: float, max_frames: int) -> VideoInput:
    """An animated (or still) image as a video; its frame rate is the frame count over the summed frame durations."""
    image = decode_image(data)
    total = getattr(image, "n_frames", 1)
    durations_ms = []
    try:
        for frame in ImageSequence.Iterator(image):
            durations_ms.append(frame.info.get("duration") or 0)
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"cannot decode animated image: {exc}") from exc
    seconds = sum(durations_ms) / 1000
    source_fps = total / seconds if seconds > 0 else fps
    keep = sample_indices(total, source_fps, fps)
    _check_frame_count(len(keep), max_frames)
    frames = []
    try:
        for index in keep:
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB")))
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise MediaError(f"cannot decode animated image: {exc}") from exc
    return VideoInput(np.stack(frames), source_fps, tuple(keep))


def _decode_container(data: bytes, fps: float, max_frames: int) -> VideoInput:
    """Decode a video container with PyAV, converting only the sampled frames to RGB."""
    try:
        import av
    except ImportError as exc:
        raise MediaError("decoding this video needs PyAV (the `av` package), which is not installed") from exc
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("the file has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            if not rate or rate <= 0:
                raise MediaError("cannot tell the video's frame rate")
            source_fps = float(rate)
            total = stream.frames
            if not total and container.duration:
                total = round(container.duration / 1_000_000 * source_fps)
            if not total:
                raise MediaError("cannot tell the video's length")
            keep = sample_indices(total, source_fps, fps)
            _check_frame_count(len(keep), max_frames)
            wanted = set(keep)
            frames, indices = [], []
            for index, frame in enumerate(container.decode(stream)):
                if index in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    indices.append(index)
                if index >= keep[-1]:
                    break
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaError(f"cannot decode video: {exc}") from exc
    if not frames:
        raise MediaError("the video has no decodable frames")
    return VideoInput(np.stack(frames), source_fps, tuple(indices))


def _is_image_data(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)):
            return True
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return False


@dataclass(frozen=True)
class MediaLoader:
    """Loads images and videos from URLs under an allow list.

    `allowed_domains` None or empty disables http(s) fetching; `allowed_local_path` None disables `file://`.
    `video_fps` is the rate frames are sampled at while decoding (Kimi K2.5's video processor samples at 2) and
    `max_video_frames` caps the sampled frames, which bounds decoded memory.
    """

    allowed_domains: list[str] | None
    allowed_local_path: Path | None
    max_bytes: int
    timeout_s: float
    video_fps: float = 2.0
    max_video_frames: int = 1024

    def load_image(self, url: str) -> Image.Image:
        fetched = self.fetch(url)
        _check_media_type(fetched.media_type, "image")
        return decode_image(fetched.data)

    def load_video(self, url: str) -> VideoInput:
        fetched = self.fetch(url)
        _check_media_type(fetched.media_type, "video")
        declared = _main_type(fetched.media_type)
        if declared.startswith("image/") or (not declared.startswith("video/") and _is_image_data(fetched.data)):
            return _decode_animated_image(fetched.data, self.video_fps, self.max_video_frames)
        return _decode_container(fetched.data, self.video_fps, self.max_video_frames)

    async def aload_image(self, url: str) -> Image.Image:
        return await asyncio.to_thread(self.load_image, url)

    async def aload_video(self, url: str) -> VideoInput:
        return await asyncio.to_thread(self.load_video, url)

    def fetch(self, url: str) -> Fetched:
        """The bytes behind a URL, after the policy checks for its scheme."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._fetch_data(url)
        if scheme in ("http", "https"):
            return self._fetch_http(url)
        if scheme == "file":
            return self._fetch_file(url)
        raise MediaError(f"unsupported URL scheme {scheme!r}: use data:, http(s): or file:")

    def _too_large(self, size: int) -> MediaError:
        return MediaError(f"media is {size} bytes, over the {self.max_bytes}-byte limit")

    def _fetch_data(self, url: str) -> Fetched:
        header, sep, payload = url[len("data:"):].partition(",")
        if not sep:
            raise MediaError("malformed data URL: no ',' before the payload")
        params = header.split(";")
        media_type = params[0].strip() or "text/plain"
        is_base64 = any(p.strip().lower() == "base64" for p in params[1:])
        if is_base64:
            # 4 characters per 3 bytes: refuse an oversized payload before decoding it.
            if len(payload) * 3 // 4 > self.max_bytes:
                raise self._too_large(len(payload) * 3 // 4)
            try:
                data = base64.b64decode("".join(unquote(payload).split()), validate=True)
            except (binascii.Error, ValueError) as exc:
                raise MediaError(f"malformed base64 in data URL: {exc}") from exc
        else:
            data = unquote_to_bytes(payload)
        if len(data) > self.max_bytes:
            raise self._too_large(len(data))
        return Fetched(data, media_type)

    def _fetch_http(self, url: str) -> Fetched:
        deadline = time.monotonic() + self.timeout_s
        try:
            with httpx.Client(timeout=self.timeout_s, follow_redirects=False) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    try:
                        target = httpx.URL(url)
                    except httpx.InvalidURL as exc:
                        raise MediaError(f"invalid URL {url!r}: {exc}") from exc
                    if target.scheme not in ("http", "https"):
                        raise MediaError(f"redirect to a {target.scheme!r} URL is not allowed")
                    if not host_allowed(target.host, self.allowed_domains):
                        raise MediaError(f"fetching media from host {target.host!r} is not allowed")
                    with client.stream("GET", target) as response:
                        if response.is_redirect and "location" in response.headers:
                            url = str(target.join(response.headers["location"]))
                            continue
                        if response.status_code != 200:
                            raise MediaError(f"fetching {target} failed: HTTP {response.status_code}")
                        return Fetched(self._read_body(response, deadline), response.headers.get("content-type"))
                raise MediaError(f"fetching {url} failed: more than {MAX_REDIRECTS} redirects")
        except httpx.HTTPError as exc:
            raise MediaError(f"fetching {url} failed: {type(exc).__name__}: {exc}") from exc

    def _read_body(self, response: httpx.Response, deadline: float) -> bytes:
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large(int(declared))
        body = bytearray()
        for chunk in response.iter_bytes():
            body.extend(chunk)
            if len(body) > self.max_bytes:
                raise MediaError(f"media is over the {self.max_bytes}-byte limit")
            if time.monotonic() > deadline:
                raise MediaError(f"fetching {response.url} took longer than {self.timeout_s} s")
        return bytes(body)

    def _fetch_file(self, url: str) -> Fetched:
        if self.allowed_local_path is None:
            raise MediaError("file:// URLs are not allowed")
        rest = url[len("file:"):]
        if rest.startswith("//"):
            host, _, rest = rest[2:].partition("/")
            if host not in ("", "localhost"):
                raise MediaError(f"file:// URL with host {host!r} is not allowed")
            rest = "/" + rest
        raw = unquote(rest.split("?", 1)[0].split("#", 1)[0])
        if not raw.startswith("/"):
            raise MediaError("file:// URL must hold an absolute path")
        try:
            path = Path(raw).resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise MediaError(f"cannot open {raw}: {exc}") from exc
        if not path.is_relative_to(Path(self.allowed_local_path).resolve()):
            raise MediaError(f"{raw} is outside the allowed media folder")
        try:
            # O_NOFOLLOW: the resolved path has no symlink left, so refuse one swapped in since; O_NONBLOCK: a FIFO
            # must not hang the open (it is then refused as not a regular file).
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise MediaError(f"cannot open {raw}: {exc}") from exc
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise MediaError(f"{raw} is not a regular file")
        if info.st_size > self.max_bytes:
            os.close(fd)
            raise self._too_large(info.st_size)
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(self.max_bytes + 1)
        if len(data) > self.max_bytes:
            raise self._too_large(len(data))
        return Fetched(data, None)
