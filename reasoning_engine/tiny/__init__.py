"""The bundled tiny reasoning model (multimodal Kimi K2.5 layout: a small vision tower and a DeepSeek-V3 language model,
Kimi chat format), used when no model is given."""

from reasoning_engine.config import BUNDLED_MODEL_DIR

__all__ = ["BUNDLED_MODEL_DIR"]
