"""Compute kernels. Each family has a plain torch module (the reference, and the path used on CPU) and a Triton module
whose functions take the same arguments, so a layer picks its implementation once from `kernel_backend`.

| family    | torch reference        | Triton                    |
|-----------|------------------------|---------------------------|
| attention | `attention.py`         | `triton_attention.py`     |
| compressed_attention | `compressed_attention.py` | `triton_compressed_attention.py` |
| moe       | `fused_moe.py`         | `triton_moe.py`           |
| norm      | `norm.py`              | `triton_norm.py`          |
| rotary    | `rotary.py`            | `triton_rotary.py`        |
| sampling  | `sampling.py`          | `triton_sampling.py`      |
| sparse_attention | `sparse_attention.py` | `triton_sparse_attention.py` |

Triton is imported only by the `triton_*` modules, so the package imports where Triton is absent.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # Without a GPU, Triton runs kernels only through its interpreter (on CPU tensors), as the CPU tests and
    # kernel_backend="triton" on CPU do. Triton reads the switch when it defines its own library functions and each
    # @triton.jit kernel, so it is set here, before any `triton_*` module imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_MODULES = {
    "attention": ("attention", "triton_attention"),
    "compressed_attention": ("compressed_attention", "triton_compressed_attention"),
    "moe": ("fused_moe", "triton_moe"),
    "norm": ("norm", "triton_norm"),
    "rotary": ("rotary", "triton_rotary"),
    "sampling": ("sampling", "triton_sampling"),
    "sparse_attention": ("sparse_attention", "triton_sparse_attention"),
}


def triton_available() -> bool:
    """True when the `triton` package can be imported (it may still need TRITON_INTERPRET=1 without a GPU)."""
    return importlib.util.find_spec("triton") is not None


def kernel_module(family: str, backend: str) -> ModuleType:
    """The module implementing `family` (a key of `_MODULES`: "attention", "moe", ...) for `backend`
    ("torch" or "triton"); imported on first use so Triton is loaded only when asked for."""
    if family not in _MODULES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {sorted(_MODULES)}")
    if backend not in ("torch", "triton"):
        raise ValueError(f"kernel backend must be 'torch' or 'triton', got {backend!r}")
    name = _MODULES[family][backend == "triton"]
    return importlib.import_module(f"{__name__}.{name}")
