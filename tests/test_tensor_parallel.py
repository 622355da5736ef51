"""Tensor parallelism on gloo (CPU processes): greedy output at tensor_parallel_size 2 and 3
is the output at 1, with preemption and prefix caching on.

The ranks' partial sums add up in another order than one rank's GEMM, so logits differ by
fp32 rounding (~1e-6). Tokens must be equal except where the reference's two best
candidates are closer than that could explain (TIE_GAP): there the rest of that sequence is
not compared. Every run checks that such near-ties are rare.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import check_tp_size
from pagedllm.engine_args import EngineArgs
from tests.dist_helpers import free_port, run_ranks
from tests.prompts import mixed_prompts

REPO = Path(__file__).resolve().parents[1]
# A gap between the two best logprobs below this could flip under fp32 rounding.
TIE_GAP = 1e-3
MAX_TOKENS = 32
# Small enough that 16 requests preempt each other; block_size 8 so prompts share blocks.
ENGINE = dict(block_size=8, num_gpu_blocks_override=64, enable_prefix_caching=True,
              distributed_timeout=60)

SHAPE = dict(vocab_size=251, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
             max_position_embeddings=256, tie_word_embeddings=False)
# Heads chosen to cover both ways of sharding KV heads at 2 and 3 ranks: llama splits its
# 6 KV heads (3 or 2 per rank), qwen3 replicates its single KV head on every rank; bloom's
# ALiBi slopes are split with its heads. vocab 251 pads the vocabulary shards.
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(
        **SHAPE, num_attention_heads=12, num_key_value_heads=6, head_dim=8),
    "qwen3": lambda: transformers.Qwen3Config(
        **SHAPE, num_attention_heads=6, num_key_value_heads=1, head_dim=16),
    "bloom": lambda: transformers.BloomConfig(
        vocab_size=251, hidden_size=96, n_layer=2, n_head=6, tie_word_embeddings=True),
}


def token_prompts() -> list[list[int]]:
    """16 prompts of 6..40 token ids; 8 share a 20-token prefix."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 250, (20,), generator=g).tolist()
    prompts = []
    for i in range(16):
        n = int(torch.randint(6, 21, (1,), generator=g))
        tail = torch.randint(3, 250, (n,), generator=g).tolist()
        prompts.append(prefix + tail if i % 2 else tail + tail[: i % 7])
    return prompts


def run(model: str, prompts, tp: int, **engine):
    """Greedy outputs with logprobs of the two best tokens, and the engine's stats. One
    thread, as each rank gets on this 2-core machine (more threads than free cores slow a
    tiny model's GEMMs down many times over)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = None
    try:
        llm = LLM(model, tensor_parallel_size=tp, **{**ENGINE, **engine})
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2,
                                ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm.engine.scheduler
        stats = dict(preemptions=scheduler.stats.num_preemptions_recompute,
                     cached=sum(o.num_cached_tokens for o in outs))
        bm = scheduler.block_manager
        assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks, "blocks leaked"
        return outs, stats
    finally:
        if llm is not None:
            llm.engine.shutdown()
        torch.set_num_threads(threads)


def assert_same_greedy(reference, outputs) -> None:
    near_ties = 0
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        want, got = ref.outputs[0], out.outputs[0]
        for j, (a, b) in enumerate(zip(want.token_ids, got.token_ids)):
            if a == b:
                continue
            best = sorted((lp.logprob for lp in want.logprobs[j].values()), reverse=True)[:2]
            gap = best[0] - best[1]
            assert gap < TIE_GAP, (f"prompt {i}, token {j}: {b} instead of {a}, though the "
                                   f"reference's margin is {gap:.2e}")
            near_ties += 1
            break
        else:
            assert len(want.token_ids) == len(got.token_ids), f"prompt {i}: lengths differ"
    assert near_ties <= 2, f"{near_ties} of {len(reference)} sequences ended at a near-tie"


def save_tiny(name: str, folder) -> str:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[name](), dtype=torch.float32)
    hf.save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """A tiny random model of the family saved as safetensors, and its TP=1 outputs."""
    path = save_tiny(request.param, tmp_path_factory.mktemp(f"tp-{request.param}"))
    prompts = token_prompts()
    reference, stats = run(str(path), prompts, tp=1)
    assert stats["preemptions"] > 0 and stats["cached"] > 0
    return str(path), prompts, reference


@pytest.mark.parametrize("tp", [2, 3])
def test_greedy_tokens_match_one_rank(family, tp):
    path, prompts, reference = family
    outputs, stats = run(path, prompts, tp)
    assert stats["preemptions"] > 0, "the small cache should have forced preemption"
    assert stats["cached"] > 0, "the shared prefix should have hit the prefix cache"
    assert_same_greedy(reference, outputs)


def test_async_scheduling_at_two_ranks(family):
    """CUDA's engine order (decode windows of 4, launched ahead) on gloo: the same tokens."""
    path, prompts, reference = family
    outputs, _ = run(path, prompts, 2, async_scheduling=True, num_scheduler_steps=4)
    assert_same_greedy(reference, outputs)


