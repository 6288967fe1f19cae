"""torchvision for the tests' reference only: transformers' Kimi_K25 image and video processors, which our own
preprocessing (reasoning_engine/multimodal/processing.py) must equal, are built on it.

On a CPU machine scripts/bootstrap.sh installs the registry's torchvision wheel into `<venv>/reference`, outside
site-packages, so nothing but the tests ever sees it: that wheel is built against CUDA torch, and in site-packages
it would break `import transformers.modeling_utils` (which imports torchvision when it finds it) for every user of
the venv. Beside the CPU torch its `_C` extension cannot load, and `import torchvision` then dies registering fake
kernels for `torchvision::nms` and `torchvision::qnms`, operators only that extension defines; defining the two
schemas (no kernels) first lets the import finish. The processors only run torchvision's resize, pad and normalise,
which are plain torch and never reach those operators. On CUDA machines torchvision is a normal install.

`enable()` runs when tests/conftest.py loads, before anything imports transformers.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import torch

SCHEMAS = {"nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"}
_stand_ins: list[torch.library.Library] = []  # kept alive: a dropped Library takes its definitions with it


def _extension_loads(folder: Path) -> bool:
    """Load torchvision's C extension as its own import would; False when it cannot load beside this torch."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (folder / f"_C{suffix}").is_file():
            try:
                torch.ops.load_library(folder / f"_C{suffix}")
            except OSError:
                return False
            return True
    return False


def enable() -> bool:
    """Make torchvision importable for the reference; False when it is not installed at all."""
    reference = Path(sys.prefix) / "reference"
    if reference.is_dir() and str(reference) not in sys.path:
        sys.path.append(str(reference))
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    if "torchvision" not in sys.modules and not _extension_loads(Path(spec.origin).parent):
        library = torch.library.Library("torchvision", "FRAGMENT")
        for op, schema in SCHEMAS.items():
            if not hasattr(torch.ops.torchvision, op):
                library.define(schema)
        _stand_ins.append(library)
    return True


def require() -> None:
    """For a test that compares with transformers' processors: fail (not skip) when the reference is missing."""
    if not enable():
        raise ModuleNotFoundError("torchvision is not installed: the media preprocessing tests compare with "
                                  "transformers' Kimi_K25 processors, built on it (run scripts/bootstrap.sh)")
    import torchvision  # noqa: F401
