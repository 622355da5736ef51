"""--kv-cache-dtype fp8: the paged KV cache in float8_e4m3fn (scale 1.0), written by the Triton
cache kernels and read by the Triton attention kernels (in Triton's interpreter on the CPU),
and refused on the CPU path with an error naming the flag."""
from __future__ import annotations


import pytest
import torch

from tests.triton_setup import DEVICE, INTERPRETED, skip_unless_runnable

from pagedllm.kernels import triton_attention  # noqa: E402
from pagedllm.kernels.reference import paged_attention, write_kv_cache  # noqa: E402
from pagedllm.kernels.triton_attention import triton_paged_attention  # noqa: E402
from pagedllm.kernels.triton_cache import (  # noqa: E402
    triton_rotary_write_kv_cache,
    triton_write_kv_cache,
)
from pagedllm.kernels.triton_ops import triton_rotary_embedding  # noqa: E402
from pagedllm.worker.cache_engine import resolve_kv_cache_dtype  # noqa: E402
from tests.test_kernels import BF16_DOT, make_batch  # noqa: E402

skip_unless_runnable(triton_attention._paged_decode_kernel)
FP8 = torch.float8_e4m3fn


def to_fp8(t: torch.Tensor) -> torch.Tensor:
    """What the cache kernels store: clamped to E4M3's range, rounded to nearest."""
    return t.float().clamp(-448.0, 448.0).to(FP8)


