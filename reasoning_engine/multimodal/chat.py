"""Media parts of chat messages: what the server and `LLM.chat` both do before the chat template runs.

OpenAI content parts (`image_url`, `video_url`) and vLLM's offline ones (`image_pil`, `image` with a PIL image) are
loaded in order and replaced by plain `{"type": "image"}` / `{"type": "video"}` parts, which multimodal chat
templates render as the model's placeholder (Kimi K2.5: `<|media_begin|>image<|media_content|><|media_pad|>
<|media_end|>`); the engine then expands each placeholder for its image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

IMAGE_PARTS = ("image_url", "image_pil", "image")
VIDEO_PARTS = ("video_url", "video")


@dataclass
class ChatMedia:
    """A conversation's messages with media parts normalised, and the media in the order the template meets them."""

    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)

    def multi_modal_data(self) -> dict[str, list[Any]]:
        data: dict[str, list[Any]] = {}
        if self.images:
            data["image"] = self.images
        if self.videos:
            data["video"] = self.videos
        return data


def _url(part: dict[str, Any], kind: str) -> str:
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError(f"{kind}.url: expected a URL string")
    return url


def extract_media(messages: list[dict[str, Any]], load_image: Callable[[str], Any],
                  load_video: Callable[[str], Any], name: str = "messages") -> ChatMedia:
    """Load every media part (`load_image` / `load_video` take a URL and raise ValueError naming the problem;
    errors are re-raised naming the part, e.g. `messages[1].content[0]`)."""
    result = ChatMedia(messages=[])
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            result.messages.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"{name}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            try:
                if kind in IMAGE_PARTS:
                    value = part.get(kind)
                    is_url = kind == "image_url" or isinstance(value, (str, dict))
                    result.images.append(load_image(_url(part, kind)) if is_url else value)
                    parts.append({"type": "image"})
                elif kind in VIDEO_PARTS:
                    value = part.get(kind)
                    is_url = kind == "video_url" or isinstance(value, (str, dict))
                    result.videos.append(load_video(_url(part, kind)) if is_url else value)
                    parts.append({"type": "video"})
                else:
                    parts.append(part)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
        result.messages.append({**message, "content": parts})
    return result
