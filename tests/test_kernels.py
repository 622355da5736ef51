"""Triton kernels against the torch reference (pagedllm/kernels/reference.py).

On a machine without a GPU these run in Triton's interpreter (TRITON_INTERPRET=1, set here
when CUDA is absent), so shapes stay small. Every run writes into NaN-poisoned buffers and
reads a cache whose unused slots are NaN, so an unwritten output or a stray read shows up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.triton_setup import DEVICE, INTERPRETED, skip_unless_runnable

from pagedllm.kernels import triton_attention  # noqa: E402
from pagedllm.kernels.reference import alibi_slopes, paged_attention, write_kv_cache  # noqa: E402
from pagedllm.kernels.triton_attention import choose_num_splits, triton_paged_attention  # noqa: E402
from pagedllm.kernels.triton_cache import (  # noqa: E402
    triton_rotary_write_kv_cache,
    triton_write_kv_cache,
)
from pagedllm.kernels.triton_ops import (  # noqa: E402
    triton_rms_norm,
    triton_rotary_embedding,
    triton_silu_and_mul,
)
from pagedllm.kernels.metadata import PagedAttentionInputMetadata  # noqa: E402
from pagedllm.kernels.triton_counters import counters  # noqa: E402
from pagedllm.kernels.triton_gemv import RmsInput, RopeCache, folded_matmul, skinny_matmul  # noqa: E402
from pagedllm.kernels.triton_sampling import row_argmax_logsumexp  # noqa: E402

skip_unless_runnable(triton_attention._paged_decode_kernel)
# The interpreter cannot run tl.dot on bfloat16 (it multiplies the raw uint16 bit patterns:
# triton-lang/triton#11584), and it truncates fp32 -> bf16 casts where the GPU rounds to
# nearest even. bf16 attention is checked on the GPU by tests/gpu/test_kernel_checks.py.
BF16_DOT = pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter cannot run tl.dot on bfloat16")
NAN = float("nan")


# --------------------------------------------------------------------------------------
# A batch of sequences whose context sits in shuffled, non-contiguous cache blocks
# --------------------------------------------------------------------------------------


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor  # unused slots hold NaN
    meta: PagedAttentionInputMetadata

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int = 16,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few spare blocks no sequence owns
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]

    def slot(table: list[int], pos: int) -> int:
        return table[pos // block_size] * block_size + pos % block_size

    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), NAN, dtype=dtype)
    slots = torch.tensor([slot(t, p) for t, s in zip(tables, seq_lens) for p in range(s)])
    keys = torch.randn(len(slots), num_kv_heads, head_dim, generator=g)
    values = torch.randn(len(slots), num_kv_heads, head_dim, generator=g)
    write_kv_cache(keys, values, kv_cache, slots)

    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    positions = [p for s, q in zip(seq_lens, query_lens) for p in range(s - q, s)]
    slot_mapping = [slot(t, p) for t, s, q in zip(tables, seq_lens, query_lens) for p in range(s - q, s)]
    meta = PagedAttentionInputMetadata.build(positions, slot_mapping, query_lens, seq_lens, tables)
    return Batch(query.to(DEVICE), kv_cache.to(DEVICE), meta.to(DEVICE))


@pytest.fixture(autouse=True)
def poison_split_buffers(monkeypatch):
    """Decode's per-split partials start as NaN, so a split that skips its write is caught."""
    real = triton_attention._partial_buffers

    def poisoned(*args):
        return tuple(t.fill_(NAN) for t in real(*args))

    monkeypatch.setattr(triton_attention, "_partial_buffers", poisoned)


def run_and_compare(batch: Batch, *, atol=1e-5, rtol=1e-4, num_splits=None, **kwargs) -> None:
    # The reference reads every padded slot, so it gets the cache with the poison zeroed;
    # its bf16/fp16 path also rounds the ALiBi bias, so it always runs in fp32.
    ref = paged_attention(
        batch.query.float(), batch.kv_cache.nan_to_num(0.0).float(), batch.meta, batch.scale, **kwargs
    )
    out = torch.full_like(batch.query, NAN)
    result = triton_paged_attention(
        batch.query, batch.kv_cache, batch.meta, batch.scale, num_splits=num_splits, out=out, **kwargs
    )
    assert result is out
    assert not out.isnan().any(), "some output elements were never written"
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


HEADS = pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])


# --------------------------------------------------------------------------------------
# reshape_and_cache
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference_and_skips_padding(block_size, cache_dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, kv_heads, head_dim = 5, 2, 32
    num_slots = num_blocks * block_size
    slot_list = torch.randperm(num_slots, generator=g)[:12].tolist()
    slot_list[3] = slot_list[7] = -1  # padding tokens
    slots = torch.tensor(slot_list).to(DEVICE)
    # K and V as views into a fused qkv projection output (non-contiguous rows), in the
    # cache dtype as the model produces them. (A cast on the way would differ by an ulp under
    # the interpreter, which truncates fp32 -> bf16 where the GPU rounds to nearest even.)
    qkv = torch.randn(12, 3, kv_heads, head_dim, generator=g).to(cache_dtype).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    start = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(cache_dtype).to(DEVICE)

    expected, cache = start.clone(), start.clone()
    write_kv_cache(key, value, expected, slots)
    triton_write_kv_cache(key, value, cache, slots)

    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
    written = (cache != start).flatten(3).any(-1).any(0).flatten()  # per flat slot
    assert set(written.nonzero().flatten().tolist()) == {s for s in slot_list if s >= 0}


def test_write_kv_cache_rejects_mismatched_shapes():
    cache = torch.zeros(2, 4, 16, 2, 32, device=DEVICE)
    key = torch.zeros(3, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"key and value must have shape \(3, 2, 32\)"):
        triton_write_kv_cache(key, key, cache, torch.zeros(3, dtype=torch.long, device=DEVICE))


# --------------------------------------------------------------------------------------
# Decode (split-KV)
# --------------------------------------------------------------------------------------

# Contexts of 1 token, a partial last block, exactly full blocks, and many blocks.
DECODE_SEQ_LENS = [1, 17, 32, 80, 45]


@pytest.mark.parametrize("block_size", [16, 32])
@HEADS
def test_decode(block_size, num_heads, num_kv_heads, monkeypatch):
    monkeypatch.setattr(triton_attention, "DECODE_BLOCK_N", 16)  # several tiles per split
    monkeypatch.setattr(triton_attention, "DECODE_ORDER", block_size == 32)
    batch = make_batch(
        DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS),
        block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
    )
    run_and_compare(batch, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 2, 8])  # 8 leaves some splits without keys