def assert_fp8_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal on the GPU. The interpreter's fp32 -> E4M3 cast drops the carry when rounding up
    to the next power of two (1.97 -> 1.0 where the GPU and torch give 2.0) and rounds
    subnormals (below 2**-6) its own way: a few values there are off, within a factor 2."""
    if not INTERPRETED:
        assert torch.equal(got, want)
        return
    differ = got != want
    assert differ.float().mean() < 0.02
    assert ((got - want)[differ].abs() <= want[differ].abs() / 2 + 2.0 ** -8).all()


def test_write_kv_cache_to_fp8_rounds_clamps_and_skips_padding():
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim = 4, 16, 2, 32
    slots = torch.tensor([5, -1, 17, 40, -1, 63])
    key = torch.randn(6, kv_heads, head_dim, generator=g) * 3
    value = torch.randn(6, kv_heads, head_dim, generator=g)
    key[0, 0, :2] = torch.tensor([1000.0, -1e6])  # past E4M3's +-448
    start = to_fp8(torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g))
    cache = start.clone().to(DEVICE)
    triton_write_kv_cache(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE))
    expected = start.float().clone()
    write_kv_cache(key.clamp(-448, 448).to(FP8).float(), value.to(FP8).float(), expected, slots)
    got = cache.cpu().float()
    assert_fp8_equal(got, expected)
    flat = cache.cpu().float().view(2, -1, kv_heads, head_dim)
    assert flat[0, 5, 0, :2].tolist() == [448.0, -448.0]


def test_rotary_write_to_fp8_is_rotary_then_the_fp8_write():
    g = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 32
    positions = torch.tensor([0, 3, 7, 8, 20])
    q = torch.randn(tokens, heads, head_dim, generator=g)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(32).float(), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    slots = torch.tensor([1, 2, -1, 9, 30])
    start = torch.zeros(2, 2, 16, kv_heads, head_dim, dtype=FP8)
    want_cache = start.float().clone()
    q_ref, k_ref = q.clone().to(DEVICE), k.clone().to(DEVICE)
    triton_rotary_embedding(positions.to(DEVICE), q_ref, k_ref, cos_sin.to(DEVICE))
    q_ref, k_ref = q_ref.cpu(), k_ref.cpu()
    write_kv_cache(to_fp8(k_ref).float(), to_fp8(v).float(), want_cache, slots)
    cache, q_dev = start.clone().to(DEVICE), q.clone().to(DEVICE)
    triton_rotary_write_kv_cache(positions.to(DEVICE), q_dev, k.clone().to(DEVICE), v.to(DEVICE),
                                 cache, slots.to(DEVICE), cos_sin.to(DEVICE))
    cache, q = cache.cpu(), q_dev.cpu()
    assert_fp8_equal(cache[1].float(), want_cache[1])  # values: no arithmetic before the cast
    # keys: rotated in another kernel (an fp32 ulp apart), then one E4M3 rounding (the
    # interpreter's may halve a value, see assert_fp8_equal)
    torch.testing.assert_close(cache[0].float(), want_cache[0], atol=2.0 ** -8,
                               rtol=0.5 if INTERPRETED else 2.0 ** -3)
    torch.testing.assert_close(q, q_ref)


def fp8_batch(seq_lens, query_lens, **kwargs):
    batch = make_batch(seq_lens, query_lens, **kwargs)
    return batch, to_fp8(batch.kv_cache)  # the poison (NaN) stays NaN in E4M3


def attend(batch, cache, num_splits=None):
    out = torch.full_like(batch.query, float("nan"))
    return triton_paged_attention(batch.query, cache, batch.meta, batch.scale,
                                  num_splits=num_splits, out=out)


@pytest.mark.parametrize("phase, seq_lens, query_lens, splits", [
    ("decode", [1, 17, 32, 80, 45], [1] * 5, 3),
    ("mixed", [9, 40, 33], [1, 40, 7], None),  # decode, a whole prompt, a chunk after cached context
])
def test_attention_over_an_fp8_cache(phase, seq_lens, query_lens, splits, monkeypatch):
    """Exactly the fp32 attention over the cache's dequantized values; within FP8's rounding
    of the attention over the unquantized fp32 cache."""
    monkeypatch.setattr(triton_attention, "DECODE_BLOCK_N", 16)
    batch, cache = fp8_batch(seq_lens, query_lens, num_heads=4, num_kv_heads=2)
    out = attend(batch, cache.to(DEVICE), splits).cpu()
    assert not out.isnan().any()
    dequantized = paged_attention(batch.query.cpu(), cache.cpu().float().nan_to_num(0.0),
                                  batch.meta.to("cpu"), batch.scale)
    torch.testing.assert_close(out, dequantized, atol=1e-5, rtol=1e-4)
    exact = paged_attention(batch.query.cpu(), batch.kv_cache.cpu().nan_to_num(0.0),
                            batch.meta.to("cpu"), batch.scale)
    error = (out - exact).abs().max().item()
    assert 0 < error < 0.1, error  # E4M3 keeps 3 mantissa bits: a few percent per value


@pytest.mark.parametrize("fp16_dots", [True, pytest.param(False, marks=BF16_DOT)])
@pytest.mark.parametrize("phase, seq_lens, query_lens, splits", [
    ("decode", [1, 17, 32, 80, 45], [1] * 5, 3),
    ("mixed", [9, 40, 33], [1, 40, 7], None),
])
def test_bf16_queries_over_an_fp8_cache(phase, seq_lens, query_lens, splits, fp16_dots,
                                        monkeypatch):
    """bf16 queries: the dots in fp16 (FP8_KV_FP16_DOTS, the default) or in bf16 both give
    the fp32 attention over the dequantized cache to half precision, and a query beyond
    fp16's range (|q| 1e5, a bf16 value) still gives the softmax of its scores, no inf/NaN."""
    monkeypatch.setattr(triton_attention, "DECODE_BLOCK_N", 16)
    monkeypatch.setattr(triton_attention, "FP8_KV_FP16_DOTS", fp16_dots)
    batch, cache = fp8_batch(seq_lens, query_lens, num_heads=4, num_kv_heads=2,
                             dtype=torch.bfloat16)
    batch.query[0, 1] *= 1e5
    out = attend(batch, cache.to(DEVICE), splits).cpu()
    assert out.isfinite().all()
    dequantized = paged_attention(batch.query.cpu().float(), cache.cpu().float().nan_to_num(0.0),
                                  batch.meta.to("cpu"), batch.scale)
    torch.testing.assert_close(out.float(), dequantized, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind, want", [("auto", torch.bfloat16), ("fp8", FP8),
                                        ("fp8_e4m3", FP8)])
def test_resolve_kv_cache_dtype_on_cuda(kind, want):
    assert resolve_kv_cache_dtype(kind, [torch.device("cuda", 0)], torch.bfloat16) == want


