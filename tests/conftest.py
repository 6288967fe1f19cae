"""Fixtures shared across test folders.

`llama_dir`, `deepseek_dir`: tiny random Llama / DeepSeek-V3 checkpoints with a character tokenizer
(`tests/char_models.py`), built once per session.

`tiny_checkpoint(name)`: builds, once per session, the tiny random checkpoint `name` of
`tests/models/checkpoints.py::VARIANTS` (every supported family and config variant, quantized ones included) and
returns its `TinyCheckpoint` (folder, and `reference()` for the transformers model it must match).

torchvision, the media preprocessing tests' reference, is made importable first (tests/reference_torchvision.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

try:  # tests/ imported as a package
    from . import reference_torchvision
    from .char_models import build_deepseek, build_llama
    from .models.checkpoints import TinyCheckpoint, build_checkpoint
except ImportError:  # pytest's default rootdir-less import: tests/ itself is on sys.path
    import reference_torchvision
    from char_models import build_deepseek, build_llama
    from models.checkpoints import TinyCheckpoint, build_checkpoint

reference_torchvision.enable()  # before anything imports transformers (see the module)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("tiny_llama"), seed=0)


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek(tmp_path_factory.mktemp("tiny_deepseek"), seed=1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyCheckpoint]:
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[str, TinyCheckpoint] = {}

    def get(name: str) -> TinyCheckpoint:
        if name not in built:
            built[name] = build_checkpoint(name, root)
        return built[name]

    return get
