"""The bundled tiny reasoning model (DeepSeek-V3 architecture, Kimi chat format), used when no model is given."""

from pathlib import Path

BUNDLED_MODEL_DIR: Path = Path(__file__).resolve().parent / "assets"

__all__ = ["BUNDLED_MODEL_DIR"]
