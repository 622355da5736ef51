"""A started engine compiles no Triton kernel while it serves: the start-up (the profile run
over the engine's KV dtype, the decode graphs, the sampler's warm-up) has compiled or loaded
every variant a step of a covered batch launches. A variant first met mid-run stalls the
host for its load from Triton's cache, or seconds for a compile in a fresh one, while the
device idles (`bench --profile` counts them).

Covered: prompts whose block tables take every class of width the JIT tells apart (1, a
multiple of 16, other), batches up to max_num_seqs (all in the decode graphs), and every
kind of sampling row (greedy, temperature, top-k, top-p, min-p, penalties, seeds, logprobs)."""
from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.kernel_profile import jit_compiles
from tests.gpu.random_model import free

pytestmark = pytest.mark.cuda

KINDS = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.8, top_p=0.95),
         dict(temperature=0.7, top_k=20), dict(temperature=0.9, min_p=0.1),
         dict(temperature=0.8, top_k=50, top_p=0.8), dict(temperature=0.8, presence_penalty=0.5),
         dict(temperature=0.8, seed=3), dict(temperature=0.0, logprobs=3)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_no_kernel_compiles_while_serving(model_dir, kv_cache_dtype):
    llm = LLM(model=model_dir, device="cuda", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              gpu_memory_utilization=0.3, max_num_seqs=64, max_num_batched_tokens=2048, seed=0)
    rng = random.Random(0)
    # 3 .. 700 tokens: block tables 1 to 44 blocks wide, 16 and 32 among them
    lengths = [3, 16, 17, 256, 257, 512, 700] + [rng.randint(3, 700) for _ in range(41)]
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=rng.randint(2, 40), ignore_eos=True, **KINDS[i % len(KINDS)])
              for i in range(len(prompts))]
    with jit_compiles() as compiles:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert compiles == [], [(name, f"{ms:.0f} ms") for _, name, ms in compiles]
    del llm, outs
    free()
