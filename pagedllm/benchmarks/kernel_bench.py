"""Check the Triton kernels on CUDA at realistic sizes, then time them.

    pagedllm bench kernels            # checks + timings
    pagedllm bench kernels --tune     # also sweep launch configurations
    TRITON_INTERPRET=1 pagedllm bench kernels --smoke   # tiny, on CPU

tests/gpu/test_kernel_checks.py asserts the checks; this prints them and the timings.

Checks: bf16, head_dim 128, 32 query / 8 KV heads (Llama-3-8B shapes), block sizes 16 and 32,
contexts up to 8k in shuffled blocks with NaN in every unused slot, against the torch
reference run in fp32. Decode, prefill, chunked prefill, mixed batches, sliding window,
ALiBi, reshape_and_cache with padding slots, a decode replayed from a CUDA graph, and the
RMSNorm / SiLU-and-mul / rotary kernels.

Timings (triton.testing.do_bench): decode in GB/s of KV cache read (the bound that matters),
prefill in TFLOP/s; each next to SDPA on the same K/V laid out contiguously (no paging) as
a peer.
"""
from __future__ import annotations

import argparse
import itertools
import math
import time
from dataclasses import dataclass, field
from unittest.mock import patch

import torch
import triton
import triton.testing

from pagedllm.kernels import triton_attention
from pagedllm.kernels.reference import alibi_slopes, paged_attention, write_kv_cache
from pagedllm.kernels.triton_attention import choose_num_splits, triton_paged_attention
from pagedllm.kernels.triton_cache import triton_write_kv_cache
from pagedllm.kernels.triton_ops import (
    triton_rms_norm,
    triton_rotary_embedding,
    triton_silu_and_mul,
)
from pagedllm.entrypoints.usage import Parser
from pagedllm.kernels.metadata import PagedAttentionInputMetadata

H200_PEAK_GBPS = 4800.0
# bf16 on the GPU; --smoke uses fp16 (the interpreter cannot run tl.dot on bf16).
DTYPE = torch.bfloat16


@dataclass
class Shape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype | None = None  # None: DTYPE

    def __post_init__(self) -> None:
        self.dtype = self.dtype or DTYPE


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    meta: PagedAttentionInputMetadata
    seq_lens: list[int]
    query_lens: list[int]
    tables: list[list[int]] = field(repr=False)

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5


def build_batch(seq_lens: list[int], query_lens: list[int], shape: Shape, device: str, *,
                poison: bool = True, seed: int = 0) -> Batch:
    """Context in shuffled blocks; with `poison`, every slot no sequence owns holds NaN."""
    g = torch.Generator().manual_seed(seed)
    bs = shape.block_size
    blocks_per_seq = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1  # one spare block
    perm = torch.randperm(num_blocks, generator=g)
    tables = [t.tolist() for t in perm[: num_blocks - 1].split(blocks_per_seq)]
    kv_cache = torch.randn(
        2, num_blocks, bs, shape.num_kv_heads, shape.head_dim, device=device, dtype=shape.dtype
    )
    if poison:
        kv_cache[:, int(perm[-1])] = float("nan")
        for table, s in zip(tables, seq_lens):
            if s % bs:
                kv_cache[:, table[-1], s % bs :] = float("nan")
    query = torch.randn(sum(query_lens), shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype)
    positions, slots = [], []
    for table, s, q in zip(tables, seq_lens, query_lens):
        positions += range(s - q, s)
        slots += [table[p // bs] * bs + p % bs for p in range(s - q, s)]
    meta = PagedAttentionInputMetadata.build(positions, slots, query_lens, seq_lens, tables, device=device)
    return Batch(query, kv_cache, meta, list(seq_lens), list(query_lens), tables)


def reference(batch: Batch, **kwargs) -> torch.Tensor:
    """The oracle in fp32 (its bf16 path rounds the ALiBi bias to bf16)."""
    return paged_attention(
        batch.query.float(), batch.kv_cache.nan_to_num(0.0).float(), batch.meta, batch.scale, **kwargs
    )


# --------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------

RESULTS: list[tuple[str, bool]] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok))
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<52} {detail}")


