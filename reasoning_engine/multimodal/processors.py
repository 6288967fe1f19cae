"""Which media preprocessing a checkpoint takes: Kimi K2.5's or GLM-5.3-Flash's, by its config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reasoning_engine.multimodal.glm5_processing import Glm5MediaProcessor
from reasoning_engine.multimodal.processing import MediaProcessor, load_json


def load_media_processor(path: str | Path, tokenizer: Any | None = None) -> Any:
    """The checkpoint's media preprocessing: Kimi K2.5's (`MediaProcessor`), GLM-5.3-Flash's
    (multimodal/glm5_processing.py, images only), or None for a model without a vision tower."""
    folder = Path(path)
    config = load_json(folder / "config.json") or {}
    if config.get("model_type") != "glm5_next" or not config.get("vision_config"):
        return MediaProcessor.from_model_dir(folder, tokenizer)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return Glm5MediaProcessor.from_model_dir(folder, config, tokenizer)