@pytest.mark.parametrize("block_n", [16, 64])  # a key tile spans 1 or 4 cache blocks
@pytest.mark.parametrize("prefetch", [False, True])  # PAGEDLLM_DECODE_PREFETCH
def test_decode_splits(num_splits, block_n, prefetch, monkeypatch):
    monkeypatch.setattr(triton_attention, "DECODE_BLOCK_N", block_n)
    monkeypatch.setattr(triton_attention, "DECODE_PREFETCH", prefetch)
    monkeypatch.setattr(triton_attention, "DECODE_ORDER", prefetch)  # longest first too
    batch = make_batch(DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), num_heads=4, num_kv_heads=2)
    run_and_compare(batch, num_splits=num_splits)


@pytest.mark.parametrize("num_splits,block_n", [(1, 64), (4, 16)])
@pytest.mark.parametrize("variant", ["sliding_window", "alibi", "both"])
def test_decode_sliding_window_and_alibi(num_splits, block_n, variant, monkeypatch):
    monkeypatch.setattr(triton_attention, "DECODE_BLOCK_N", block_n)
    monkeypatch.setattr(triton_attention, "DECODE_PREFETCH", num_splits == 4)
    batch = make_batch(DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), num_heads=4, num_kv_heads=2)
    kwargs = {}
    if variant in ("sliding_window", "both"):
        kwargs["sliding_window"] = 20  # shorter than most contexts: skips whole tiles
    if variant in ("alibi", "both"):
        kwargs["alibi"] = alibi_slopes(4).to(DEVICE)
    run_and_compare(batch, num_splits=num_splits, **kwargs)


def test_decode_tiles_fit_shared_memory():
    """Keys per decode step: the default where K and V tiles of every stage fit, halved
    where they would not (wider heads, wider elements)."""
    block_n = triton_attention.decode_block_n
    assert block_n(128, 2) == triton_attention.DECODE_BLOCK_N == 128
    assert block_n(128, 1) == block_n(64, 4) == 128
    assert block_n(128, 4) == block_n(256, 2) == 64 and block_n(256, 4) == 32
    stages = triton_attention.decode_num_stages
    assert (stages(1), stages(2), stages(4)) == (3, 2, 2)
    assert all(2 * stages(e) * block_n(d, e) * d * e <= triton_attention.DECODE_TILE_BYTES
               for d in (16, 64, 128, 256) for e in (1, 2, 4))


@pytest.mark.parametrize("sliding_window", [None, 8], ids=["full", "window"])
def test_decode_last_split_merges_and_resets_the_counters(sliding_window, monkeypatch):
    """The last split program of a (sequence, KV head) to finish merges the splits. With
    4 splits of 16-key tiles, the contexts have 1, 2 or 3 splits with keys (the window of 8
    leaves 40 keys one tile); a sequence of one split writes directly and never counts, the
    splits without keys return uncounted. So every counter is back at zero after a call,
    and a second call (as a CUDA graph replays) gives the same output."""
    monkeypatch.setattr(triton_attention, "DECODE_BLOCK_N", 16)
    batch = make_batch([1, 17, 40, 80, 45], [1] * 5, num_heads=8, num_kv_heads=2)
    run_and_compare(batch, num_splits=4, sliding_window=sliding_window)
    count = counters("paged_decode", torch.device(DEVICE), 1)
    assert not count.any()

    def call():
        return triton_paged_attention(batch.query, batch.kv_cache, batch.meta, batch.scale,
                                      sliding_window=sliding_window, num_splits=4)

    assert torch.equal(call(), call())
    assert not count.any()


def test_decode_default_splits_long_context():
    batch = make_batch([300, 7], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=32)
    assert choose_num_splits(batch.meta.max_seq_len, 2, 2, batch.query.device) > 1
    run_and_compare(batch)


def test_choose_num_splits():
    cpu = torch.device("cpu")
    assert choose_num_splits(100, 1, 8, cpu) == 1  # short context: nothing to split
    assert choose_num_splits(8192, 1, 8, cpu) > 1  # one long sequence: spread it out
    assert choose_num_splits(1 << 20, 1, 1, cpu) == triton_attention.MAX_SPLITS
    assert choose_num_splits(8192, 256, 8, cpu) == 1  # a big batch fills the GPU already


# A batch that fills the (interpreter's 8-SM) GPU twice over: 8 sequences x 2 KV heads.
BALANCE_SEQ_LENS = [1, 17, 32, 80, 45, 200, 5, 130]


@pytest.fixture
def balance(monkeypatch):
    """Policy "balance" with slices of at least 32 keys (two 16-key tiles)."""
    monkeypatch.setattr(triton_attention, "DECODE_SPLIT", "balance")
    monkeypatch.setattr(triton_attention, "BALANCE_SPLIT_TOKENS", 32)
    monkeypatch.setattr(triton_attention, "DECODE_BLOCK_N", 16)


@pytest.mark.parametrize("num_heads", [2, 4, 8, 16], ids=["group1", "group2", "group4", "group8"])
def test_decode_balance_cuts_long_contexts_only(num_heads, balance):
    cpu = torch.device("cpu")
    assert triton_attention.min_split_tiles(8, 2, cpu, 16) == 2
    assert choose_num_splits(200, 8, 2, cpu) == 7  # 200 keys / 32 per slice
    batch = make_batch(BALANCE_SEQ_LENS, [1] * 8, num_heads=num_heads, num_kv_heads=2)
    run_and_compare(batch)