def test_the_cpu_refuses_an_fp8_kv_cache():
    assert resolve_kv_cache_dtype("auto", [torch.device("cpu")], torch.float32) == torch.float32
    message = ("--kv-cache-dtype fp8 needs CUDA: the CPU kernels read the KV cache in the "
               "model's dtype; use --kv-cache-dtype auto")
    for devices in ([torch.device("cpu")], [torch.device("cuda", 0), torch.device("cpu")]):
        with pytest.raises(ValueError) as info:
            resolve_kv_cache_dtype("fp8", devices, torch.float32)
        assert str(info.value) == message


def test_llm_on_the_cpu_refuses_fp8_kv_cache_before_loading():
    from pagedllm import LLM

    with pytest.raises(ValueError, match=r"^--kv-cache-dtype fp8_e4m3 needs CUDA"):
        LLM(model="smollm2-135m", load_format="dummy", device="cpu", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be one of auto, fp8, fp8_e4m3, "
                       r"got 'int4'$"):
        LLM(model="smollm2-135m", load_format="dummy", device="cpu", kv_cache_dtype="int4")


def test_cache_engine_holds_fp8_blocks_and_swaps_and_copies_them():
    """An FP8 cache takes half a bf16 cache's bytes per block; swap and copy-on-write move
    its blocks as bytes, unchanged."""
    from pagedllm.config import ModelConfig
    from pagedllm.models.device_map import DeviceMap
    from pagedllm.worker.cache_engine import CacheEngine, bytes_per_block

    config = ModelConfig(architecture="llama", vocab_size=97, hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=128)
    assert bytes_per_block(config, 4, FP8, 2) * 2 == bytes_per_block(config, 4, torch.bfloat16, 2)
    engine = CacheEngine(config, 4, num_gpu_blocks=5, num_cpu_blocks=3, dtype=FP8,
                         device_map=DeviceMap.single(torch.device("cpu"), 2))
    for layer in engine.gpu_cache:
        layer.copy_(to_fp8(torch.randn(layer.shape) * 4))
    before = [c.clone() for c in engine.gpu_cache]
    engine.swap_out([(1, 0)])
    for c in engine.gpu_cache:
        c[:, 1] = to_fp8(torch.zeros(c[:, 1].shape))
    engine.swap_in([(0, 4)])
    engine.copy([(4, 2)])
    for layer, old in zip(engine.gpu_cache, before):
        assert layer.dtype == FP8
        assert torch.equal(layer[:, 4].float(), old[:, 1].float())
        assert torch.equal(layer[:, 2].float(), old[:, 1].float())


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors through Triton: the interpreter")
def test_model_forward_through_triton_over_an_fp8_cache():
    """A tiny Llama, every layer through the Triton backend (the CUDA path, interpreted): a
    prompt then two decode steps over an FP8 cache give logits close to the fp32 cache's,
    and the cache holds the prompt's keys in E4M3."""
    from pagedllm.kernels.metadata import PagedAttentionInputMetadata
    from pagedllm.layers import dispatch
    from tests.test_cuda_graphs_cpu import tiny_llama

    with dispatch.force("triton"):
        model, c = tiny_llama()
    block_size, num_blocks = 4, 6
    shape = (2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    table = [3, 0, 5]
    prompt = [5, 17, 42, 8, 91, 33, 2]
    logits = {}
    for dtype in (torch.float32, FP8):
        caches = [torch.zeros(shape, dtype=dtype) for _ in range(c.num_hidden_layers)]
        ids, start, out = prompt, 0, []
        with torch.inference_mode():
            for _ in range(3):
                positions = list(range(start, start + len(ids)))
                slots = [table[p // block_size] * block_size + p % block_size for p in positions]
                meta = PagedAttentionInputMetadata.build(positions, slots, [len(ids)],
                                                         [start + len(ids)], [table])
                hidden = model(torch.tensor(ids), caches, {torch.device("cpu"): meta})
                step = model.compute_logits(hidden[-1:]).float()
                out.append(step)
                start += len(ids)
                ids = [int(step.argmax())]
        logits[dtype] = torch.cat(out)
        assert caches[0].dtype == dtype and caches[0].float().abs().sum() > 0
    torch.testing.assert_close(logits[FP8], logits[torch.float32], atol=0.05, rtol=0.05)
    assert not torch.equal(logits[FP8], logits[torch.float32])  # the cache was read as FP8
