"""Device mapping on CUDA: greedy parity of mapped runs against one GPU (fp32).

The SmolLM2-135M-shaped random Llama (random_model.py), 16 prompts x 32 greedy tokens: the
single-GPU run against `cuda:0:15,cpu:15` (CPU offload) and, with two GPUs,
`cuda:0:15,cuda:1:15`. Each must give identical tokens; each run's throughput is printed.
The throughput comparisons at 8B scale are `pagedllm bench ... --device-map`
(scripts/gpu_device_map.sh).
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.gpu.random_model import compare, free

pytestmark = pytest.mark.cuda


def run(folder: str, prompts: list[list[int]], **engine) -> dict:
    llm = LLM(model=folder, seed=0, dtype="float32", **engine)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "cumulative_logprob": [o.outputs[0].cumulative_logprob for o in outs],
        "output_tok_s": 32 * len(prompts) / elapsed,
        "kv_tokens": llm.engine.worker.num_gpu_blocks * llm.engine.block_size,
    }
    del llm, outs
    free()
    return result


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10000) for _ in range(rng.randint(8, 200))] for _ in range(16)]


@pytest.fixture(scope="module")
def one_gpu(model_dir, prompts) -> dict:
    return run(model_dir, prompts, device_map=None)


@pytest.mark.parametrize("device_map", ["cuda:0:15,cpu:15", "cuda:0:15,cuda:1:15"])
def test_mapped_run_matches_one_gpu(model_dir, prompts, one_gpu, device_map):
    if device_map.count("cuda") > torch.cuda.device_count():
        pytest.skip(f"{device_map} needs {device_map.count('cuda')} GPUs")
    mapped = run(model_dir, prompts, device_map=device_map)
    row = compare(mapped, one_gpu)
    print(f"{device_map}: {mapped['output_tok_s']:.1f} tok/s, KV {mapped['kv_tokens']} tokens; "
          f"cuda:0 {one_gpu['output_tok_s']:.1f} tok/s, KV {one_gpu['kv_tokens']} tokens")
    assert row["ok"], f"{device_map} vs cuda:0: {row}"
