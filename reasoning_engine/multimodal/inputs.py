"""What a prompt's media becomes before the engine sees it: one `MediaItem` per encoder input.

An image is one item; a video is one item per chunk of frames, because the processor separates chunks' placeholders
with timestamp text. Items sit below the engine (the worker encodes them, the scheduler hashes them into the prefix
cache keys), so this module imports nothing above torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MediaItem:
    """One encoder input and the run of placeholder tokens its output embeddings replace.

    `offset` is the position of its first placeholder token in the prompt and `length` the number of placeholder
    tokens, which equals the number of rows the vision encoder + projector produce for it.
    """

    kind: str  # "image" or "video"
    content_hash: str  # of the pixel values and grid: equal media share encoder outputs and prefix-cache blocks
    offset: int
    length: int
    pixel_values: torch.Tensor  # this item's patches, as the processor returns them
    grid_thw: tuple[int, int, int]  # patches along time, height, width (before the spatial merge)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, stop: int) -> bool:
        return self.offset < stop and start < self.end


def content_hash(pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> str:
    """Hash of what the encoder reads: two uploads of the same image (any file name, any URL) hash alike."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((tuple(pixel_values.shape), str(pixel_values.dtype), tuple(grid_thw))).encode())
    digest.update(pixel_values.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def media_keys(media: tuple[MediaItem, ...], start: int, stop: int) -> tuple[tuple[str, int], ...]:
    """(content hash, first placeholder's position relative to `start`) of the items whose placeholders fall in token
    positions [start, stop): part of a prefix-cache block's key, so equal text with different images, or the same
    image's rows in other places, never shares KV."""
    return tuple((item.content_hash, item.offset - start) for item in media if item.overlaps(start, stop))