def test_decode_balance_with_the_split_count_of_a_cuda_graph(balance):
    """A graph fixes the split count from max_model_len: most splits then hold no keys."""
    batch = make_batch(BALANCE_SEQ_LENS, [1] * 8, num_heads=4, num_kv_heads=2)
    run_and_compare(batch, num_splits=16)


@pytest.mark.parametrize("variant", ["sliding_window", "alibi"])
def test_decode_balance_sliding_window_and_alibi(variant, balance):
    batch = make_batch(BALANCE_SEQ_LENS, [1] * 8, num_heads=4, num_kv_heads=2)
    kwargs = {"sliding_window": 40} if variant == "sliding_window" else {"alibi": alibi_slopes(4).to(DEVICE)}
    run_and_compare(batch, **kwargs)


def test_decode_balance_leaves_small_batches_to_fill(balance):
    cpu = torch.device("cpu")
    assert triton_attention.min_split_tiles(1, 2, cpu, 16) == 1
    # One sequence x 8 KV heads on 8 SMs: two splits fill the GPU twice over, as under "fill".
    assert choose_num_splits(8192, 1, 8, cpu) == 2
    batch = make_batch([200, 3], [1, 1], num_heads=4, num_kv_heads=2)
    run_and_compare(batch, num_splits=5)


# --------------------------------------------------------------------------------------
# Prefill, chunked prefill, mixed batches
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@HEADS
def test_prefill(block_size, num_heads, num_kv_heads, monkeypatch):
    monkeypatch.setattr(triton_attention, "PREFILL_BLOCK_M", 16)
    monkeypatch.setattr(triton_attention, "PREFILL_BLOCK_N", 16)
    seq_lens = [37, 80, 5]
    batch = make_batch(seq_lens, seq_lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    run_and_compare(batch)


def test_prefill_default_tiles():
    seq_lens = [37, 80, 5]
    batch = make_batch(seq_lens, seq_lens, block_size=32, num_heads=8, num_kv_heads=2)
    run_and_compare(batch)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("prefetch", [False, True])  # PAGEDLLM_PREFILL_PREFETCH
def test_chunked_prefill_with_cached_context(block_size, prefetch, monkeypatch):
    monkeypatch.setattr(triton_attention, "PREFILL_BLOCK_M", 16)
    monkeypatch.setattr(triton_attention, "PREFILL_BLOCK_N", 16)
    monkeypatch.setattr(triton_attention, "PREFILL_PREFETCH", prefetch)
    # Cached context of 60, 43 and 16 tokens (an earlier chunk or a prefix-cache hit).
    batch = make_batch([80, 50, 33], [20, 7, 17], block_size=block_size)
    run_and_compare(batch)


@pytest.mark.parametrize("variant", ["plain", "sliding_window", "alibi", "both"])
@pytest.mark.parametrize("tiles", [(16, 16), (64, 64)], ids=["small-tiles", "default-tiles"])
def test_mixed_decode_and_prefill_batch(variant, tiles, monkeypatch):
    monkeypatch.setattr(triton_attention, "PREFILL_BLOCK_M", tiles[0])
    monkeypatch.setattr(triton_attention, "PREFILL_BLOCK_N", tiles[1])
    monkeypatch.setattr(triton_attention, "PREFILL_PREFETCH", tiles == (16, 16))
    # Decoding, a fresh prompt, a decode at the first block, a chunk after cached context.
    batch = make_batch([70, 30, 9, 75], [1, 30, 1, 12], num_heads=8, num_kv_heads=2)
    kwargs = {}
    if variant in ("sliding_window", "both"):
        kwargs["sliding_window"] = 21
    if variant in ("alibi", "both"):
        kwargs["alibi"] = alibi_slopes(8).to(DEVICE)
    run_and_compare(batch, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_DOT)])
@pytest.mark.parametrize("phase, num_splits", [("decode", 1), ("decode", 2), ("prefill", None)])
def test_half_precision(dtype, phase, num_splits):
    """One split too: the decode kernel's split counters must compile whatever the output's
    dtype (a bf16 placeholder for them once failed every one-split bf16 launch on CUDA)."""
    seq_lens = [40, 75]
    query_lens = [1, 1] if phase == "decode" else [40, 11]
    batch = make_batch(seq_lens, query_lens, dtype=dtype, head_dim=64)
    run_and_compare(batch, atol=2e-2, rtol=2e-2, num_splits=num_splits,
                    alibi=alibi_slopes(4).to(DEVICE))


def test_sequence_without_query_tokens():
    # max_query_len is 1 but a sequence has no token: decode's token == sequence shortcut
    # does not hold, so this must still come out right.
    batch = make_batch([30, 12, 50], [1, 0, 1])
    run_and_compare(batch)


def test_empty_batch():
    batch = make_batch([5], [1])
    meta = PagedAttentionInputMetadata.build([], [], [], [], [], device=DEVICE)
    out = triton_paged_attention(batch.query[:0], batch.kv_cache, meta, batch.scale)
    assert out.shape == (0, 4, 32)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(head_dim=24), "head_dim must be a power of two >= 16 for the Triton kernels, got 24"),
        (dict(num_heads=3, num_kv_heads=2), "num_heads 3 is not a multiple of num_kv_heads 2"),
    ],
)
def test_rejects_unsupported_shapes(change, message):
    batch = make_batch([20], [1], **change)
    with pytest.raises(ValueError, match=message):
        triton_paged_attention(batch.query, batch.kv_cache, batch.meta, batch.scale)


def test_rejects_query_not_matching_metadata():
    batch = make_batch([20, 10], [1, 1])
    with pytest.raises(ValueError, match="query has 1 tokens but the metadata's query lengths sum to 2"):
        triton_paged_attention(batch.query[:1], batch.kv_cache, batch.meta, batch.scale)


