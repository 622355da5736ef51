"""Skinny matmuls on CUDA: y = x . W^T for the few rows of a decode step (1-16), W in
bf16/fp16, or FP8 E4M3 with one scale per output feature (layers/fp8_linear.py).

Such a product is bound by reading W once. Each program owns BLOCK_N output features and one
slice of K (split-K: a GEMV has too few output blocks to keep every SM streaming otherwise)
and reads those weight bytes once for every row of x. The slices' fp32 partial sums are
added by the last program of each column block to finish (a counter per block, which that
program resets), so one call is one kernel: a separate reduction and cast after each product
cost ~4 us each, ~0.5 ms of a Llama-3-8B decode step's 4 ms.

One row takes the CUDA cores (products summed along K, no padding to a tensor-core tile);
2-16 rows take tl.dot. Under programmatic dependent launch (kernels/triton_pdl.py) a one-row
program loads its first weight tile before it waits for the kernel that wrote x. With
PAGEDLLM_L2_PREFETCH=1 (kernels/triton_pdl.py) it also asks L2 for the rest of its weight
slice there (bulk prefetches, a few per row): a program made resident during the kernel
before would stream its weights while that kernel's tail runs, so HBM need not idle
between the short kernels of a decode step. The kernel runs under
TRITON_INTERPRET=1 on the CPU for the tests (its tl.dot takes fp16, not bf16; no PDL, no
prefetch).

At one row, `folded_matmul` also folds what a decoder layer does around its projections
into the store of each finished block (layers/norm_fold.py): the input RMSNorm's 1/rms, the
bias, the residual add and the next norm's input, SiLU-and-mul, or the rotary embedding
with the KV cache write.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagedllm.kernels import triton_cache, triton_pdl
from pagedllm.kernels.triton_counters import counters


@triton.jit
def _load_weights(w_rows, ks, rn, N, k_end, EVEN: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile of columns ks."""
    if EVEN:
        return tl.load(w_rows + ks[None, :])
    return tl.load(w_rows + ks[None, :], mask=(rn[:, None] < N) & (ks[None, :] < k_end), other=0)


@triton.jit
def _prefetch_slice(w_rows, k_start, slice_bytes, PARTS: tl.constexpr):
    """Ask L2 for this program's weight slice: rows w_rows, slice_bytes from column k_start,
    in PARTS bulk prefetches per row (each part a multiple of 16 bytes, 16-byte aligned)."""
    part = slice_bytes // PARTS
    rows = (w_rows + k_start).to(tl.pointer_type(tl.uint8), bitcast=True)
    triton_pdl.prefetch_l2(rows + (tl.arange(0, PARTS) * part)[None, :], part)


@triton.jit
def _row_products(acc, w, x_ptr, rn, ks, k_end, EVEN: tl.constexpr, W_FP8: tl.constexpr):
    """acc + w * x[ks] in fp32, elementwise ([BLOCK_N, BLOCK_K]), for FP8 weights: the sum
    along K is left to the end (a reduction across threads per tile cost a third of the
    loop's instructions).
    x is loaded once per weight row, in the weight tile's layout (each thread's copies come
    from L1): the alternative, a [BLOCK_K] load broadcast, converts a layout through shared
    memory every tile."""
    xs = ks[None, :] + 0 * rn[:, None]
    if EVEN:
        x = tl.load(x_ptr + xs)
    else:
        x = tl.load(x_ptr + xs, mask=xs < k_end, other=0.0)
    if W_FP8:
        w = w.to(tl.float8e4nv, bitcast=True)
    return acc + w.to(tl.float32) * x.to(tl.float32)


