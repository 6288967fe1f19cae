"""Hand-built hostile media for the loader's limits: files of a few KB whose headers promise huge decodes, written
byte by byte so nothing large is ever made in the test itself."""

from __future__ import annotations

import gzip
import struct
import zlib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_png(width: int, height: int, pixel_data: bool = True) -> bytes:
    """A 1-bit grayscale PNG of width x height, all black: a valid file of a few KB (13000 x 13000 is about 21 KB)
    that decodes to width * height pixels; without `pixel_data` only the header chunks (no IDAT), so any decode
    attempt fails."""
    header = _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
    if not pixel_data:
        return PNG_SIGNATURE + header + _png_chunk(b"IEND", b"")
    row = bytes(1 + (width + 7) // 8)  # filter byte + packed bits
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return PNG_SIGNATURE + header + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")


def canvas_gif(width: int, height: int, frames: int, duration_ms: int,
               last_frame_at: tuple[int, int] | None = None) -> bytes:
    """An animated GIF of `frames` one-pixel frames on a width x height canvas: a few bytes a frame, yet each frame
    decodes to the whole canvas. `last_frame_at` places the last frame's pixel there, past the canvas, which widens
    it when that frame is reached."""
    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + bytes(3) + b"\xff\xff\xff")
    out += b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"  # loop forever
    for index in range(frames):
        x, y = last_frame_at if last_frame_at is not None and index == frames - 1 else (0, 0)
        out += b"\x21\xf9\x04\x00" + struct.pack("<H", duration_ms // 10) + b"\x00\x00"  # graphic control: delay
        out += b"\x2c" + struct.pack("<HHHHB", x, y, 1, 1, 0) + b"\x02\x02\x44\x01\x00"  # 1x1 image, LZW data
    out += b"\x3b"
    return bytes(out)


def nested_gzip(size: int, layers: int = 2) -> bytes:
    """`size` zero bytes gzip-compressed `layers` times (Content-Encoding: gzip, gzip): 64 MiB becomes about 1 KB."""
    packer = zlib.compressobj(9, wbits=31)
    block = bytes(1 << 20)
    data = b"".join(packer.compress(block) for _ in range(size >> 20)) + packer.flush()
    for _ in range(layers - 1):
        data = gzip.compress(data, 9)
    return data


EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
       b"newpath 0 0 moveto 8 8 lineto stroke showpage\n%%EOF\n")
