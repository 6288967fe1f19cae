"""Fetching and decoding the media a request names, under the server's safety policy.

Sources: `data:` URLs (base64 or percent-encoded), `http(s)://` only for hosts on the allow list (exact host or a
subdomain; redirects are followed hop by hop and each hop is checked), and `file://` only under one local folder
(after resolving `..` and symlinks; a path outside it is refused before anything is opened, so the answer never
tells whether it exists). Every source is capped at `max_bytes`. A remote fetch is asynchronous (no thread waits on
a slow host) and `timeout_s` bounds all of it, redirects, headers and body; bodies must come unencoded (the request
asks for `identity`; a gzip-encoded answer is refused, as decompressing would exceed the byte cap before it could be
checked). Any failure is a `MediaError`, a ValueError whose message says what was wrong, so the server can answer 400.

Decoding reads the header first: only PNG, JPEG, WebP, GIF, BMP and TIFF are opened (no other Pillow plugin runs),
and the pixel limits are checked before a pixel is decoded. A JPEG larger than the model takes is decoded at the
smallest of libjpeg's 1/2, 1/4, 1/8 scales that still covers the size the processor resizes it to (a faster decode
into less memory; the pixel limit holds for the size as stored).

Video: animated images (GIF, WebP, APNG) decode with Pillow; MP4/MOV, WebM/Matroska and AVI files with PyAV (the
`av` package), the demuxer chosen from the file's magic bytes (no format probing, so no playlist or other demuxer
that opens further files runs); a missing PyAV is a MediaError naming it. `max_video_pixels` bounds, before decoding,
the frames x pixels a video decodes: every frame of an animated image (each is drawn on the last), the sampled frames
of a video file. Frames are sampled while decoding, so a long video never sits in memory whole, and the decode loops
stop at the caller's deadline.

The loader is stateless and thread-safe: `afetch` fetches remote sources on the caller's event loop, `decode` (and
`load_image` / `load_video`, which fetch too) does the blocking work in the caller's thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import ipaddress
import os
import re
import stat
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, unquote_to_bytes

import httpx
import numpy as np
from PIL import Image, UnidentifiedImageError

from reasoning_engine.multimodal.processing import MediaProcessor, PixelSettings, VideoInput, navit_size, sample_indices

MAX_REDIRECTS = 5
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # Pillow plugin ids; MPO comes through JPEG's opener
ACCEPTED_IMAGES = "PNG, JPEG, WebP, GIF, BMP or TIFF"
ACCEPTED_VIDEOS = "MP4/MOV, WebM/Matroska, AVI, or an animated GIF, WebP or PNG"
MIN_IMAGE_PIXEL_LIMIT = 1 << 24  # a 16-megapixel photo is always accepted, however small the model's input
_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9A-Fa-f]+>")

T = TypeVar("T")


class MediaError(ValueError):
    """A media URL that cannot be used: not allowed, unreachable, too large, or not decodable media."""


@dataclass(frozen=True)
class Fetched:
    """Raw bytes of a media source and the media type it declared (None when the source declares none)."""

    data: bytes
    media_type: str | None


def default_pixel_limits(image: PixelSettings) -> tuple[int, int]:
    """(image, video) pixel limits for a model whose largest image input is `max_patches` patches: an image may be
    four times that along each side (it is downscaled to fit), and at least 16 megapixels; a video's decoded frames
    may hold four such images."""
    largest = image.max_patches * image.patch_size ** 2
    image_limit = max(16 * largest, MIN_IMAGE_PIXEL_LIMIT)
    return image_limit, 4 * image_limit


DEFAULT_IMAGE_PIXELS, DEFAULT_VIDEO_PIXELS = default_pixel_limits(PixelSettings())  # Kimi K2.5's


def _reason(exc: BaseException) -> str:
    """An exception's message without object reprs (`<_io.BytesIO object at 0x7f..>`): no memory addresses in
    answers."""
    return _OBJECT_REPR.sub("the data", str(exc)) or type(exc).__name__


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


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise MediaError("decoding took longer than the request's media deadline")


def open_image(data: bytes, max_pixels: int = DEFAULT_IMAGE_PIXELS, fit: PixelSettings | None = None) -> Image.Image:
    """The image with only its header read, checked: an accepted format, at most `max_pixels` pixels (as stored: a
    progressive JPEG's decoder holds every coefficient at full size whatever the scale). With `fit` (the model's
    image settings) a JPEG larger than the model takes is then set to decode at a reduced scale."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError as exc:
        raise MediaError(f"not an image in an accepted format ({ACCEPTED_IMAGES})") from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"cannot decode image: {_reason(exc)}") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(f"image is {width}x{height} ({width * height} pixels), over the limit of {max_pixels} pixels")
    if fit is not None and image.format in ("JPEG", "MPO"):
        (height, width), _ = navit_size(height, width, fit)
        image.draft(None, (width, height))  # the largest scale-down that keeps both sides at least this size
    return image


