"""Shared fixtures: the default model and its transformers reference, loaded once per run."""
from __future__ import annotations

import os

import pytest
import torch

# Every Triton kernel in the suite runs on the CPU interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(torch.get_num_threads(), 1))


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from pagedllm.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_reference(default_gguf):
    """transformers' own model and tokenizer loaded from the same GGUF, fp32: the oracle."""
    import transformers

    folder, name = os.path.split(default_gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


@pytest.fixture(scope="session")
def default_llm():
    """One engine on the default model, shared by tests that only read from it: float32,
    the GGUF dequantized (transformers' exact twin; --quantization gguf is tested against
    it in test_gguf_model.py)."""
    from pagedllm import LLM

    return LLM(kv_cache_memory=512 << 20, dtype="float32")
