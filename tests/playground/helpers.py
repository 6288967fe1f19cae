"""What the playground tests share: paths, the model in use, a started server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "playground"


def bundled_model_dir() -> Path | None:
    from reasoning_engine.tiny import BUNDLED_MODEL_DIR

    return Path(BUNDLED_MODEL_DIR) if (Path(BUNDLED_MODEL_DIR) / "config.json").is_file() else None


BUNDLED = bundled_model_dir()


@dataclass
class Served:
    """A running `reasoning-engine serve`."""

    url: str

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text