@triton.jit
def _row_dot(w, x_ptr, ks, k_end, EVEN: tl.constexpr):
    """sum_k w[:, k] * x[ks] in fp32 ([BLOCK_N]): x loaded as a [BLOCK_K] vector."""
    if EVEN:
        x = tl.load(x_ptr + ks)
    else:
        x = tl.load(x_ptr + ks, mask=ks < k_end, other=0.0)
    return tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _feature_rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr, ROPE: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    """The weight rows (output features) of column block pid_n. Paired folds put the two
    features of a pair in rows 2i and 2i + 1 of the block: GATED, gate i and up i of a
    [gate | up] weight; ROPE, dims d and d + HEAD_DIM / 2 of one head of a [q | k | v]
    weight (the blocks of a head in order)."""
    j = tl.arange(0, BLOCK_N)
    if GATED:
        return pid_n * (BLOCK_N // 2) + j // 2 + (j % 2) * (N // 2)
    if ROPE:
        per_head: tl.constexpr = HEAD_DIM // BLOCK_N
        first = (pid_n // per_head) * HEAD_DIM + (pid_n % per_head) * (BLOCK_N // 2)
        return first + j // 2 + (j % 2) * (HEAD_DIM // 2)
    return pid_n * BLOCK_N + j


@triton.jit
def _finish(acc, out_ptr, stride_om, rm, rn, M, N, pid_n, ss_in_ptr, n_ss_in, inv_k, eps,
            bias_ptr, res_ptr, g_ptr, hg_ptr, ss_out_ptr, pos_ptr, slot_ptr, cos_sin_ptr,
            cache_ptr, num_heads, num_kv_heads, stride_c_kv, stride_c_block, stride_c_offset,
            stride_c_head, block_size, RMS_IN: tl.constexpr, SS_PAD: tl.constexpr,
            HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, RMS_OUT: tl.constexpr,
            GATED: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr,
            FP8_MAX: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the finished [BLOCK_M, BLOCK_N] block: scaled by 1/rms of the input row
    (RMS_IN), plus the bias; then plus the residual (RESIDUAL), and for the next RMSNorm
    h * g and this block's sum of h^2 (RMS_OUT); or GATED, silu(gate) * up of its pairs;
    or ROPE, its pairs rotated and stored as q, or into the KV cache. The folds take one
    row (M == 1)."""
    if RMS_IN:
        parts = tl.arange(0, SS_PAD)
        ss = tl.sum(tl.load(ss_in_ptr + parts, mask=parts < n_ss_in, other=0.0), 0)
        acc = acc * tl.rsqrt(ss * inv_k + eps)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED or ROPE:  # rounded where the unfolded projection rounds its output
        first, second = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), (BLOCK_N // 2, 2)))
        if GATED:
            act = (first * tl.sigmoid(first)).to(dtype).to(tl.float32) * second
            tl.store(out_ptr + pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2),
                     act.to(dtype))
        else:
            _rope_store(first, second, out_ptr, pid_n, pos_ptr, slot_ptr, cos_sin_ptr,
                        cache_ptr, num_heads, num_kv_heads, stride_c_kv, stride_c_block,
                        stride_c_offset, stride_c_head, block_size, HEAD_DIM, FP8_MAX, BLOCK_N)
    else:
        _store_rows(acc, out_ptr, stride_om, rm, rn, M, N, pid_n, res_ptr, g_ptr, hg_ptr,
                    ss_out_ptr, RESIDUAL, RMS_OUT)


@triton.jit
def _rope_store(x1, x2, q_ptr, pid_n, pos_ptr, slot_ptr, cos_sin_ptr, cache_ptr, num_heads,
                num_kv_heads, stride_c_kv, stride_c_block, stride_c_offset, stride_c_head,
                block_size, HEAD_DIM: tl.constexpr, FP8_MAX: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Dims d and d + HEAD_DIM / 2 (x1, x2) of one head of [q | k | v]: q and k heads
    rotated at the row's position (neox style, cos | sin rows of HEAD_DIM), then q heads
    stored as q, k and v heads in the row's cache slot (none for a slot of -1), as
    triton_cache's rotary-and-write kernel does."""
    half: tl.constexpr = HEAD_DIM // 2
    d = (pid_n % (HEAD_DIM // BLOCK_N)) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    head = pid_n // (HEAD_DIM // BLOCK_N) + 0 * d  # as a tensor: the masks below are too
    pos = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + d).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + d).to(tl.float32)
    is_v = head >= num_heads + num_kv_heads  # q and k heads rotate; v heads as they are
    y1 = tl.where(is_v, x1, x1 * cos - x2 * sin)
    y2 = tl.where(is_v, x2, x2 * cos + x1 * sin)
    dtype = q_ptr.dtype.element_ty
    is_q = head < num_heads
    tl.store(q_ptr + head * HEAD_DIM + d, y1.to(dtype), mask=is_q)
    tl.store(q_ptr + head * HEAD_DIM + half + d, y2.to(dtype), mask=is_q)
    slot = tl.load(slot_ptr).to(tl.int64) + 0 * d
    kv_head = head - num_heads - tl.where(is_v, num_kv_heads, 0)
    dst = (cache_ptr + tl.where(is_v, stride_c_kv, 0) + (slot // block_size) * stride_c_block
           + (slot % block_size) * stride_c_offset + kv_head * stride_c_head + d)
    y1, y2 = y1.to(dtype).to(tl.float32), y2.to(dtype).to(tl.float32)  # as q and k round
    if FP8_MAX > 0:  # E4M3 has no infinity: clamp first (triton_cache)
        y1 = tl.minimum(tl.maximum(y1, -FP8_MAX), FP8_MAX)
        y2 = tl.minimum(tl.maximum(y2, -FP8_MAX), FP8_MAX)
    cached = (head >= num_heads) & (slot >= 0)
    tl.store(dst, y1.to(cache_ptr.dtype.element_ty), mask=cached)
    tl.store(dst + half, y2.to(cache_ptr.dtype.element_ty), mask=cached)


@triton.jit
def _store_rows(acc, out_ptr, stride_om, rm, rn, M, N, pid_n, res_ptr, g_ptr, hg_ptr,
                ss_out_ptr, RESIDUAL: tl.constexpr, RMS_OUT: tl.constexpr):
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = acc
    if RESIDUAL:
        out += tl.load(res_ptr + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=mask)
    if RMS_OUT:
        # h as stored (rounded), as the unfolded RMSNorm reads it; masked columns are 0
        h = out.to(tl.float32)
        tl.store(ss_out_ptr + pid_n, tl.sum(tl.sum(h * h, 1), 0))
        g = tl.load(g_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(hg_ptr + rn[None, :], (h * g[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_kernel(out_ptr, part_ptr, count_ptr, x_ptr, w_ptr, scale_ptr, M, N, K,
                   k_per_split, stride_xm, stride_om, SPLIT,
                   ss_in_ptr, n_ss_in, inv_k, eps, bias_ptr, res_ptr, g_ptr, hg_ptr,
                   ss_out_ptr,
                   pos_ptr, slot_ptr, cos_sin_ptr, cache_ptr, num_heads, num_kv_heads,
                   stride_c_kv, stride_c_block, stride_c_offset, stride_c_head, block_size,
                   W_FP8: tl.constexpr, HAS_SCALE: tl.constexpr,
                   EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr, L2_PREFETCH: tl.constexpr,
                   W_BYTES: tl.constexpr, PREFETCH_PARTS: tl.constexpr,
                   RMS_IN: tl.constexpr, SS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
                   RESIDUAL: tl.constexpr, RMS_OUT: tl.constexpr, GATED: tl.constexpr,
                   ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, FP8_MAX: tl.constexpr):
    """Program (n, s): output features [n * BLOCK_N, +BLOCK_N) over the K slice
    [s * k_per_split, +k_per_split). EVEN: no bounds to check (N and the slices divide).
    GATED and ROPE pair the block's features (_feature_rows). The folds (see
    folded_matmul) apply once a block's sum is whole: in its one program, or in the last
    slice's."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = _feature_rows(pid_n, N, BLOCK_N, GATED, ROPE, HEAD_DIM)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if BLOCK_M == 1:
        # The weights do not depend on the kernel before this one: under PDL the first
        # tile is on its way before the wait for that kernel's x.
        w = _load_weights(w_rows, k_start + rk, rn, N, k_end, EVEN)
        if L2_PREFETCH:  # the rest of the slice into L2 (EVEN: every row and byte in bounds)
            _prefetch_slice(w_rows, k_start, k_per_split * W_BYTES, PREFETCH_PARTS)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        if W_FP8:
            acc2 = _row_products(0.0, w, x_ptr, rn, k_start + rk, k_end, EVEN, W_FP8)
            for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
                w = _load_weights(w_rows, k0 + rk, rn, N, k_end, EVEN)
                acc2 = _row_products(acc2, w, x_ptr, rn, k0 + rk, k_end, EVEN, W_FP8)
            acc1 = tl.sum(acc2, axis=1)  # one reduction across threads, after the loop
        else:  # bf16/fp16: a reduction per tile measured faster here (docs/benchmarks.md)
            acc1 = _row_dot(w, x_ptr, k_start + rk, k_end, EVEN)
            for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
                w = _load_weights(w_rows, k0 + rk, rn, N, k_end, EVEN)
                acc1 += _row_dot(w, x_ptr, k0 + rk, k_end, EVEN)
        acc = acc1[None, :]
    else:
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :],
                        mask=(rm[:, None] < M) & (ks[None, :] < k_end), other=0.0)
            if EVEN:
                w = tl.load(w_rows + ks[None, :])
            else:
                w = tl.load(w_rows + ks[None, :],
                            mask=(rn[:, None] < N) & (ks[None, :] < k_end), other=0)
            if W_FP8:  # e4m3 -> fp32 -> the activations' dtype (exact: e4m3 fits in bf16)
                w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    offs = rm[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        _finish(acc, out_ptr, stride_om, rm, rn, M, N, pid_n, ss_in_ptr, n_ss_in, inv_k, eps,
                bias_ptr, res_ptr, g_ptr, hg_ptr, ss_out_ptr, pos_ptr, slot_ptr, cos_sin_ptr,
                cache_ptr, num_heads, num_kv_heads, stride_c_kv, stride_c_block,
                stride_c_offset, stride_c_head, block_size, RMS_IN, SS_PAD, HAS_BIAS,
                RESIDUAL, RMS_OUT, GATED, ROPE, HEAD_DIM, FP8_MAX, BLOCK_N)
    else:
        tl.store(part_ptr + pid_k * M * N + offs, acc, mask=mask)
        # Every thread's partial is stored before one thread counts this slice done
        # (release); the last slice's program reads all of them from L2 (.cg), in slice
        # order, so the sum does not depend on which program came last.
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            _finish(total, out_ptr, stride_om, rm, rn, M, N, pid_n, ss_in_ptr, n_ss_in, inv_k,
                    eps, bias_ptr, res_ptr, g_ptr, hg_ptr, ss_out_ptr, pos_ptr, slot_ptr,
                    cos_sin_ptr, cache_ptr, num_heads, num_kv_heads, stride_c_kv,
                    stride_c_block, stride_c_offset, stride_c_head, block_size, RMS_IN,
                    SS_PAD, HAS_BIAS, RESIDUAL, RMS_OUT, GATED, ROPE, HEAD_DIM, FP8_MAX,
                    BLOCK_N)
            tl.atomic_xchg(count_ptr + pid_n, 0)


MAX_ROWS = 16


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    programs_per_sm: int  # split K until the grid has about this many programs per SM


# Measured on an H200 with scripts/gpu_gemv_tune.py --sweep at Llama-3-8B's shapes (FP8 again
# after the one-row loop lost its per-tile reduction: fewer, longer K slices won). One row
# (CUDA cores), keyed by the weight's element size and whether it has many output features
# (a gate_up projection or an LM head: enough column blocks that K is hardly split):
ROW_CONFIGS = {
    (2, False): SkinnyConfig(block_n=16, block_k=256, num_warps=4, programs_per_sm=8),
    (2, True): SkinnyConfig(block_n=16, block_k=512, num_warps=4, programs_per_sm=8),
    (1, False): SkinnyConfig(block_n=16, block_k=512, num_warps=4, programs_per_sm=2),
    (1, True): SkinnyConfig(block_n=16, block_k=256, num_warps=4, programs_per_sm=2),
}
WIDE_N = 16384
# 2-16 rows (tensor cores)
DOT_CONFIG = SkinnyConfig(block_n=64, block_k=256, num_warps=4, programs_per_sm=4)


def choose_config(m: int, n: int, weight: torch.Tensor) -> SkinnyConfig:
    if m > 1:
        return DOT_CONFIG
    return ROW_CONFIGS[weight.element_size(), n >= WIDE_N]


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any value works
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k(n: int, k: int, device: torch.device, config: SkinnyConfig) -> int:
    """How many K slices: enough programs for the device's SMs, each slice at least two
    BLOCK_K steps long."""
    blocks_n = triton.cdiv(n, config.block_n)
    wanted = triton.cdiv(config.programs_per_sm * _num_sms(device), blocks_n)
    return max(1, min(wanted, k // (2 * config.block_k)))


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  split: int | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, bf16/fp16) . (weight [N, K] (* scale [N]))^T -> [M, N] in x's
    dtype, accumulated in fp32. weight: x's dtype, or float8_e4m3fn with fp32 scales."""
    return folded_matmul(x, weight, scale, split=split, config=config)[0]


@dataclass(frozen=True)
class RmsInput:
    """An RMSNorm folded into the GEMV that reads its output. norm(h) = h / rms(h) * g, and
    the 1/rms of a row is one factor of all its products: so the GEMV that wrote h also
    stores x = h * g and ss, its column blocks' sums of h^2, and the GEMV reading x scales
    its outputs by rsqrt(sum(ss) / K + eps). No norm kernel runs between the two (a batch-1
    decode step had 65 of them), and the inner loops are unchanged."""
    x: torch.Tensor  # [1, K] h * g, in h's dtype
    ss: torch.Tensor  # [column blocks of the GEMV that wrote h] fp32
    eps: float


@dataclass(frozen=True)
class RopeCache:
    """The rotary embedding and the KV cache write folded into a one-row [q | k | v]
    projection: q and k heads rotated at positions[0] (neox style, full head_dim), k and v
    heads stored in kv_cache's slot slot_mapping[0] (none for -1, FP8 clamped as
    triton_cache stores them); the product's output is then q alone."""
    num_heads: int
    num_kv_heads: int
    positions: torch.Tensor  # [1] int
    slot_mapping: torch.Tensor  # [1] int
    cos_sin: torch.Tensor  # [max_position, head_dim]: cos | sin, contiguous
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]

    @property
    def head_dim(self) -> int:
        return self.kv_cache.shape[-1]


def folded_matmul(x: torch.Tensor | RmsInput, weight: torch.Tensor,
                  scale: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None,
                  next_norm: tuple[torch.Tensor, float] | None = None, gated: bool = False,
                  rope: RopeCache | None = None,
                  split: int | None = None, config: SkinnyConfig | None = None,
                  ) -> tuple[torch.Tensor, RmsInput | None]:
    """skinny_matmul with the folds of a decoder layer around it, for one row:
    x an RmsInput: the output scaled by its 1/rms (the input norm folded in);
    bias [N]: added to the product (before any fold below);
    residual [1, N]: out = x . W^T + residual (the residual stream, rounded once);
    next_norm (its weight g [N], eps): also the RmsInput of norm(out) for the next GEMV;
    gated: weight is [gate | up] ([2 * d, K]), out = silu(gate) * up [1, d] (the MLP's
    activation folded in; whole pairs in every column block: `gates`);
    rope: weight is [q | k | v], out = q rotated [1, heads * head_dim], k and v cached.
    Returns (out, that RmsInput or None)."""
    rms_in = x if isinstance(x, RmsInput) else None
    x = rms_in.x if rms_in is not None else x
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, got {M}")
    if weight.shape[1] != K or not weight.is_contiguous():
        raise ValueError("the weight must be a contiguous [N, K] matrix matching x")
    w_fp8 = weight.dtype == torch.float8_e4m3fn
    if not w_fp8 and weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} does not match x's {x.dtype}")
    if w_fp8 != (scale is not None):
        raise ValueError("an FP8 weight takes per-feature scales, any other weight none")
    folds = (rms_in is not None or bias is not None or residual is not None
             or next_norm is not None or gated or rope is not None)
    if folds and M != 1:
        raise ValueError(f"folded_matmul's folds take one row, got {M}")
    if gated and (residual is not None or next_norm is not None or not gates(weight)):
        raise ValueError("a gated product takes no residual or next norm, and a [gate | up] "
                         f"weight of rows a multiple of {choose_config(1, N, weight).block_n}, "
                         f"got {N}")
    if rope is not None:
        _check_rope(rope, weight, residual is not None or next_norm is not None or gated)
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"the bias must have shape ({N},), got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (1, N):
        raise ValueError(f"the residual must have shape (1, {N}), got {tuple(residual.shape)}")
    if next_norm is not None and tuple(next_norm[0].shape) != (N,):
        raise ValueError(f"the next norm's weight must have shape ({N},), "
                         f"got {tuple(next_norm[0].shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    config = config or choose_config(M, N, weight)
    split = split or split_k(N, K, x.device, config)
    k_per_split = triton.cdiv(triton.cdiv(K, split), config.block_k) * config.block_k
    split = triton.cdiv(K, k_per_split)
    blocks_n = triton.cdiv(N, config.block_n)
    width = N // 2 if gated else rope.num_heads * rope.head_dim if rope else N
    out = torch.empty(M, width, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    rms_out = None
    if next_norm is not None:
        rms_out = RmsInput(torch.empty_like(out), torch.empty(blocks_n, dtype=torch.float32,
                                                              device=x.device), next_norm[1])
    even = N % config.block_n == 0 and K % k_per_split == 0
    pdl = triton_pdl.launch_kwargs(x.device)
    # Bulk prefetches take 16-byte aligned parts of whole 16-byte multiples; only before
    # the PDL wait is there a kernel to overlap with.
    parts = max(1, config.num_warps * 32 // config.block_n)
    prefetch = (triton_pdl.l2_prefetch(x.device) and M == 1 and even
                and weight.data_ptr() % 16 == 0
                and (k_per_split * weight.element_size()) % (16 * parts) == 0)
    unused = out  # pointer arguments of folds that are off: never read or written
    _skinny_kernel[(blocks_n, split)](
        out, part, counters("skinny_matmul", x.device, blocks_n), x,
        weight.view(torch.uint8) if w_fp8 else weight, scale if w_fp8 else out, M, N, K,
        k_per_split, x.stride(0), out.stride(0), split,
        rms_in.ss if rms_in is not None else unused,
        rms_in.ss.numel() if rms_in is not None else 1, 1.0 / K,
        rms_in.eps if rms_in is not None else 0.0,
        bias if bias is not None else unused,
        residual.contiguous() if residual is not None else unused,
        next_norm[0] if next_norm is not None else unused,
        rms_out.x if rms_out is not None else unused,
        rms_out.ss if rms_out is not None else unused,
        *_rope_args(rope, unused),
        W_FP8=w_fp8, HAS_SCALE=w_fp8, EVEN=even,
        BLOCK_M=1 if M == 1 else 16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        RMS_IN=rms_in is not None,
        SS_PAD=triton.next_power_of_2(rms_in.ss.numel()) if rms_in is not None else 1,
        HAS_BIAS=bias is not None, RESIDUAL=residual is not None,
        RMS_OUT=rms_out is not None, GATED=gated, ROPE=rope is not None,
        HEAD_DIM=rope.head_dim if rope else config.block_n,
        FP8_MAX=triton_cache.fp8_max(rope.kv_cache) if rope else 0.0,
        L2_PREFETCH=prefetch, W_BYTES=weight.element_size(), PREFETCH_PARTS=parts,
        num_warps=config.num_warps, num_stages=3, **pdl,
    )
    return out, rms_out


def _rope_args(rope: RopeCache | None, unused: torch.Tensor) -> tuple:
    """The kernel's arguments of the rope fold, from positions to block_size."""
    if rope is None:
        return (unused,) * 4 + (0,) * 7
    cache = rope.kv_cache
    return (rope.positions, rope.slot_mapping, rope.cos_sin, cache, rope.num_heads,
            rope.num_kv_heads, *cache.stride()[:4], cache.shape[2])


def _check_rope(rope: RopeCache, weight: torch.Tensor, other_folds: bool) -> None:
    cache, head_dim = rope.kv_cache, rope.head_dim
    rows = (rope.num_heads + 2 * rope.num_kv_heads) * head_dim
    if other_folds or weight.shape[0] != rows:
        raise ValueError(f"a rope fold takes a [q | k | v] weight of {rows} rows and no "
                         f"residual, next norm or gate, got {weight.shape[0]} rows")
    if not ropes(weight, head_dim):
        raise ValueError(f"a rope fold takes a head_dim that is a multiple of "
                         f"{choose_config(1, rows, weight).block_n}, got {head_dim}")
    if (cache.dim() != 5 or cache.shape[3] != rope.num_kv_heads or cache.stride(-1) != 1
            or tuple(rope.cos_sin.shape[1:]) != (head_dim,) or not rope.cos_sin.is_contiguous()):
        raise ValueError("a rope fold takes a [2, blocks, block_size, kv_heads, head_dim] "
                         "cache and contiguous cos | sin rows of head_dim (full rotary)")


def ropes(weight: torch.Tensor, head_dim: int) -> bool:
    """Whether a one-row product over this [q | k | v] weight can fold the rotary embedding:
    each column block holds whole (d, d + head_dim / 2) pairs of one head."""
    return head_dim % choose_config(1, weight.shape[0], weight).block_n == 0


def gates(weight: torch.Tensor) -> bool:
    """Whether a one-row product over this [gate | up] weight can fold the SiLU: each column
    block holds whole (gate, up) pairs."""
    n = weight.shape[0]
    return n % choose_config(1, n, weight).block_n == 0