def decode_image(data: bytes, max_pixels: int = DEFAULT_IMAGE_PIXELS, fit: PixelSettings | None = None) -> Image.Image:
    """Fully decode (not just sniff the header), so truncated or corrupt files fail here, not in the processor."""
    image = open_image(data, max_pixels, fit)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"cannot decode image: {_reason(exc)}") from exc
    return image


def _check_frame_count(count: int, max_frames: int) -> None:
    if count > max_frames:
        raise MediaError(f"video too long: {count} frames after sampling, the limit is {max_frames}")


def _check_video_pixels(frames: int, width: int, height: int, max_pixels: int, what: str) -> None:
    if frames * width * height > max_pixels:
        raise MediaError(f"video too large: {frames} {what} of {width}x{height} is {frames * width * height} pixels "
                         f"to decode, over the limit of {max_pixels}")


def _decode_animated_image(data: bytes, fps: float, max_frames: int, max_pixels: int,
                           deadline: float | None) -> VideoInput:
    """An animated (or still) image as a video; its frame rate is the frame count over the summed frame durations.
    Every frame is decoded (each is drawn over the last), so the frame count times the canvas is checked first."""
    image = open_image(data, max_pixels)
    try:
        total = getattr(image, "n_frames", 1)  # frame headers only
        _check_video_pixels(total, *image.size, max_pixels, "frames")
        durations_ms = []
        for index in range(total):
            image.seek(index)
            _check_video_pixels(total, *image.size, max_pixels, "frames")  # a GIF frame may widen the canvas
            _check_deadline(deadline)
            durations_ms.append(image.info.get("duration") or 0)
        seconds = sum(durations_ms) / 1000
        source_fps = total / seconds if seconds > 0 else fps
        keep = sample_indices(total, source_fps, fps)
        _check_frame_count(len(keep), max_frames)
        frames = []
        for index in keep:
            image.seek(index)
            _check_deadline(deadline)
            frames.append(np.asarray(image.convert("RGB")))
        return VideoInput(np.stack(frames), source_fps, tuple(keep))  # frames of one size (stack raises otherwise)
    except MediaError:
        raise
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise MediaError(f"cannot decode animated image: {_reason(exc)}") from exc