# --------------------------------------------------------------------------------------
# RMSNorm, SiLU-and-mul, rotary
# --------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# One rounding to bf16 (the interpreter truncates, the GPU rounds to nearest even).
ONE_ROUNDING = {torch.float32: dict(atol=0, rtol=0), torch.bfloat16: dict(atol=0, rtol=2**-7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: not a power of two
def test_rms_norm(dtype, hidden):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, hidden, generator=g).to(dtype).to(DEVICE)
    weight = torch.randn(hidden, generator=g).to(dtype).to(DEVICE)
    out = triton_rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 64, generator=g).to(dtype).to(DEVICE)
    residual = torch.randn(7, 64, generator=g).to(dtype).to(DEVICE)
    weight = torch.randn(64, generator=g).to(dtype).to(DEVICE)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = triton_rms_norm(x, weight, 1e-5, residual=residual)
    torch.testing.assert_close(new_residual, x + residual, **ONE_ROUNDING[dtype])
    torch.testing.assert_close(out, rms_norm_ref(x + residual, weight, 1e-5), **TOLERANCE[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_rejects_wrong_weight():
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\), got \(32,\)"):
        triton_rms_norm(torch.zeros(2, 64, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [48, 1500])  # 1500: more than one column tile, with a ragged end
def test_silu_and_mul(dtype, d):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 2 * d, generator=g).to(dtype).to(DEVICE)
    out = triton_silu_and_mul(x)
    expected = torch.nn.functional.silu(x[..., :d]) * x[..., d:]
    assert out.shape == (2, 3, d)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match=r"silu_and_mul needs an even last dimension, got shape \(2, 5\)"):
        triton_silu_and_mul(torch.zeros(2, 5, device=DEVICE))


def rope_neox_ref(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[positions, :half][:, None].float()
    sin = cos_sin[positions, half:][:, None].float()
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., 2 * half :]], -1).to(x.dtype)


def cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], -1)


@pytest.mark.parametrize("rotary_dim", [32, 16])  # full and partial rotary
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_neox(rotary_dim, dtype):
    g = torch.Generator().manual_seed(5)
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 2, 32
    positions = torch.tensor([0, 1, 2, 57, 3, 99]).to(DEVICE)
    cache = cos_sin_cache(128, rotary_dim).to(DEVICE)
    # q and k as views into one fused qkv output, as the attention layer produces them.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    expected_q, expected_k = rope_neox_ref(positions, query, cache), rope_neox_ref(positions, key, cache)
    value_before = qkv[:, num_heads + num_kv_heads :].clone()

    triton_rotary_embedding(positions, query, key, cache)

    torch.testing.assert_close(query, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(key, expected_k, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], value_before)


