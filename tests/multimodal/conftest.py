"""`torchvision_reference`: for the tests that compare with transformers' Kimi_K25 processors, which need torchvision
(made importable by tests/reference_torchvision.py); a missing reference fails those tests, it never skips them."""

from __future__ import annotations

from types import ModuleType

import pytest

try:
    from .. import reference_torchvision
except ImportError:  # tests/ itself is on sys.path
    import reference_torchvision


@pytest.fixture(scope="session")
def torchvision_reference() -> ModuleType:
    reference_torchvision.require()
    import torchvision

    return torchvision