def _container_format(data: bytes) -> str:
    """The demuxer for a video file, from its magic bytes (ISO BMFF / QuickTime boxes, EBML, RIFF AVI)."""
    if data[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot"):
        return "mov"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    raise MediaError(f"not a video in an accepted format ({ACCEPTED_VIDEOS})")


def _decode_container(data: bytes, fps: float, max_frames: int, max_pixels: int, deadline: float | None) -> VideoInput:
    """Decode a video file with PyAV, converting only the sampled frames to RGB; their count times the frame size
    from the header is checked before the first frame is decoded."""
    demuxer = _container_format(data)
    try:
        import av
    except ImportError as exc:
        raise MediaError("decoding this video needs PyAV (the `av` package), which is not installed") from exc
    try:
        with av.open(io.BytesIO(data), mode="r", format=demuxer) as container:
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
            width, height = stream.codec_context.width, stream.codec_context.height
            if width <= 0 or height <= 0:
                raise MediaError("cannot tell the video's frame size")
            keep = sample_indices(total, source_fps, fps)
            _check_frame_count(len(keep), max_frames)
            _check_video_pixels(len(keep), width, height, max_pixels, "sampled frames")
            wanted = set(keep)
            frames, indices = [], []
            for index, frame in enumerate(container.decode(stream)):
                _check_deadline(deadline)
                if (frame.width, frame.height) != (width, height):
                    raise MediaError(f"the video's frame size changes ({width}x{height} to "
                                     f"{frame.width}x{frame.height})")
                if index in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    indices.append(index)
                if index >= keep[-1]:
                    break
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaError(f"cannot decode video: {_reason(exc)}") from exc
    if not frames:
        raise MediaError("the video has no decodable frames")
    return VideoInput(np.stack(frames), source_fps, tuple(indices))


def _is_image_data(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS):
            return True
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return False


def _run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end from blocking code: in a loop of its own, in a thread of its own when this thread
    already runs a loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def is_remote(url: str) -> bool:
    """An http(s) URL: fetched over the network (`MediaLoader.afetch`), unlike data: and file: sources."""
    return url.split(":", 1)[0].lower() in ("http", "https")


@dataclass(frozen=True)
class MediaLoader:
    """Loads images and videos from URLs under an allow list.

    `allowed_domains` None or empty disables http(s) fetching; `allowed_local_path` None disables `file://`.
    `video_fps` is the rate frames are sampled at while decoding (Kimi K2.5's video processor samples at 2) and
    `max_video_frames` caps the sampled frames. `max_image_pixels` and `max_video_pixels` bound what one image or
    video may decode (see the module docstring); `fit`, the model's image settings, lets a large JPEG decode smaller.
    """

    allowed_domains: list[str] | None
    allowed_local_path: Path | None
    max_bytes: int
    timeout_s: float
    video_fps: float = 2.0
    max_video_frames: int = 1024
    max_image_pixels: int = DEFAULT_IMAGE_PIXELS
    max_video_pixels: int = DEFAULT_VIDEO_PIXELS
    fit: PixelSettings | None = None

    @classmethod
    def for_model(cls, processor: MediaProcessor | None, allowed_domains: list[str] | None,
                  allowed_local_path: Path | None, max_bytes: int, timeout_s: float,
                  max_image_pixels: int | None = None, max_video_pixels: int | None = None) -> MediaLoader:
        """A loader for `processor`'s model: pixel limits derived from its largest input unless given, frames sampled
        at its video rate, JPEGs decoded no larger than it takes."""
        image_limit, video_limit = default_pixel_limits(processor.image if processor else PixelSettings())
        return cls(allowed_domains, allowed_local_path, max_bytes, timeout_s,
                   video_fps=processor.video.fps if processor else 2.0,
                   max_image_pixels=max_image_pixels or image_limit, max_video_pixels=max_video_pixels or video_limit,
                   fit=processor.draft_fit if processor else None)

    def load_image(self, url: str) -> Image.Image:
        image = self.decode(url, "image")
        assert isinstance(image, Image.Image)
        return image

    def load_video(self, url: str) -> VideoInput:
        video = self.decode(url, "video")
        assert isinstance(video, VideoInput)
        return video

    def decode(self, source: str | Fetched, kind: str, deadline: float | None = None) -> Image.Image | VideoInput:
        """An image or video (`kind`) from a URL, or from what `afetch` fetched; decode loops stop at `deadline`
        (a `time.monotonic()` value)."""
        fetched = self.fetch(source) if isinstance(source, str) else source
        _check_media_type(fetched.media_type, kind)
        if kind == "image":
            return decode_image(fetched.data, self.max_image_pixels, self.fit)
        if _main_type(fetched.media_type).startswith("image/") or _is_image_data(fetched.data):
            return _decode_animated_image(fetched.data, self.video_fps, self.max_video_frames, self.max_video_pixels,
                                          deadline)
        return _decode_container(fetched.data, self.video_fps, self.max_video_frames, self.max_video_pixels, deadline)

    def fetch(self, url: str) -> Fetched:
        """The bytes behind a URL, after the policy checks for its scheme (blocking)."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._fetch_data(url)
        if scheme in ("http", "https"):
            return _run_sync(self.afetch(url))
        if scheme == "file":
            return self._fetch_file(url)
        raise MediaError(f"unsupported URL scheme {scheme!r}: use data:, http(s): or file:")

    async def afetch(self, url: str) -> Fetched:
        """An http(s) URL's bytes, fetched on the running loop; all of it within `timeout_s`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch_http(url)
        except TimeoutError as exc:
            raise MediaError(f"fetching {url} took longer than {self.timeout_s:g} s") from exc

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

    async def _fetch_http(self, url: str) -> Fetched:
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False,
                                         headers={"Accept-Encoding": "identity"}) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    try:
                        target = httpx.URL(url)
                    except httpx.InvalidURL as exc:
                        raise MediaError(f"invalid URL {url!r}: {exc}") from exc
                    if target.scheme not in ("http", "https"):
                        raise MediaError(f"redirect to a {target.scheme!r} URL is not allowed")
                    if not host_allowed(target.host, self.allowed_domains):
                        raise MediaError(f"fetching media from host {target.host!r} is not allowed")
                    async with client.stream("GET", target) as response:
                        if response.is_redirect and "location" in response.headers:
                            url = str(target.join(response.headers["location"]))
                            continue
                        if response.status_code != 200:
                            raise MediaError(f"fetching {target} failed: HTTP {response.status_code}")
                        return Fetched(await self._read_body(response), response.headers.get("content-type"))
                raise MediaError(f"fetching {url} failed: more than {MAX_REDIRECTS} redirects")
        except httpx.HTTPError as exc:
            raise MediaError(f"fetching {url} failed: {type(exc).__name__}: {exc}") from exc

    async def _read_body(self, response: httpx.Response) -> bytes:
        """The raw body, refused as soon as it passes `max_bytes` (so the cap holds on every byte received)."""
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise MediaError(f"the response is {encoding[:40]!r}-encoded; media must be sent unencoded")
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large(int(declared))
        body = bytearray()
        async for chunk in response.aiter_raw():
            body.extend(chunk)
            if len(body) > self.max_bytes:
                raise MediaError(f"media is over the {self.max_bytes}-byte limit")
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
            # containment first, on the path with `..` and every existing symlink resolved: a path outside the
            # folder gets one answer whether or not it exists
            path = Path(raw).resolve()
        except (OSError, RuntimeError, ValueError) as exc:
            raise MediaError(f"{raw} is outside the allowed media folder") from exc
        if not path.is_relative_to(Path(self.allowed_local_path).resolve()):
            raise MediaError(f"{raw} is outside the allowed media folder")
        try:
            # O_NOFOLLOW: the resolved path has no symlink left, so refuse one swapped in since; O_NONBLOCK: a FIFO
            # must not hang the open (it is then refused as not a regular file).
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise MediaError(f"cannot open {raw}: {exc.strerror or 'error'}") from exc
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