def compare(name: str, out: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    out = out.float()
    nan = bool(out.isnan().any())
    err = (out - expected).abs()
    worst = float((err - rtol * expected.abs()).max()) if err.numel() else 0.0
    ok = not nan and worst <= atol
    report(name, ok, f"max|err| {float(err.max()) if err.numel() else 0.0:.2e}" + ("  NaN in output" if nan else ""))


def attention_cases(scale_down: int) -> list[tuple[str, list[int], list[int], dict, Shape]]:
    r = torch.Generator().manual_seed(1)

    def lens(n: int, hi: int) -> list[int]:
        return torch.randint(1, max(2, hi // scale_down), (n,), generator=r).tolist()

    def n(tokens: int) -> int:
        return max(1, tokens // scale_down)

    ctx64 = lens(64, 8192)
    mixed_ctx = lens(30, 8192)
    mha = Shape(num_heads=32, num_kv_heads=32)
    return [
        ("decode long + short", [n(8192), n(3001), 17, 1], [1] * 4, {}, Shape()),
        ("decode batch 64", ctx64, [1] * 64, {}, Shape()),
        ("decode sliding window 4096", [n(8192), n(5000), 100], [1] * 3, {"sliding_window": n(4096)}, Shape()),
        ("decode alibi (MHA)", [n(8192), n(777)], [1, 1], {"alibi": True}, mha),
        ("prefill", [n(2048), n(1000), 77], [n(2048), n(1000), 77], {}, Shape()),
        ("prefill 8k", [n(8192)], [n(8192)], {}, Shape()),
        ("chunked prefill on cached context", [n(8192), n(4096)], [n(2048), n(512)], {}, Shape()),
        ("mixed decode + prefill", mixed_ctx + [n(1024), n(3000)], [1] * 30 + [n(1024), n(300)], {}, Shape()),
        ("prefill sliding window 4096", [n(6000), n(300)], [n(6000), n(300)], {"sliding_window": n(4096)}, Shape()),
        ("prefill alibi (MHA)", [n(4096), n(1500)], [n(4096), n(700)], {"alibi": True}, mha),
    ]


def check_attention(device: str, scale_down: int, head_dim: int) -> None:
    print(f"paged attention vs reference (fp32 oracle), {DTYPE} inputs")
    for block_size in (16, 32):
        for name, seq_lens, query_lens, kwargs, shape in attention_cases(scale_down):
            shape.block_size, shape.head_dim = block_size, head_dim
            batch = build_batch(seq_lens, query_lens, shape, device)
            kw = dict(kwargs)
            if kw.get("alibi"):
                kw["alibi"] = alibi_slopes(shape.num_heads).to(device)
            expected = reference(batch, **kw)
            out = torch.full_like(batch.query, float("nan"))
            triton_paged_attention(batch.query, batch.kv_cache, batch.meta, batch.scale, out=out, **kw)
            compare(f"{name} [block {block_size}]", out, expected, atol=1.5e-2, rtol=2e-2)
            if min(query_lens) == max(query_lens) == 1:  # decode: every split count agrees
                for splits in (1, 7):
                    out.fill_(float("nan"))
                    triton_paged_attention(
                        batch.query, batch.kv_cache, batch.meta, batch.scale, out=out, num_splits=splits, **kw
                    )
                    compare(f"{name} [block {block_size}, {splits} splits]", out, expected, 1.5e-2, 2e-2)
            del batch, expected, out


def check_write_kv_cache(device: str, scale_down: int) -> None:
    print("reshape_and_cache vs reference")
    shape = Shape()
    n = 4096 // scale_down
    for block_size in (16, 32):
        cache = torch.randn(2, 2 * n // block_size, block_size, shape.num_kv_heads, shape.head_dim,
                            device=device, dtype=shape.dtype)
        slots = torch.randperm(cache.shape[1] * block_size, device=device)[:n]
        slots[::7] = -1
        kv = torch.randn(n, 2, shape.num_kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
        expected = cache.clone()
        write_kv_cache(kv[:, 0], kv[:, 1], expected, slots)
        triton_write_kv_cache(kv[:, 0], kv[:, 1], cache, slots)
        report(f"write {n} tokens, every 7th slot -1 [block {block_size}]", torch.equal(cache, expected), "exact")


def check_cuda_graph(device: str) -> None:
    """A decode captured in a CUDA graph: fails at capture if anything syncs with the host."""
    print("decode inside a CUDA graph")
    shape = Shape()
    batch = build_batch([4000, 100, 8000, 1], [1] * 4, shape, device)
    out = torch.empty_like(batch.query)

    def step():
        triton_paged_attention(batch.query, batch.kv_cache, batch.meta, batch.scale, num_splits=8, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    batch.query.copy_(torch.randn_like(batch.query))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    compare("graph replay with new queries", out, reference(batch), 1.5e-2, 2e-2)


def rms_norm_ref(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_ref(positions, x, cos_sin):
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[positions, :half][:, None], cos_sin[positions, half:][:, None]
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :].float()], -1)


def check_ops(device: str, scale_down: int) -> None:
    print(f"RMSNorm / SiLU-and-mul / rotary vs torch, {DTYPE}")
    t = 8192 // scale_down
    x = torch.randn(t, 4096, device=device, dtype=DTYPE)
    res = torch.randn_like(x)
    w = torch.randn(4096, device=device, dtype=DTYPE)
    compare("rms_norm", triton_rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5).float(), 2e-2, 2e-2)
    out, new_res = triton_rms_norm(x, w, 1e-5, residual=res)
    compare("fused add + rms_norm (residual)", new_res, (x + res).float(), 0.0, 0.0)
    compare("fused add + rms_norm (normed)", out, rms_norm_ref(x + res, w, 1e-5).float(), 2e-2, 2e-2)
    gu = torch.randn(t, 2 * 14336, device=device, dtype=DTYPE)
    expected = (torch.nn.functional.silu(gu[:, :14336]) * gu[:, 14336:]).float()
    compare("silu_and_mul", triton_silu_and_mul(gu), expected, 2e-2, 2e-2)
    inv = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, device=device, dtype=torch.float32) / 128)
    freqs = torch.outer(torch.arange(8192, device=device, dtype=torch.float32), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    positions = torch.randint(0, 8192, (t,), device=device)
    qkv = torch.randn(t, 48, 128, device=device, dtype=DTYPE)
    q, k = qkv[:, :32], qkv[:, 32:40]
    eq, ek = rope_ref(positions, q, cos_sin), rope_ref(positions, k, cos_sin)
    triton_rotary_embedding(positions, q, k, cos_sin)
    compare("rotary (query)", q, eq, 2e-2, 2e-2)
    compare("rotary (key)", k, ek, 2e-2, 2e-2)


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


def bench(fn) -> float:
    """Milliseconds per call (on CPU, --smoke: one timed call, only to run the code paths)."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=100)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def contiguous_kv(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V as [seqs, kv_heads, max_len, head_dim] (equal lengths only), for the SDPA peer."""
    from pagedllm.kernels.reference import gather_kv

    k, v = gather_kv(batch.kv_cache, batch.meta.block_tables, max(batch.seq_lens))
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def time_decode(device: str, batch_sizes=(1, 8, 32, 128), contexts=(1024, 4096, 8192), head_dim=128) -> None:
    shape = Shape(head_dim=head_dim)
    elt = torch.finfo(shape.dtype).bits // 8
    print(f"\ndecode: {shape.num_heads} q / {shape.num_kv_heads} kv heads, head_dim {shape.head_dim}, "
          f"block {shape.block_size}, {shape.dtype} (H200 HBM peak ~{H200_PEAK_GBPS:.0f} GB/s)")
    print(f"  {'batch':>5} {'ctx':>6} {'splits':>6} {'ms':>8} {'GB/s':>7} {'%peak':>6} "
          f"{'ms 1-split':>10} {'SDPA ms':>8} {'SDPA GB/s':>9}")
    for num_seqs in batch_sizes:
        for ctx in contexts:
            batch = build_batch([ctx] * num_seqs, [1] * num_seqs, shape, device, poison=False)
            out = torch.empty_like(batch.query)
            splits = choose_num_splits(ctx, num_seqs, shape.num_kv_heads, batch.query.device)
            ms = bench(lambda: triton_paged_attention(batch.query, batch.kv_cache, batch.meta, batch.scale, out=out))
            ms1 = bench(lambda: triton_paged_attention(
                batch.query, batch.kv_cache, batch.meta, batch.scale, out=out, num_splits=1))
            kv_bytes = num_seqs * ctx * shape.num_kv_heads * shape.head_dim * 2 * elt
            moved = kv_bytes + 2 * batch.query.numel() * elt
            gbps = moved / ms / 1e6
            peer = "n/a"
            peer_gbps = ""
            try:
                k, v = contiguous_kv(batch)
                q = batch.query[:, :, None, :]  # [seqs, heads, 1, head_dim]
                pms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                peer, peer_gbps = f"{pms:.3f}", f"{moved / pms / 1e6:.0f}"
                del k, v
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # the peer is optional
                peer = type(e).__name__
            print(f"  {num_seqs:>5} {ctx:>6} {splits:>6} {ms:>8.3f} {gbps:>7.0f} {100 * gbps / H200_PEAK_GBPS:>5.0f}% "
                  f"{ms1:>10.3f} {peer:>8} {peer_gbps:>9}")
            del batch, out
            torch.cuda.empty_cache()


def mix_lengths(num_seqs: int, seed: int = 0, median: float = 400.0, longest: int = 3072) -> list[int]:
    """Decode contexts of a running ShareGPT-like mix: lognormal, clipped to [16, longest]."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.empty(num_seqs).log_normal_(math.log(median), 0.8, generator=g)
    return [int(min(max(x, 16), longest)) for x in raw.tolist()]


def time_decode_mix(device: str, num_seqs: int = 256, num_heads: int = 32, head_dim: int = 128,
                    longest: int = 3072, kv_dtype: torch.dtype | None = None) -> None:
    """A full batch of mixed context lengths under each PAGEDLLM_DECODE_SPLIT policy: the
    longest contexts set the kernel's tail unless they are cut ("balance"). kv_dtype: the
    cache's (default the queries'; float8_e4m3fn: --kv-cache-dtype fp8)."""
    shape = Shape(num_heads=num_heads, head_dim=head_dim)
    lens = mix_lengths(num_seqs, longest=longest)
    batch = build_batch(lens, [1] * num_seqs, shape, device, poison=False)
    cache = batch.kv_cache.to(kv_dtype or shape.dtype)
    out = torch.empty_like(batch.query)
    moved = (sum(lens) * shape.num_kv_heads * shape.head_dim * 2 * cache.element_size()
             + 2 * batch.query.numel() * batch.query.element_size())
    print(f"\ndecode, mixed contexts: {num_seqs} seqs, {num_heads} q / {shape.num_kv_heads} kv heads, "
          f"context mean {sum(lens) / num_seqs:.0f} max {max(lens)}, {cache.dtype} cache")
    previous = triton_attention.DECODE_SPLIT
    try:
        for policy in triton_attention.DECODE_SPLIT_POLICIES:
            triton_attention.DECODE_SPLIT = policy
            splits = choose_num_splits(max(lens), num_seqs, shape.num_kv_heads, batch.query.device)
            ms = bench(lambda: triton_paged_attention(batch.query, cache, batch.meta, batch.scale, out=out))
            gbps = moved / ms / 1e6
            print(f"  {policy:>8}: splits {splits:>2}  {ms:.3f} ms  {gbps:.0f} GB/s  "
                  f"{100 * gbps / H200_PEAK_GBPS:.0f}% of peak")
    finally:
        triton_attention.DECODE_SPLIT = previous


def attended_keys(seq_lens, query_lens, window=None) -> int:
    total = 0
    for s, q in zip(seq_lens, query_lens):
        for j in range(s - q, s):
            total += min(j + 1, window) if window else j + 1
    return total


def time_prefill(device: str, scale_down: int = 1, head_dim: int = 128) -> None:
    shape = Shape(head_dim=head_dim)
    print(f"\nprefill: {shape.num_heads} q / {shape.num_kv_heads} kv heads, head_dim {shape.head_dim}, "
          f"block {shape.block_size}, {shape.dtype}")
    print(f"  {'case':<34} {'tokens':>7} {'ms':>8} {'TFLOP/s':>8} {'SDPA ms':>8} {'SDPA TFLOP/s':>12}")
    cases = [
        ("1 x 512 prompt", [512], [512]),
        ("1 x 2048 prompt", [2048], [2048]),
        ("1 x 8192 prompt", [8192], [8192]),
        ("4 x 2048 prompts", [2048] * 4, [2048] * 4),
        ("2048-token chunk after 6144 cached", [8192], [2048]),
        ("32 decodes @4k + 1 x 2048 prompt", [4096] * 32 + [2048], [1] * 32 + [2048]),
    ]
    for name, seq_lens, query_lens in cases:
        seq_lens = [max(1, s // scale_down) for s in seq_lens]
        query_lens = [min(s, max(1, q // scale_down) if q > 1 else 1) for s, q in zip(seq_lens, query_lens)]
        batch = build_batch(seq_lens, query_lens, shape, device, poison=False)
        out = torch.empty_like(batch.query)
        ms = bench(lambda: triton_paged_attention(batch.query, batch.kv_cache, batch.meta, batch.scale, out=out))
        flops = 4 * shape.num_heads * shape.head_dim * attended_keys(seq_lens, query_lens)
        peer, peer_tf = "n/a", ""
        if seq_lens == query_lens and len(set(seq_lens)) == 1:
            k, v = contiguous_kv(batch)
            q = batch.query.view(len(seq_lens), seq_lens[0], shape.num_heads, -1).transpose(1, 2)
            pms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True))
            peer, peer_tf = f"{pms:.3f}", f"{flops / pms / 1e9:.0f}"
            del k, v
        print(f"  {name:<34} {sum(query_lens):>7} {ms:>8.3f} {flops / ms / 1e9:>8.0f} {peer:>8} {peer_tf:>12}")
        del batch, out
        torch.cuda.empty_cache()


def time_ops(device: str, tokens: int = 8192) -> None:
    print(f"\nelementwise kernels ({DTYPE}, {tokens} tokens)")
    x = torch.randn(tokens, 4096, device=device, dtype=DTYPE)
    res, w = torch.randn_like(x), torch.randn(4096, device=device, dtype=DTYPE)
    gu = torch.randn(tokens, 2 * 14336, device=device, dtype=DTYPE)
    for name, fn, nbytes in [
        ("rms_norm", lambda: triton_rms_norm(x, w, 1e-5), 2 * x.numel() * 2),
        ("fused add + rms_norm", lambda: triton_rms_norm(x, w, 1e-5, residual=res), 4 * x.numel() * 2),
        ("silu_and_mul", lambda: triton_silu_and_mul(gu), 1.5 * gu.numel() * 2),
    ]:
        ms = bench(fn)
        print(f"  {name:<24} {ms:8.3f} ms {nbytes / ms / 1e6:7.0f} GB/s")


def time_sampling(device: str, rows: int = 256, vocab: int = 151936) -> None:
    """The sampler's pass over fp32 logits: greedy stats alone, and the seeded race."""
    from pagedllm.kernels.triton_sampling import row_argmax_logsumexp, sample_rows

    print(f"\nsampling kernels ({rows} rows x {vocab} tokens, fp32 logits)")
    logits = torch.randn(rows, vocab, device=device) * 3
    inv_temp = torch.full((rows,), 1 / 0.8, device=device)
    seeds = torch.arange(rows, device=device) * 7919 + 1
    for name, fn in [("argmax + logsumexp", lambda: row_argmax_logsumexp(logits)),
                     ("+ Gumbel race (T=0.8)", lambda: sample_rows(logits, inv_temp, seeds))]:
        ms = bench(fn)
        print(f"  {name:<24} {ms:8.3f} ms {logits.numel() * 4 / ms / 1e6:7.0f} GB/s")


def time_top_p(device: str, rows: int = 256, vocab: int = 128256) -> None:
    """The whole sampling call (layers/sampler.py) of a batch at T=0.8 with a top-p, top-k or
    min-p cut, with each PAGEDLLM_SAMPLER kind, over flat rows (logits of std 0.5, as dummy
    weights give: a top-p cut deep in the bulk) and peaked ones (std 4)."""
    from pagedllm.layers.sampler import SAMPLERS, Sampler, SamplingRow
    from pagedllm.sampling_params import SamplingParams

    print(f"\nsampling calls, ms ({rows} rows x {vocab} tokens, fp32 logits, T=0.8): "
          + "  ".join(SAMPLERS))
    sampler = Sampler(eos_token_ids=[0])
    cuts = [dict(top_p=0.95), dict(top_k=50), dict(min_p=0.05), dict(top_k=50, top_p=0.9)]
    for cut in cuts:
        batch = [SamplingRow(SamplingParams(temperature=0.8, **cut), [1], []) for _ in range(rows)]
        for std in (0.5, 4.0):
            logits = torch.randn(rows, vocab, device=device) * std
            times = []
            for kind in SAMPLERS:
                sampler.kind = kind
                times.append(bench(lambda: sampler.sample(logits, batch).packed))
            label = ", ".join(f"{k}={v}" for k, v in cut.items())
            print(f"  {label:<20} std {std:<4} " + "  ".join(f"{t:8.3f}" for t in times))


def tune_decode_mix(device: str, heads=(32, 16), batches=(64, 256, 1024),
                    block_ns=(64, 128), warps_list=(4, 8), stages_list=(1, 2, 3),
                    kv_dtype: torch.dtype | None = None, prefetch_list=(False,)) -> None:
    """The decode kernel's launch constants over full batches of mixed contexts (the
    ShareGPT-like mix's decode steps): ms per call and the KV bytes' GB/s at each batch
    size, for each query head count over 8 KV heads (32: Llama-3-8B, 16: nano's Qwen3).
    kv_dtype: the cache's (default the queries'; float8_e4m3fn: --kv-cache-dtype fp8).
    prefetch_list: PAGEDLLM_DECODE_PREFETCH's values to time (block ids a step ahead)."""
    for num_heads in heads:
        shape = Shape(num_heads=num_heads)
        batches_ = [build_batch(lens, [1] * len(lens), shape, device, poison=False)
                    for lens in (mix_lengths(n) for n in batches)]
        for b in batches_:
            b.kv_cache = b.kv_cache.to(kv_dtype or shape.dtype)
        print(f"\ndecode launch constants over mixed contexts, {num_heads} / "
              f"{shape.num_kv_heads} heads, {batches_[0].kv_cache.dtype} cache (ms and GB/s at "
              + ", ".join(f"{b.meta.num_seqs} seqs" for b in batches_) + ")")
        for block_n, warps, stages, prefetch in itertools.product(
                block_ns, warps_list, stages_list, prefetch_list):
            with patch.multiple(triton_attention, DECODE_BLOCK_N=block_n,
                                DECODE_NUM_WARPS=warps, DECODE_NUM_STAGES=stages,
                                DECODE_PREFETCH=prefetch):
                runs = triton_attention.decode_block_n(shape.head_dim,
                                                       batches_[0].kv_cache.element_size())
                print(f"  BLOCK_N={block_n:<4} (runs {runs:<3}) warps={warps} "
                      f"stages={stages}{' prefetch' if prefetch else ''}: "
                      f"{_decode_times(batches_, shape)}")


def _decode_times(batches: list[Batch], shape: Shape) -> str:
    """'ms (GB/s)' of one decode call per batch, or the error of a launch that fails."""
    shown = []
    for b in batches:
        try:
            ms = bench(lambda: triton_paged_attention(b.query, b.kv_cache, b.meta, b.scale))
        except Exception as e:  # e.g. out of shared memory for this tile
            return f"{type(e).__name__}: {str(e)[:60]}"
        kv_bytes = sum(b.seq_lens) * shape.num_kv_heads * shape.head_dim * 2 * b.kv_cache.element_size()
        shown.append(f"{ms:.3f} ({kv_bytes / ms / 1e6:.0f})")
    return "  ".join(shown)


def tune(device: str) -> None:
    """Sweep the module's launch constants; pick the best and set them in triton_attention.py."""
    tune_decode_mix(device)
    shape = Shape()
    print("\ntuning (ms; lower is better)")
    decode = [build_batch([c] * n, [1] * n, shape, device, poison=False) for n, c in ((1, 8192), (32, 4096))]
    for block_n in (32, 64, 128):
        for warps in (2, 4, 8):
            triton_attention.DECODE_BLOCK_N, triton_attention.DECODE_NUM_WARPS = block_n, warps
            times = [bench(lambda b=b: triton_paged_attention(b.query, b.kv_cache, b.meta, b.scale)) for b in decode]
            print(f"  decode BLOCK_N={block_n:<4} warps={warps}: " + "  ".join(f"{t:.3f}" for t in times))
    tune_prefill(device)


# The prefill kernel's launch choices: (BLOCK_M, BLOCK_N), warps, stages.
PREFILL_TILES = ((64, 64), (128, 64), (128, 32), (64, 32), (128, 128))


# (sequence lengths, query lengths): a 4,096-token prompt, a 2,048-token chunk after 6,144
# cached, and 56 prompts of 290 tokens (a step of the ShareGPT-like mix's prefill).
PREFILL_CASES = (([4096], [4096]), ([8192], [2048]), ([290] * 56, [290] * 56))


def tune_prefill(device: str, tiles=PREFILL_TILES, warps_list=(4, 8), stages_list=(2, 3),
                 prefetch_list=(False,), cases=PREFILL_CASES) -> None:
    """The prefill kernel's launch constants, ms a call for each of `cases`. prefetch_list:
    PAGEDLLM_PREFILL_PREFETCH's values (block ids a step ahead, one stage more)."""
    shape = Shape()
    prefill = [build_batch(s, q, shape, device, poison=False) for s, q in cases]
    print("\nprefill launch constants (ms at " + ", ".join(
        f"{len(q)} x {q[0]} after {s[0] - q[0]}" for s, q in cases) + ")")
    for (block_m, block_n), warps, stages, prefetch in itertools.product(
            tiles, warps_list, stages_list, prefetch_list):
        try:
            with patch.multiple(triton_attention, PREFILL_BLOCK_M=block_m,
                                PREFILL_BLOCK_N=block_n, PREFILL_NUM_WARPS=warps,
                                PREFILL_NUM_STAGES=stages, PREFILL_PREFETCH=prefetch):
                times = [bench(lambda b=b: triton_paged_attention(b.query, b.kv_cache, b.meta,
                                                                  b.scale)) for b in prefill]
            shown = "  ".join(f"{t:.3f}" for t in times)
        except Exception as e:  # e.g. out of shared memory for this tile
            shown = f"{type(e).__name__}: {str(e)[:60]}"
        print(f"  prefill BLOCK_M={block_m:<4} BLOCK_N={block_n:<4} warps={warps} "
              f"stages={stages}{' prefetch' if prefetch else ''}: {shown}")


def main(argv: list[str]) -> int:
    parser = Parser(prog="pagedllm bench kernels", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="also sweep launch configurations")
    parser.add_argument("--checks-only", action="store_true", help="skip the timings")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script itself)")
    args = parser.parse_args(argv)

    global DTYPE
    if args.smoke:
        device, scale_down, head_dim = "cpu", 64, 32
        DTYPE = torch.float16
    elif torch.cuda.is_available():
        device, scale_down, head_dim = "cuda", 1, 128
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    else:
        print("no CUDA device; run with --smoke under TRITON_INTERPRET=1 to check the script on CPU")
        return 2

    check_write_kv_cache(device, scale_down)
    check_attention(device, scale_down, head_dim)
    check_ops(device, scale_down)
    if device == "cuda":
        check_cuda_graph(device)
    failed = [name for name, ok in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed" + (f"; FAILED: {failed}" if failed else ""))

    if args.smoke:  # run the timing code paths once, at toy sizes
        time_decode(device, batch_sizes=(1, 4), contexts=(40,), head_dim=head_dim)
        time_decode_mix(device, num_seqs=20, num_heads=16, head_dim=head_dim, longest=600)
        time_decode_mix(device, num_seqs=4, head_dim=head_dim, longest=100,
                        kv_dtype=torch.float8_e4m3fn)
        time_prefill(device, scale_down=scale_down, head_dim=head_dim)
        time_ops(device, tokens=8)
        time_sampling(device, rows=2, vocab=1000)
        time_top_p(device, rows=2, vocab=300)
    elif not args.checks_only:
        time_decode(device)
        time_decode_mix(device)
        time_decode_mix(device, num_heads=16)  # Qwen3-0.6B's 16 q / 8 kv heads
        for num_heads in (32, 16):  # over an FP8 cache: half the bytes of the two above
            time_decode_mix(device, num_heads=num_heads, kv_dtype=torch.float8_e4m3fn)
        time_prefill(device)
        time_ops(device)
        time_sampling(device)
        time_top_p(device)
        if args.tune:
            tune(device)
    return 1 if failed else 0

