"""scripts/cpu_targets_elsewhere.py: the default model's skeleton keeps everything but the
quantized tensors' bytes, and `fill` turns it back into a model the packed path serves."""
from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from pagedllm import LLM, SamplingParams
from pagedllm.loader.gguf_loader import open_gguf
from tests.quant_helpers import dequantize

SCRIPT = Path(__file__).parent.parent / "scripts" / "cpu_targets_elsewhere.py"


def load_script():
    spec = importlib.util.spec_from_file_location("cpu_targets_elsewhere", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_skeleton_and_fill_give_the_default_model_with_random_blocks(default_gguf, tmp_path):
    script = load_script()
    script.skeleton(default_gguf, str(tmp_path / "skeleton.gguf.gz"))
    assert (tmp_path / "skeleton.gguf.gz").stat().st_size < 2 << 20
    path = tmp_path / "model.gguf"
    with gzip.open(tmp_path / "skeleton.gguf.gz") as f:
        path.write_bytes(f.read())
    script.fill(str(path))

    original, filled = open_gguf(default_gguf), open_gguf(str(path))
    assert [(t.name, t.tensor_type, list(t.shape)) for t in filled.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in original.tensors]
    for ours, theirs in zip(filled.tensors, original.tensors):
        if ours.tensor_type not in script.QUANTIZED:
            np.testing.assert_array_equal(ours.data, theirs.data)
            continue
        cols = int(ours.shape[0])
        weights = dequantize(np.asarray(ours.data[:4]), ours.tensor_type, 4, cols)  # rows alike
        assert weights.isfinite().all() and weights.abs().max() > 0
        assert not np.array_equal(ours.data, theirs.data)

    llm = LLM(model=str(path), quantization="gguf", kv_cache_memory=32 << 20)
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                               logprobs=0), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(np.isfinite(entry[t].logprob) for entry, t in zip(out.logprobs, out.token_ids))
