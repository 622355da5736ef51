"""tests/gpu: the CUDA path on a real device (marker `cuda`). Where CUDA is absent (`make
test` on a CPU machine) every test here is skipped at collection, before any model loads."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
