"""Shared fixtures: the default model and its transformers reference, loaded once per run."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

import pytest
import safetensors.torch
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
    """transformers' own model and tokenizer loaded from the same GGUF, fp32: the oracle.

    transformers takes 30-40 s to read a GGUF on 2 cores; what it built is saved once under
    the cache directory (keyed by the file's bytes and transformers' version) and reloaded by
    later runs and by the other test workers in about a second.
    """
    import transformers

    folder = _oracle_folder(default_gguf, transformers.__version__)
    with _locked(folder.with_suffix(".lock")):
        if not (folder / "model.safetensors").is_file():
            gguf_folder, name = os.path.split(default_gguf)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf_folder, gguf_file=name, dtype=torch.float32)
            tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_folder, gguf_file=name)
            tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
            # Not save_pretrained: a model read from a GGUF refuses it (its gguf quantizer).
            model.config.quantization_config = None
            model.config.save_pretrained(tmp), tokenizer.save_pretrained(tmp)
            safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
            os.replace(tmp, folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(folder)


def _oracle_folder(gguf_path: str, version: str) -> Path:
    digest = hashlib.sha256(version.encode())
    with open(gguf_path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm"
    folder = Path(root) / "test-oracle" / digest.hexdigest()[:32]
    folder.parent.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def _locked(path: Path):
    """One process at a time (pytest-xdist workers share the cache)."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def default_llm():
    """One engine on the default model, shared by tests that only read from it: float32,
    the GGUF dequantized (transformers' exact twin; --quantization gguf is tested against
    it in test_gguf_model.py)."""
    from pagedllm import LLM

    return LLM(kv_cache_memory=512 << 20, dtype="float32")
