"""tests/gpu: the CUDA path on a real device (marker `cuda`). Where CUDA is absent (`make
test` on a CPU machine) every test here is skipped at collection, before any model loads."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.random_model import SMOLLM2_SHAPE, save_random_model


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The SmolLM2-135M-shaped random Llama, saved once per module."""
    folder = tmp_path_factory.mktemp("smollm2-shaped")
    save_random_model(folder, SMOLLM2_SHAPE)
    return str(folder)