def test_default_model_at_three_ranks():
    """SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank."""
    prompts = mixed_prompts()[8:24]  # 8 plain openings, 8 sharing a long prefix
    # float32: the GGUF dequantized on every rank (its packed blocks are not sharded).
    engine = dict(block_size=16, num_gpu_blocks_override=48, dtype="float32")
    reference, ref_stats = run(None, prompts, tp=1, **engine)
    outputs, stats = run(None, prompts, tp=3, **engine)
    assert ref_stats["preemptions"] > 0 and stats["preemptions"] > 0
    assert stats["cached"] > 0
    assert_same_greedy(reference, outputs)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_tensor_parallel_size_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineArgs(tensor_parallel_size=value)


def test_device_map_and_quantization_exclude_tensor_parallelism():
    with pytest.raises(ValueError, match="device_map and tensor_parallel_size > 1 cannot be "
                                         "combined"):
        EngineArgs(tensor_parallel_size=2, device_map="cpu:1,cpu:1")
    with pytest.raises(ValueError, match="quantization 'gguf' and tensor_parallel_size > 1 "
                                         "cannot be combined"):
        EngineArgs(tensor_parallel_size=2, quantization="gguf")


@pytest.mark.parametrize("heads, kv, size, message", [
    (9, 3, 2, "tensor_parallel_size 2 must divide the model's 9 attention heads"),
    (12, 6, 4, "tensor_parallel_size 4 and the model's 6 key-value heads: one must divide "
               "the other"),
    (12, 12, 24, "tensor_parallel_size 24 must divide the model's 12 attention heads"),
])
def test_model_that_cannot_be_split_is_refused(heads, kv, size, message):
    config = ModelConfig("llama", vocab_size=100, hidden_size=96, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=8,
                         intermediate_size=192)
    with pytest.raises(ValueError, match=message):
        check_tp_size(config, size)


def test_refusal_reaches_the_caller_without_a_hang(tmp_path):
    """Every rank refuses the split; rank 0 raises, the others exit, nothing waits on them."""
    path = save_tiny("llama", tmp_path)
    with pytest.raises(ValueError, match="tensor_parallel_size 4"):
        LLM(path, tensor_parallel_size=4, **ENGINE)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pagedllm-tp")]


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_two_nodes_started_by_torchrun(family):
    """Two `torchrun --nnodes 2 --nproc-per-node 1` launches on localhost, as two machines
    would run them: rank 0's greedy tokens are the one-rank run's."""
    path, prompts, reference = family
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                 "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr",
                 "127.0.0.1", "--master-port", str(port), "tests/tp_generate.py", path]
                for rank in (0, 1)]
    stdouts = run_ranks(commands, [env, env])
    line = next(x for x in stdouts[0].splitlines() if x.startswith("TOKENS "))
    tokens = json.loads(line.removeprefix("TOKENS "))
    assert not any(x.startswith("TOKENS ") for x in stdouts[1].splitlines())
    outputs = [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=t)])
               for t in tokens]
    assert_same_greedy(reference, outputs)


def test_killed_rank_fails_the_request_and_stops_the_server(tmp_path):
    """A worker rank killed under a running server: the next request is answered with an
    error naming the rank within the collective timeout, and the server exits non-zero."""
    import httpx
    import psutil

    from tests.test_server import ServerProcess

    path = save_tiny("llama", tmp_path)
    timeout = 20
    srv = ServerProcess(["--model", path, "--served-model-name", "tiny",
                         "--tensor-parallel-size", "2", "--distributed-timeout", str(timeout),
                         "--block-size", "8", "--num-gpu-blocks-override", "32",
                         "--swap-space", "0.01"])
    try:
        url = srv.wait_ready()
        body = {"model": "tiny", "prompt": [5, 17, 99, 3], "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200
        ranks = [c for c in psutil.Process(srv.proc.pid).children()
                 if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(ranks) == 1, ranks
        ranks[0].kill()  # the server's child: a zombie until the server reaps it
        start = time.monotonic()
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert time.monotonic() - start < timeout + 10
        assert reply.status_code in (500, 503), reply.text
        message = reply.json()["error"]["message"]
        assert f"rank 1 (pid {ranks[0].pid}) was killed by SIGKILL" in message, message
        assert srv.proc.wait(timeout=60) != 0
    finally:
        srv.close()
    assert "Traceback" not in srv.read_stderr()