def test_rotary_matches_transformers_llama():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    g = torch.Generator().manual_seed(6)
    positions = torch.tensor([3, 0, 41, 7])
    q = torch.randn(4, 2, 32, generator=g)
    k = torch.randn(4, 1, 32, generator=g)
    cache = cos_sin_cache(64, 32)
    # HF repeats the frequencies over both halves: cos/sin of shape [batch, seq, head_dim].
    cos = torch.cat([cache[positions, :16]] * 2, -1)[None]
    sin = torch.cat([cache[positions, 16:]] * 2, -1)[None]
    # HF works on [batch, heads, seq, head_dim].
    hf_q, hf_k = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_dev, k_dev = q.to(DEVICE), k.to(DEVICE)
    triton_rotary_embedding(positions.to(DEVICE), q_dev, k_dev, cache.to(DEVICE))
    torch.testing.assert_close(q_dev.cpu(), hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_dev.cpu(), hf_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# Skinny matmuls (decode linears) and the sampler's row reductions
# --------------------------------------------------------------------------------------


def _fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedllm.layers.fp8_linear import quantize_rows

    q, s = quantize_rows(torch.randn(n, k, generator=g))
    return q, s.view(-1)


# n not a multiple of BLOCK_N, k not a multiple of BLOCK_K; split 3: K in slices of
# 512, 512 and 188 (one row) or 256, 256, 188 (the tensor-core path), whose partial sums
# the last slice's program adds.
@pytest.mark.parametrize("m, n, k, split", [(1, 40, 200, None), (5, 40, 200, None),
                                            (16, 40, 200, None), (1, 130, 1212, 3),
                                            (16, 130, 700, 3), (1, 64, 2048, 4)])
@pytest.mark.parametrize("weight_type", ["fp16", "fp8"])
def test_skinny_matmul_matches_fp64(m, n, k, split, weight_type):
    g = torch.Generator().manual_seed(m + n)
    # fp16 activations: the interpreter's tl.dot cannot take bf16 (CUDA runs bf16: gpu_check)
    x = torch.randn(m, k, generator=g).to(torch.float16)
    if weight_type == "fp8":
        w, scale = _fp8_weight(n, k, g)
        dense = w.double() * scale.double()[:, None]
    else:
        w, scale = torch.randn(n, k, generator=g).to(torch.float16), None
        dense = w.double()
    ref = x.double() @ dense.T
    got = skinny_matmul(x.to(DEVICE), w.to(DEVICE), None if scale is None else scale.to(DEVICE),
                        split=split)
    assert got.dtype == torch.float16 and got.shape == (m, n)
    # fp32 accumulation, then one rounding to fp16 (11 significant bits)
    tol = ref.abs() * 2**-10 + 1e-5 * (x.double().abs() @ dense.abs().T)
    assert ((got.cpu().double() - ref).abs() <= tol).all()
    # the last program of each column block left its counter at zero for the next call
    assert not counters("skinny_matmul", torch.device(DEVICE), 1).any()
    again = skinny_matmul(x.to(DEVICE), w.to(DEVICE),
                          None if scale is None else scale.to(DEVICE), split=split)
    assert torch.equal(again, got)


# hidden not a multiple of BLOCK_N (masked columns must add nothing to the sums of h^2);
# split 3: the producer's blocks finish in the last slice's program, and the consumer
# (K = 1000) is split too, so its 1/rms is applied once, after the slices' sum.
@pytest.mark.parametrize("hidden, k, n, split", [(136, 200, 40, None), (1000, 1212, 130, 3)])
@pytest.mark.parametrize("weight_type", ["fp16", "fp8"])
def test_folded_norms_match_the_norm_between_two_gemvs(hidden, k, n, split, weight_type):
    """An o_proj-like GEMV adding the residual and writing the next norm's input, then a
    gate_up-like GEMV reading it == h = x . W1^T + r, then rms_norm(h) * g . W2^T."""
    g = torch.Generator().manual_seed(hidden + n)
    x = torch.randn(1, k, generator=g).to(torch.float16)
    r = torch.randn(1, hidden, generator=g).to(torch.float16)
    gamma = (1 + 0.5 * torch.randn(hidden, generator=g)).to(torch.float16)
    if weight_type == "fp8":
        (w1, s1), (w2, s2) = _fp8_weight(hidden, k, g), _fp8_weight(n, hidden, g)
        d1, d2 = w1.double() * s1.double()[:, None], w2.double() * s2.double()[:, None]
        s1, s2 = s1.to(DEVICE), s2.to(DEVICE)
    else:
        w1, w2 = (torch.randn(n_, k_, generator=g).to(torch.float16)
                  for n_, k_ in ((hidden, k), (n, hidden)))
        d1, d2, s1, s2 = w1.double(), w2.double(), None, None
    eps = 1e-5
    h, rms = folded_matmul(x.to(DEVICE), w1.to(DEVICE), s1, residual=r.to(DEVICE),
                           next_norm=(gamma.to(DEVICE), eps), split=split)
    h = h.cpu().double()
    want_h = x.double() @ d1.T + r.double()
    assert ((h - want_h).abs() <= want_h.abs() * 2**-10 + 1e-5 * (x.double().abs() @ d1.abs().T)).all()
    # the next norm's input is the stored (rounded) h: its sums of h^2 and h * g
    assert torch.allclose(rms.ss.cpu().double().sum(), (h * h).sum(), rtol=1e-5)
    assert torch.allclose(rms.x.cpu().double(), h * gamma.double(), rtol=2**-10, atol=1e-6)
    assert rms.eps == eps
    y, none = folded_matmul(rms, w2.to(DEVICE), s2, split=split)
    assert none is None and y.shape == (1, n)
    normed = h * torch.rsqrt((h * h).mean() + eps) * gamma.double()
    want = normed @ d2.T
    tol = want.abs() * 2**-9 + 2**-9 * (normed.abs() @ d2.abs().T)
    assert ((y.cpu().double() - want).abs() <= tol).all()
    assert not counters("skinny_matmul", torch.device(DEVICE), 1).any()
    # the residual alone: no next norm's input
    h2, none = folded_matmul(x.to(DEVICE), w1.to(DEVICE), s1, residual=r.to(DEVICE), split=split)
    assert none is None
    torch.testing.assert_close(h2.cpu().double(), h, rtol=2**-10, atol=1e-5)


@pytest.mark.parametrize("d, k, split", [(24, 200, None), (64, 1212, 3)])
@pytest.mark.parametrize("weight_type", ["fp16", "fp8"])
@pytest.mark.parametrize("normed", [False, True])
def test_gated_product_is_silu_of_gate_times_up(d, k, split, weight_type, normed):
    """A [gate | up] GEMV with the SiLU folded (and the input norm: normed) == silu(gate) * up
    of the plain product."""
    g = torch.Generator().manual_seed(d + k)
    h = torch.randn(1, k, generator=g).to(torch.float16)
    gamma = (1 + 0.5 * torch.randn(k, generator=g)).to(torch.float16)
    if weight_type == "fp8":
        w, scale = _fp8_weight(2 * d, k, g)
        dense, scale = w.double() * scale.double()[:, None], scale.to(DEVICE)
    else:
        w, scale = torch.randn(2 * d, k, generator=g).to(torch.float16), None
        dense = w.double()
    x = h.double()
    if normed:
        x = x * torch.rsqrt((x * x).mean() + 1e-6) * gamma.double()
        ss = (h.double() ** 2).reshape(4, -1).sum(1).float()  # as four column blocks left it
        arg = RmsInput((h * gamma).to(DEVICE), ss.to(DEVICE), 1e-6)
    else:
        arg = h.to(DEVICE)
    got, none = folded_matmul(arg, w.to(DEVICE), scale, gated=True, split=split)
    assert none is None and got.shape == (1, d)
    gate, up = (x @ dense.T).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    bound = (x.abs() @ dense.abs().T).chunk(2, dim=-1)
    tol = want.abs() * 2**-8 + 2**-9 * (bound[0] * up.abs() + bound[1] * gate.abs() + bound[1])
    assert ((got.cpu().double() - want).abs() <= tol).all()
    assert not counters("skinny_matmul", torch.device(DEVICE), 1).any()


@pytest.mark.parametrize("k, split, slot", [(96, None, 13), (1100, 3, 2), (96, None, -1)])
@pytest.mark.parametrize("weight_type, cache_type", [("fp16", "fp16"), ("fp8", "fp16"),
                                                     ("fp16", "fp8")])
def test_rope_fold_rotates_q_and_caches_k_and_v(k, split, slot, weight_type, cache_type):
    """A [q | k | v] GEMV (input norm and bias folded too) with the rotary embedding and the
    cache write folded in == the plain product + bias, then triton_cache's rotary-and-write
    kernel: the same q, the same cache (slot -1: nothing written)."""
    heads, kv_heads, head_dim, position = 4, 2, 32, 9
    n = (heads + 2 * kv_heads) * head_dim
    g = torch.Generator().manual_seed(k + (slot % 7))
    h = torch.randn(1, k, generator=g).to(torch.float16)
    gamma = (1 + 0.5 * torch.randn(k, generator=g)).to(torch.float16)
    bias = (0.1 * torch.randn(n, generator=g)).to(torch.float16).to(DEVICE)
    if weight_type == "fp8":
        w, scale = _fp8_weight(n, k, g)
        w, scale = w.to(DEVICE), scale.to(DEVICE)
    else:
        w, scale = torch.randn(n, k, generator=g).to(torch.float16).to(DEVICE), None
    angles = torch.arange(32).float()[:, None] * torch.rand(head_dim // 2, generator=g)[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(DEVICE)
    cache_dtype = torch.float8_e4m3fn if cache_type == "fp8" else torch.float16
    cache = torch.randn(2, 4, 4, kv_heads, head_dim, generator=g).to(cache_dtype).to(DEVICE)
    positions = torch.tensor([position], device=DEVICE)
    slots = torch.tensor([slot], device=DEVICE)
    normed = (h.float() * torch.rsqrt(h.float().pow(2).mean() + 1e-6)).to(torch.float16) * gamma
    ss = h.double().pow(2).reshape(2, -1).sum(1).float().to(DEVICE)

    want_cache = cache.clone()
    qkv = skinny_matmul(normed.to(DEVICE), w, scale) + bias
    q, kk, v = qkv.view(1, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    q, kk, v = q.contiguous(), kk.contiguous(), v.contiguous()
    triton_rotary_write_kv_cache(positions, q, kk, v, want_cache, slots, cos_sin)

    rope = RopeCache(heads, kv_heads, positions, slots, cos_sin, cache)
    got, none = folded_matmul(RmsInput((h * gamma).to(DEVICE), ss, 1e-6), w, scale, bias=bias,
                              rope=rope, split=split)
    assert none is None and got.shape == (1, heads * head_dim)
    # one rounding of the product here, two there (normed, then the product)
    torch.testing.assert_close(got.cpu().float(), q.reshape(1, -1).cpu().float(),
                               rtol=2e-2, atol=2e-2 * q.abs().max().item())
    changed = (cache.float() != want_cache.float()).any(dim=(0, 3, 4)).cpu()
    assert changed.sum() == (0 if slot < 0 else 1)  # only the slot written (fp8: mostly)
    torch.testing.assert_close(cache.cpu().float(), want_cache.cpu().float(),
                               rtol=0.13 if cache_type == "fp8" else 2e-2,
                               atol=2e-2 * want_cache.float().abs().max().item())
    assert not counters("skinny_matmul", torch.device(DEVICE), 1).any()


def test_folded_matmul_rejects_what_it_cannot_take():
    x = torch.zeros(2, 64, dtype=torch.float16, device=DEVICE)
    w = torch.zeros(8, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="folded_matmul's folds take one row, got 2"):
        folded_matmul(x, w, residual=torch.zeros(2, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match=r"the residual must have shape \(1, 8\), got \(1, 4\)"):
        folded_matmul(x[:1], w, residual=torch.zeros(1, 4, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match=r"the next norm's weight must have shape \(8,\)"):
        folded_matmul(x[:1], w, next_norm=(torch.ones(64, device=DEVICE), 1e-6))
    with pytest.raises(ValueError, match="a gated product .* a multiple of 16, got 8"):
        folded_matmul(x[:1], w, gated=True)
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=torch.float16, device=DEVICE)
    one = torch.zeros(1, dtype=torch.long, device=DEVICE)
    rope = RopeCache(1, 1, one, one, torch.zeros(8, 16, device=DEVICE), cache)
    with pytest.raises(ValueError, match="a \\[q \\| k \\| v\\] weight of 48 rows .* got 8 rows"):
        folded_matmul(x[:1], w, rope=rope)


def test_skinny_matmul_rejects_what_it_cannot_take():
    x = torch.zeros(17, 64, dtype=torch.float16, device=DEVICE)
    w = torch.zeros(8, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="skinny_matmul takes at most 16 rows, got 17"):
        skinny_matmul(x, w)
    with pytest.raises(ValueError, match="does not match x's torch.float16"):
        skinny_matmul(x[:2], w.float())
    with pytest.raises(ValueError, match="an FP8 weight takes per-feature scales"):
        skinny_matmul(x[:2], w, torch.ones(8, device=DEVICE))


@pytest.mark.parametrize("rows, vocab, block", [(1, 1000, 4096), (3, 10000, 1024),
                                                (4, 4096, 512)])
def test_row_argmax_logsumexp(rows, vocab, block):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, vocab, generator=g) * 4
    x[0, 7] = x[0, vocab - 3] = 30.0  # a tie across chunks: the first index wins
    if rows > 1:
        x[1, vocab // 2:] = float("-inf")  # whole chunks of -inf
        x[2, 5] = float("-inf")
    idx, lse = row_argmax_logsumexp(x.to(DEVICE), block)
    assert torch.equal(idx.cpu(), x.max(dim=-1).indices)
    torch.testing.assert_close(lse.cpu(), x.logsumexp(dim=-1, keepdim=True), rtol=1e-6, atol=1e-5)
    assert not counters("row_stats", torch.device(DEVICE), 1).any()


@pytest.mark.parametrize("rotary_dim", [32, 16])  # full and partial rotary
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_cache_is_rotary_then_write(rotary_dim, dtype):
    """The fused kernel gives what the two kernels give one after the other: q and k rotated
    in place, and the rotated k (with v) in the cache, padding slots untouched."""
    g = torch.Generator().manual_seed(9)
    num_tokens, num_heads, kv_heads, head_dim, block_size, num_blocks = 6, 4, 2, 32, 16, 3
    positions = torch.tensor([0, 5, 17, 3, 40, 8]).to(DEVICE)
    slots = torch.tensor([4, -1, 20, 33, 0, 47]).to(DEVICE)
    cache_table = cos_sin_cache(64, rotary_dim).to(DEVICE)
    qkv = torch.randn(num_tokens, num_heads + 2 * kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    start = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)

    def views(t):
        return t[:, :num_heads], t[:, num_heads:num_heads + kv_heads], t[:, num_heads + kv_heads:]

    want_qkv, want_cache = qkv.clone(), start.clone()
    q, k, v = views(want_qkv)
    triton_rotary_embedding(positions, q, k, cache_table)
    triton_write_kv_cache(k, v, want_cache, slots)
    got_qkv, got_cache = qkv.clone(), start.clone()
    triton_rotary_write_kv_cache(positions, *views(got_qkv), got_cache, slots, cache_table)
    assert torch.equal(got_qkv, want_qkv)
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(got_cache.flatten(1, 2)[:, 1], start.flatten(1, 2)[:, 1])  # untouched
    assert not torch.equal(got_qkv, qkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_cache_folds_the_qk_norms(dtype):
    """Qwen3's per-head q and k norms folded into the rotary and cache write: what the norm
    kernels and then the fused kernel give (to rounding: the fold sums a head's squares in
    two halves), the heads read and written in place inside the fused qkv output."""
    g = torch.Generator().manual_seed(10)
    num_tokens, num_heads, kv_heads, head_dim, block_size, num_blocks = 6, 4, 2, 32, 16, 3
    positions = torch.tensor([0, 5, 17, 3, 40, 8]).to(DEVICE)
    slots = torch.tensor([4, -1, 20, 33, 0, 47]).to(DEVICE)
    table = cos_sin_cache(64, head_dim).to(DEVICE)
    qkv = (3 * torch.randn(num_tokens, num_heads + 2 * kv_heads, head_dim, generator=g)
           ).to(dtype).to(DEVICE)
    start = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    q_weight, k_weight = (torch.randn(head_dim, generator=g).to(dtype).to(DEVICE) for _ in "qk")

    def views(t):
        return t[:, :num_heads], t[:, num_heads:num_heads + kv_heads], t[:, num_heads + kv_heads:]

    q, k, v = views(qkv)
    want_q, want_k = triton_rms_norm(q, q_weight, 1e-6), triton_rms_norm(k, k_weight, 1e-6)
    want_cache = start.clone()
    triton_rotary_write_kv_cache(positions, want_q, want_k, v, want_cache, slots, table)
    got_qkv, got_cache = qkv.clone(), start.clone()
    triton_rotary_write_kv_cache(positions, *views(got_qkv), got_cache, slots, table,
                                 (q_weight, k_weight, 1e-6))
    got_q, got_k, got_v = views(got_qkv)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    torch.testing.assert_close(got_cache, want_cache, **tol)
    assert torch.equal(got_v, v)
    assert torch.equal(got_cache.flatten(1, 2)[:, 1], start.flatten(1, 2)[:, 1])  # untouched
    assert (got_q - q).abs().max() > 1  # normed: the inputs were scaled by 3
    with pytest.raises(ValueError, match="a folded q/k norm takes full rotary"):
        triton_rotary_write_kv_cache(positions, *views(qkv.clone()), start.clone(), slots,
                                     cos_sin_cache(64, 16).to(DEVICE), (q_weight, k_weight, 1e-6))


def test_sample_rows_draws_from_softmax_over_temperature():
    """Gumbel-max with Philox noise: 200 rows of the same logits (a seed each) hit every
    token near its softmax(x / T) frequency: 0.866 / 0.016 / 0 / 0.117 at T = 0.5, where
    no temperature gives 0.665 / 0.090 / 0 / 0.245, T = 2 0.506 / 0.186 / 0 / 0.307, and
    no noise 1 / 0 / 0 / 0. (The interpreter runs a program in ~25 ms, hence so few rows.)"""
    from pagedllm.kernels.triton_sampling import sample_rows

    x = torch.tensor([[2.0, 0.0, float("-inf"), 1.0]])
    n, temperature = 200, 0.5
    logits = x.expand(n, -1).contiguous().to(DEVICE)
    inv_temp = torch.full((n,), 1 / temperature).to(DEVICE)
    seeds = torch.arange(n, dtype=torch.long).mul(7919).add(11).to(DEVICE)
    tokens, argmax, lse = sample_rows(logits, inv_temp, seeds)
    freq = torch.bincount(tokens.cpu(), minlength=4).double() / n
    want = torch.softmax(x[0].double() / temperature, -1)
    # 4.5 standard deviations of a binomial frequency (a fixed seed set: not flaky)
    assert ((freq - want).abs() <= 4.5 * (want * (1 - want) / n).sqrt() + 1e-9).all(), (freq, want)
    assert freq[2] == 0  # a -inf logit is never drawn
    assert torch.equal(argmax.cpu(), torch.zeros(n, dtype=torch.long))
    torch.testing.assert_close(lse.cpu(), logits.cpu().logsumexp(-1, keepdim=True))
    # a row's draw depends on its seed alone: the same seeds in another batch, the same tokens
    again, _, _ = sample_rows(logits[:5].clone(), inv_temp[:5], seeds[:5])
    assert torch.equal(again, tokens[:5])


def test_sample_rows_over_chunks_and_greedy_rows():
    """The noise is keyed by (seed, token index): cutting rows into chunks changes nothing,
    so the chunk merge must give the one-chunk draw; greedy rows (1/T = 0) take the argmax."""
    from pagedllm.kernels.triton_sampling import sample_rows

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1000, generator=g).to(DEVICE)
    inv_temp = torch.tensor([0.0, 1.0, 0.0, 0.5]).to(DEVICE)
    seeds = torch.tensor([1, 2, 3, 4]).to(DEVICE)
    whole, argmax, lse = sample_rows(x, inv_temp, seeds, block=1024)
    chunked, argmax_chunked, lse_chunked = sample_rows(x, inv_temp, seeds, block=128)
    assert torch.equal(chunked, whole)
    assert torch.equal(argmax_chunked, argmax)
    assert torch.equal(argmax.cpu(), x.cpu().max(-1).indices)
    assert whole[0] == argmax[0] and whole[2] == argmax[2]
    assert whole[1] != argmax[1] and whole[3] != argmax[3]  # T = 1 and 2: far from greedy
    torch.testing.assert_close(lse_chunked, lse)
    assert not counters("row_stats", torch.device(DEVICE), 1).any()


def test_sampler_triton_path_rows():
    """layers/sampler's CUDA path (run here on CPU tensors): greedy and plain-temperature rows
    come from the kernel, a seeded row's token from its seed alone, the logsumexp from the
    raw logits even when penalties changed the logits the token is chosen from; a top-p row
    is drawn there too by default (rejection), and sends the tokens back to torch's path
    with PAGEDLLM_SAMPLER=sort."""
    from pagedllm.layers.sampler import SamplingRow, _sample_with_triton, make_generator
    from pagedllm.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 300, generator=g).to(DEVICE)

    def rows(**random):
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5, **random),
                  SamplingParams(temperature=1.2, seed=6)]
        return [SamplingRow(p, [1], [], generator=make_generator(p.seed, DEVICE) if p.seed else None)
                for p in params]

    tokens, lse = _sample_with_triton(logits, logits, rows())
    assert tokens[0] == logits[0].argmax()
    torch.testing.assert_close(lse.cpu(), logits.cpu().logsumexp(-1, keepdim=True))
    again, _ = _sample_with_triton(logits, logits, rows())
    assert torch.equal(again, tokens)  # the same seeds, the same draws
    x = logits.clone()
    x[0, tokens[0]] -= 100.0  # as a penalty would
    moved, lse_raw = _sample_with_triton(logits, x, rows())
    assert moved[0] != tokens[0] and moved[0] == x[0].argmax()
    torch.testing.assert_close(lse_raw, lse)
    drawn, _ = _sample_with_triton(logits, logits, rows(top_p=0.9))
    assert drawn is not None and drawn[0] == tokens[0]
    fallback, lse_fallback = _sample_with_triton(logits, logits, rows(top_p=0.9), kind="sort")
    assert fallback is None
    torch.testing.assert_close(lse_fallback, lse)


def test_sampler_min_tokens_in_place_matches_the_copying_path():
    """Sampler.sample on the device (on CUDA its Triton path): rows under min_tokens alone
    (refused in place, the logsumexp corrected after) give the same tokens, logprobs, ranks
    and top logprobs as the same rows with a zero logit_bias (the path that copies the
    logits), and leave the logits as they were."""
    from pagedllm.layers.sampler import Sampler, SamplingRow, make_generator
    from pagedllm.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 3000, generator=g) * 3).to(DEVICE)
    logits[:, 0] += 20.0  # EOS (0) the most likely in every row

    def rows(bias=None):
        params = [SamplingParams(temperature=0.0, min_tokens=2, logprobs=3, logit_bias=bias),
                  SamplingParams(temperature=0.9, seed=5, min_tokens=2, stop_token_ids=[9],
                                 logprobs=2),
                  SamplingParams(temperature=0.0, logprobs=1),
                  SamplingParams(temperature=1.1, seed=6, min_tokens=1)]
        return [SamplingRow(p, [1], [], generator=make_generator(p.seed, DEVICE) if p.seed else None)
                for p in params]

    before = logits.clone()
    in_place = Sampler([0]).sample(logits, rows()).packed.cpu()
    assert torch.equal(logits, before)
    copied = Sampler([0]).sample(logits, rows({2999: 0.0})).packed.cpu()
    assert torch.equal(in_place[:, 0], copied[:, 0])  # tokens
    assert in_place[0, 0] != 0 and in_place[2, 0] == 0
    # The logprobs are fp32 sums carried in the float64 pack: the two paths add the row's
    # terms in different orders (the in-place one corrects the logsumexp of the refused
    # row afterwards), so they agree to fp32's tolerance, not float64's.
    fp32 = {"rtol": 1.3e-6, "atol": 1e-5}
    torch.testing.assert_close(in_place[:, 1], copied[:, 1], **fp32)  # logprobs, raw logits
    assert torch.equal(in_place[:, 2:6], copied[:, 2:6])  # ranks, top ids
    torch.testing.assert_close(in_place[:, 6:], copied[:, 6:], **fp32)  # top logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_heads_inside_a_fused_projection(dtype):
    """Qwen3's per-head q/k norms read the heads in place in the fused qkv output (a strided
    [tokens, heads, head_dim] view): the same as on a contiguous copy."""
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(5, 6 * 32, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, 32:160].reshape(5, 4, 32)  # not viewable as rows: the kernel takes its strides
    weight = torch.randn(32, generator=g).to(dtype).to(DEVICE)
    got = triton_rms_norm(q, weight, 1e-6)
    want = triton_rms_norm(q.contiguous(), weight, 1e-6)
    assert got.shape == (5, 4, 32) and got.is_contiguous()
    assert torch.equal(got, want)
    torch.testing.assert_close(got.float().cpu(), rms_norm_ref(q.cpu(), weight.cpu(), 1e-6).float(),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("vocab, words", [(97, 4), (200, 4), (64, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_bitmask_kernel_matches_the_torch_path(vocab, words, dtype):
    """The Triton bitmask (one pass) against layers/token_bitmask's unpack-pad-fill path on
    the host: random masks on some rows; ids past the mask (vocab > 32 * words) refused,
    words past the vocabulary ignored, other rows untouched. A mask read with its bit order
    reversed fails it (checked by mutating the kernel)."""
    from pagedllm.kernels.triton_bitmask import apply_token_bitmask_
    from pagedllm.layers.token_bitmask import apply_token_bitmask

    gen = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    rows = [3, 0, 4]
    mask = torch.randint(-(1 << 31), 1 << 31, (len(rows), words), generator=gen,
                         dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    apply_token_bitmask(want, mask, rows)
    got = logits.to(DEVICE)
    apply_token_bitmask_(got, mask.to(DEVICE), torch.tensor(rows, device=DEVICE))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got.cpu()[[1, 2]], logits[[1, 2]])
    refused = torch.isinf(want[rows]).sum()
    assert 0 < refused < len(rows) * vocab


def test_token_bitmask_kernel_rejects_what_it_cannot_take():
    from pagedllm.kernels.triton_bitmask import apply_token_bitmask_

    logits = torch.zeros(2, 64, device=DEVICE)
    rows = torch.tensor([1], device=DEVICE)
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[len\(rows\)=1, words\]"):
        apply_token_bitmask_(logits, torch.zeros(1, 2, dtype=torch.int64, device=DEVICE), rows)
    with pytest.raises(ValueError, match="logits must be \\[rows, vocab\\] with contiguous rows"):
        apply_token_bitmask_(logits.t(), torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),
                             rows)


def test_pdl_is_off_off_cuda():
    """Programmatic dependent launch only on CUDA (the interpreter has no gdc ops)."""
    from pagedllm.kernels import triton_pdl

    assert triton_pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}
