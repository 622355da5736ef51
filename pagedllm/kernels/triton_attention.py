"""Paged attention in Triton: the CUDA path of pagedllm/kernels/reference.py:paged_attention.

Two kernels share one inner step (an online-softmax update over a tile of keys gathered
through the block table):

- Decode (every sequence has one query token): flash-decoding. The grid is
  (sequence, KV head, split). A program serves all query heads that share its KV head, so
  each K/V tile is read once per group (GQA), and reduces one slice of the context into a
  partial (max, sum, acc). The last split program of a (sequence, KV head) to finish merges
  the partials of all its splits (a counter per pair, kernels/triton_counters.py), so decode
  is one launch. Splitting the context keeps the GPU busy when there are few sequences with
  long contexts. A slice holds at least `min_tiles` key tiles: a sequence shorter than that
  is one slice, written straight to the output, and the programs of slices past a
  sequence's end return at once. With a floor of a few hundred keys, a big batch of mixed
  lengths (policy "balance") is cut into programs of similar work, so the longest contexts
  no longer make the kernel's tail.
- Everything else (prefill, chunked prefill with cached context, mixed batches): a
  flash-attention style kernel over (sequence, query tile, KV head). A tile's rows are
  (query token, head of the GQA group) pairs, so K/V is again read once per group. Causal
  masking uses absolute positions: query j of sequence i sits at seq_len - q_len + j.

Scores live in the log2 domain (exp2 is cheaper than exp): the softmax scale and the ALiBi
bias are pre-multiplied by log2(e). Accumulation is fp32 whatever the input dtype.
Grid sizes come from the host lists in the metadata; nothing here syncs with the device.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagedllm.kernels import triton_pdl
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.kernels.triton_counters import counters

LOG2E = 1.4426950408889634
# Compiled kernels may read only constexpr globals (the interpreter does not enforce this).
_LOG2E_K = tl.constexpr(LOG2E)

# Launch configuration: keys per inner step, query rows per prefill tile, warps, pipeline
# stages. Module constants so `pagedllm bench kernels --tune` and the tests can change them.
# Decode takes DECODE_BLOCK_N keys a step where the K and V tiles of every pipeline stage fit
# in DECODE_TILE_BYTES of shared memory, fewer where not (decode_block_n);
# PAGEDLLM_DECODE_BLOCK_N, PAGEDLLM_DECODE_NUM_WARPS and PAGEDLLM_DECODE_NUM_STAGES set it
# for an end-to-end A/B (read once at import; scripts/kernel_resources.py shows each
# choice's registers and spills). Stages: 2 over a 16-bit cache (3 would halve its 128-key
# tiles), 3 over an FP8 cache (its 128-key tiles fit three times; gpu-check's
# decode-tune-fp8 measured 8-13% less time than 2 at 256-1,024 sequences).
DECODE_BLOCK_N = int(os.environ.get("PAGEDLLM_DECODE_BLOCK_N", "128"))
if DECODE_BLOCK_N not in (16, 32, 64, 128):
    raise ValueError(f"PAGEDLLM_DECODE_BLOCK_N must be 16, 32, 64 or 128, got {DECODE_BLOCK_N}")
DECODE_NUM_WARPS = int(os.environ.get("PAGEDLLM_DECODE_NUM_WARPS", "4"))
if DECODE_NUM_WARPS not in (2, 4, 8):
    raise ValueError(f"PAGEDLLM_DECODE_NUM_WARPS must be 2, 4 or 8, got {DECODE_NUM_WARPS}")
DECODE_NUM_STAGES: int | None = int(os.environ["PAGEDLLM_DECODE_NUM_STAGES"]) \
    if os.environ.get("PAGEDLLM_DECODE_NUM_STAGES") else None  # None: by the cache (above)
if DECODE_NUM_STAGES not in (None, 1, 2, 3, 4):
    raise ValueError(f"PAGEDLLM_DECODE_NUM_STAGES must be 1, 2, 3 or 4, got {DECODE_NUM_STAGES}")
# PAGEDLLM_DECODE_PREFETCH=1: each program loads the next key tile's block ids a step ahead,
# so the pipeliner can keep num_stages - 1 key tiles in flight (an A/B; _paged_decode_kernel);
# its default is then 3 stages over either cache.
DECODE_PREFETCH = os.environ.get("PAGEDLLM_DECODE_PREFETCH", "0") == "1"
# PAGEDLLM_DECODE_ORDER=length: decode's programs take the sequences longest context first,
# so that the kernel's last programs are short ones (a longest-first schedule; the GPU starts
# programs in grid order). An A/B, off by default until measured.
DECODE_ORDER = os.environ.get("PAGEDLLM_DECODE_ORDER", "batch") == "length"
DECODE_TILE_BYTES = 128 << 10  # of the 228 KiB an SM of an H100 / H200 has
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2
# PAGEDLLM_PREFILL_PREFETCH=1: the prefill kernel loads the next key tile's block ids a step
# ahead and runs one stage more, so two key tiles are in flight (an A/B, as decode's).
PREFILL_PREFETCH = os.environ.get("PAGEDLLM_PREFILL_PREFETCH", "0") == "1"
MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # a split reduces at least this many keys
# How decode cuts contexts into splits (PAGEDLLM_DECODE_SPLIT, read once at import):
#   fill     split only to fill the GPU when the batch is too small to (few sequences);
#   balance  as fill, and in a batch that fills the GPU, cut contexts longer than
#            BALANCE_SPLIT_TOKENS into slices of at least that many keys.
DECODE_SPLIT_POLICIES = ("fill", "balance")
DECODE_SPLIT = os.environ.get("PAGEDLLM_DECODE_SPLIT", "fill")
if DECODE_SPLIT not in DECODE_SPLIT_POLICIES:
    raise ValueError(f"PAGEDLLM_DECODE_SPLIT must be one of {DECODE_SPLIT_POLICIES}, got {DECODE_SPLIT!r}")
BALANCE_SPLIT_TOKENS = 512
# Over an FP8 cache with half-precision queries, the dots take fp16 operands: E4M3 -> fp16 is
# one conversion instruction per pair of values, E4M3 -> bf16 several, and decode converts
# every key and value it reads. PAGEDLLM_FP8_KV_FP16_DOTS=0 keeps the queries' dtype (an A/B).
FP8_KV_FP16_DOTS = os.environ.get("PAGEDLLM_FP8_KV_FP16_DOTS", "1") != "0"


# --------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------


@triton.jit
def _tile_blocks(table_row, k_pos, kv_lo, seq_len, BLOCK_SIZE: tl.constexpr):
    """The cache block of each key position (0 where the position holds no key)."""
    valid = (k_pos >= kv_lo) & (k_pos < seq_len)
    return tl.load(table_row + k_pos // BLOCK_SIZE, mask=valid, other=0)


@triton.jit
def _block_rows(blocks, k_pos, kv_head, stride_c_block, stride_c_offset, stride_c_head,
                BLOCK_SIZE: tl.constexpr):
    """Element offsets [BLOCK_N] of the first dim of the keys at positions k_pos in `blocks`."""
    return (blocks.to(tl.int64) * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_offset
            + kv_head * stride_c_head)


@triton.jit
def _block_offsets(blocks, k_pos, kv_head, stride_c_block, stride_c_offset, stride_c_head,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Element offsets [BLOCK_N, HEAD_DIM] of the keys at positions k_pos in `blocks`."""
    rows = _block_rows(blocks, k_pos, kv_head, stride_c_block, stride_c_offset, stride_c_head,
                       BLOCK_SIZE)
    return rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]


@triton.jit
def _kv_tile_offsets(
    block_table_row_ptr, k_pos, kv_mask, kv_head,
    stride_c_block, stride_c_offset, stride_c_head, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Element offsets [BLOCK_N, HEAD_DIM] of the keys at positions k_pos, via the block table.

    A tile of keys may span several cache blocks; each key finds its own block.
    """
    blocks = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE, mask=kv_mask, other=0)
    return _block_offsets(blocks, k_pos, kv_head, stride_c_block, stride_c_offset,
                          stride_c_head, BLOCK_SIZE, HEAD_DIM)


@triton.jit
def _dot_operands(q, qk_scale, FP16_DOTS: tl.constexpr):
    """The queries as the dots take them, and the scale left to apply to their scores.

    FP16_DOTS: fp16 queries (the cache's E4M3 keys and values then convert to fp16, see
    FP8_KV_FP16_DOTS), pre-scaled in fp32 first so that a large query cannot overflow fp16's
    range where bf16's would hold it.
    """
    if FP16_DOTS:  # a constexpr: one branch is compiled, so the two may return other types
        return (q.to(tl.float32) * qk_scale).to(tl.float16), 1.0
    else:
        return q, qk_scale


@triton.jit
def _values_operand(v, key_valid, dtype):
    """A decode tile's values [BLOCK_N, HEAD_DIM] as the P @ V dot takes them.

    An FP8 cache's values are converted here, in the layout they were loaded in, and masked
    once more: the `where` keeps Triton from moving the conversion after the shared-memory
    copy into the dot's operand layout, where the values' transpose (the dot reduces over
    keys, the cache is contiguous over head_dim) has no 8-bit ldmatrix and becomes one
    shared-memory byte load per element (128 a thread per tile at BLOCK_N 128). Converted
    first, the 16-bit values take the transposing ldmatrix as a 16-bit cache's do.
    """
    if v.dtype.is_fp8():  # resolved at compile time: one branch is compiled
        return tl.where(key_valid[:, None], v.to(dtype), 0.0).to(dtype)
    else:  # a 16-bit cache's tile, untouched
        return v


@triton.jit
def _online_softmax_step(
    q, k, v, allowed, bias, m_i, l_i, acc, qk_scale,
    USE_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold one tile of keys into the running (max, sum, acc) of each query row."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    if USE_ALIBI:
        s += bias
    s = tl.where(allowed, s, float("-inf"))
    # m_i starts finite (-1e30), so a row whose keys are all masked never computes inf - inf.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# --------------------------------------------------------------------------------------
# Decode: split-KV (flash-decoding)
# --------------------------------------------------------------------------------------


@triton.jit
def _split_range(seq_len, sliding_window, min_tiles,
                 BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr):
    """(first key, first tile, tiles per split, splits with keys) of one sequence's context.

    Every program of a sequence computes the same, so they agree on which splits hold keys
    and how many of them count towards the merge.
    """
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - sliding_window, 0)
    first_tile = kv_lo // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile  # >= 1: the query's own key is there
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), min_tiles)
    return kv_lo, first_tile, num_tiles, tiles_per_split, tl.cdiv(num_tiles, tiles_per_split)


@triton.jit
def _merge_partials(out_rows, part_m_ptr, part_l_ptr, part_acc_ptr, part, num_active, row_valid,
                    dims, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    NUM_SPLITS: tl.constexpr):
    """Write the output rows of one (sequence, KV head) from the partials of its first
    num_active splits: sum(acc * w) / sum(l * w), w = exp2(m - max m).

    Other programs wrote most partials, so they are read from L2 (.cg: L1 is not coherent
    across SMs), and in split order, so the result does not depend on which program merges.
    The loops unroll over NUM_SPLITS, so the loads of all splits can be in flight together.
    """
    # The rows of split s, as tl.where: the interpreter makes `row_valid & scalar` int32.
    m_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        valid = tl.where(num_active > s, row_valid, False)
        m = tl.load(part_m_ptr + part + s, mask=valid, other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, m)
    m_max = tl.where(row_valid, m_max, 0.0)  # padding rows: no -inf - -inf
    num = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        valid = tl.where(num_active > s, row_valid, False)
        m = tl.load(part_m_ptr + part + s, mask=valid, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_l_ptr + part + s, mask=valid, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_acc_ptr + (part + s)[:, None] * HEAD_DIM + dims[None, :],
                      mask=valid[:, None], other=0.0, cache_modifier=".cg")
        weight = tl.exp2(m - m_max)
        num += acc * weight[:, None]
        den += l * weight
    out = num / tl.where(row_valid, den, 1.0)[:, None]
    tl.store(out_rows, out.to(out_rows.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _prefetch_first_tile(cache_ptr, table_row, seq_len, split, sliding_window, min_tiles,
                         kv_head, stride_c_kv, stride_c_block, stride_c_offset, stride_c_head,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         USE_WINDOW: tl.constexpr):
    """Ask L2 for the K and V rows of this split's first key tile (kernels/triton_pdl.py:
    before the PDL wait; positions without a key ask for block 0's rows, a harmless read)."""
    kv_lo, first_tile, num_tiles, tiles_per_split, num_active = _split_range(
        seq_len, sliding_window, min_tiles, BLOCK_N, NUM_SPLITS, USE_WINDOW)
    if split < num_active:
        k_pos = (first_tile + split * tiles_per_split) * BLOCK_N + tl.arange(0, BLOCK_N)
        blocks = _tile_blocks(table_row, k_pos, kv_lo, seq_len, BLOCK_SIZE)
        rows = cache_ptr + _block_rows(blocks, k_pos, kv_head, stride_c_block,
                                       stride_c_offset, stride_c_head, BLOCK_SIZE)
        row_bytes: tl.constexpr = HEAD_DIM * cache_ptr.dtype.element_ty.primitive_bitwidth // 8
        triton_pdl.prefetch_l2(rows, row_bytes)
        triton_pdl.prefetch_l2(rows + stride_c_kv, row_bytes)


# The arguments that change from step to step (the batch's block-table width, the tiles a
# split takes) are not specialized: the JIT would otherwise compile a kernel per class of
# their values (1, a multiple of 16, other), each first met mid-run, where its compile (or
# load from Triton's cache) stalls the host. Nothing in the kernels gains from the hints.
STEP_ARGS = ("stride_bt", "min_tiles")


@triton.jit(do_not_specialize=STEP_ARGS)
def _paged_decode_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, count_ptr,
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, alibi_ptr, order_ptr,
    qk_scale, sliding_window, num_heads, min_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_block, stride_c_offset, stride_c_head, stride_bt,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16, the smallest M a tensor-core dot takes
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    L2_PREFETCH: tl.constexpr,
    ORDERED: tl.constexpr,
):
    seq = tl.program_id(0)  # decode: token index == sequence index
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if L2_PREFETCH:  # (with PDL) the step's inputs, and the cache but for the newest key
        _prefetch_first_tile(cache_ptr, block_tables_ptr + seq * stride_bt,
                             tl.load(seq_lens_ptr + seq), split, sliding_window, min_tiles,
                             kv_head, stride_c_kv, stride_c_block, stride_c_offset,
                             stride_c_head, BLOCK_SIZE, HEAD_DIM, BLOCK_N, NUM_SPLITS,
                             USE_WINDOW)
    if PDL:  # before any read of an earlier kernel's output, any write (kernels/triton_pdl.py)
        gdc_wait()
        gdc_launch_dependents()
    if ORDERED:  # longest context first (DECODE_ORDER; never with L2_PREFETCH). After the
        # wait: the first layer's sort is the kernel right before this one.
        # The grid's n-th (sequence, KV head) program, in the order the GPU starts them,
        # takes the n // heads-th longest sequence, every KV head of it in turn.
        heads_n = tl.num_programs(1)
        nth = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
        seq = tl.load(order_ptr + nth // heads_n).to(tl.int32)
        kv_head = nth % heads_n
    seq_len = tl.load(seq_lens_ptr + seq)
    table_row = block_tables_ptr + seq * stride_bt
    kv_lo, first_tile, num_tiles, tiles_per_split, num_active = _split_range(
        seq_len, sliding_window, min_tiles, BLOCK_N, NUM_SPLITS, USE_WINDOW)
    if split >= num_active:
        return  # past this sequence's context: neither counted nor merged

    rows = tl.arange(0, GROUP_PAD)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None], other=0.0,
    )
    q, qk_scale = _dot_operands(q, qk_scale, FP16_DOTS)

    q_pos = seq_len - 1
    # This split's share of the key tiles [tile_lo, tile_hi).
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    slopes = tl.zeros([GROUP_PAD], tl.float32)
    if USE_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_valid, other=0.0) * _LOG2E_K

    m_i = tl.full([GROUP_PAD], -1e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if PREFETCH:
        blocks = _tile_blocks(table_row, tile_lo * BLOCK_N + tl.arange(0, BLOCK_N), kv_lo,
                              seq_len, BLOCK_SIZE)
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_mask = (k_pos >= kv_lo) & (k_pos < seq_len)
        if PREFETCH:
            # The block ids of tile i + 1 are loaded while tile i is: a key tile's address
            # then comes from the loop's carried values, not from a load of the same
            # iteration, and the JIT's pipeliner keeps num_stages - 1 tiles in flight in
            # shared memory (with the block-table load in the iteration it keeps one, and
            # issues the next tile's copy only after the current one's dots).
            offs = _block_offsets(blocks, k_pos, kv_head, stride_c_block, stride_c_offset,
                                  stride_c_head, BLOCK_SIZE, HEAD_DIM)
            blocks = _tile_blocks(table_row, k_pos + BLOCK_N, kv_lo, seq_len, BLOCK_SIZE)
        else:
            offs = _kv_tile_offsets(
                table_row, k_pos, kv_mask, kv_head,
                stride_c_block, stride_c_offset, stride_c_head, BLOCK_SIZE, HEAD_DIM,
            )
        k = tl.load(cache_ptr + offs, mask=kv_mask[:, None], other=0.0)
        v = _values_operand(tl.load(cache_ptr + stride_c_kv + offs, mask=kv_mask[:, None],
                                    other=0.0), kv_mask, q.dtype)
        bias = slopes[:, None] * (k_pos - q_pos).to(tl.float32)[None, :]
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, kv_mask[None, :], bias, m_i, l_i, acc, qk_scale, USE_ALIBI, DOT_PRECISION,
        )

    out_rows = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    if num_active == 1:  # the whole context in this program: no partials, no count
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        part = (seq * num_heads + heads) * NUM_SPLITS  # split 0's partial of each row
        tl.store(part_m_ptr + part + split, m_i, mask=row_valid)
        tl.store(part_l_ptr + part + split, l_i, mask=row_valid)
        tl.store(part_acc_ptr + (part + split)[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_valid[:, None])
        # Every thread's partials are stored before one thread counts this split done
        # (release). Exactly the num_active splits with keys count, so the one that sees
        # num_active - 1 is the last: it merges, then resets the counter for the next launch.
        tl.debug_barrier()
        count = count_ptr + seq * tl.num_programs(1) + kv_head
        done = tl.atomic_add(count, 1, sem="acq_rel")
        if done == num_active - 1:
            _merge_partials(out_rows, part_m_ptr, part_l_ptr, part_acc_ptr, part, num_active,
                            row_valid, dims, GROUP_PAD, HEAD_DIM, NUM_SPLITS)
            tl.atomic_xchg(count, 0)


# --------------------------------------------------------------------------------------
# Prefill / chunked prefill / mixed batches
# --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=STEP_ARGS[:1])
def _paged_prefill_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, alibi_ptr,
    qk_scale, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_block, stride_c_offset, stride_c_head, stride_bt,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per tile; the tile has BLOCK_Q * GROUP_PAD rows
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys already in the cache before this step's tokens

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD  # query token within the sequence
    head_in_group = rows % GROUP_PAD
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    heads = kv_head * GROUP + head_in_group
    q_pos = context_len + q_idx
    dims = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + q_idx).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)
    q, qk_scale = _dot_operands(q, qk_scale, FP16_DOTS)

    # Keys this tile can see: up to its last query's position, from its first query's window.
    kv_hi = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)

    slopes = tl.zeros([BLOCK_M], tl.float32)
    if USE_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_valid, other=0.0) * _LOG2E_K

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    first = kv_lo // BLOCK_N * BLOCK_N
    if PREFETCH:
        blocks = _tile_blocks(table_row, first + tl.arange(0, BLOCK_N), 0, kv_hi, BLOCK_SIZE)
    for start in range(first, kv_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        kv_mask = k_pos < kv_hi
        if PREFETCH:  # the next tile's block ids a step ahead, as decode does
            offs = _block_offsets(blocks, k_pos, kv_head, stride_c_block, stride_c_offset,
                                  stride_c_head, BLOCK_SIZE, HEAD_DIM)
            blocks = _tile_blocks(table_row, k_pos + BLOCK_N, 0, kv_hi, BLOCK_SIZE)
        else:
            offs = _kv_tile_offsets(
                table_row, k_pos, kv_mask, kv_head,
                stride_c_block, stride_c_offset, stride_c_head, BLOCK_SIZE, HEAD_DIM,
            )
        k = tl.load(cache_ptr + offs, mask=kv_mask[:, None], other=0.0)
        v = tl.load(cache_ptr + stride_c_kv + offs, mask=kv_mask[:, None], other=0.0)
        rel = k_pos[None, :] - q_pos[:, None]
        allowed = (rel <= 0) & kv_mask[None, :]
        if USE_WINDOW:
            allowed &= rel > -sliding_window
        bias = slopes[:, None] * rel.to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, allowed, bias, m_i, l_i, acc, qk_scale, USE_ALIBI, DOT_PRECISION,
        )

    out = acc / tl.where(row_valid, l_i, 1.0)[:, None]  # padding rows have l_i == 0
    o_offs = (q_start + q_idx).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any value works
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many slices to cut each context into for decode.

    Enough programs to fill the GPU twice over, but never a slice shorter than
    MIN_SPLIT_TOKENS keys (the merge would cost more than it saves).
    """
    by_length = triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS)
    by_occupancy = triton.cdiv(2 * _num_sms(device), max(1, num_seqs * num_kv_heads))
    if _balances(num_seqs, num_kv_heads, device):
        return max(1, min(MAX_SPLITS, triton.cdiv(max_seq_len, BALANCE_SPLIT_TOKENS)))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


def _balances(num_seqs: int, num_kv_heads: int, device: torch.device) -> bool:
    """Policy "balance" and a batch that fills the GPU twice over without splitting."""
    return DECODE_SPLIT == "balance" and num_seqs * num_kv_heads >= 2 * _num_sms(device)


def decode_num_stages(element_size: int) -> int:
    """Pipeline stages of the decode kernel over a cache of this element size."""
    if DECODE_NUM_STAGES is not None:
        return DECODE_NUM_STAGES
    return 3 if element_size == 1 or DECODE_PREFETCH else 2  # prefetch: two tiles in flight


def decode_block_n(head_dim: int, element_size: int) -> int:
    """Keys per inner step of the decode kernel: DECODE_BLOCK_N, halved until the K and V
    tiles of every stage fit in DECODE_TILE_BYTES (bf16 or FP8 at head_dim 128: 128 keys;
    fp32 at 128 or bf16 at 256: 64)."""
    block_n = DECODE_BLOCK_N
    stages = decode_num_stages(element_size)
    if DECODE_PREFETCH:  # the pipeliner's buffers: one per stage ahead
        stages = max(1, stages - 1)
    while block_n > 16 and 2 * stages * block_n * head_dim * element_size > DECODE_TILE_BYTES:
        block_n //= 2
    return block_n


def min_split_tiles(num_seqs: int, num_kv_heads: int, device: torch.device,
                    block_n: int) -> int:
    """The fewest key tiles a decode split takes: BALANCE_SPLIT_TOKENS' worth when balancing,
    else one (a few sequences' contexts are spread over as many programs as asked)."""
    if _balances(num_seqs, num_kv_heads, device):
        return max(1, BALANCE_SPLIT_TOKENS // block_n)
    return 1


def _check_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionInputMetadata,
    sliding_window: int | None,
    alibi: torch.Tensor | None,
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must have shape [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, cache_head_dim = kv_cache.shape[-2:]
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype must be float32, float16 or bfloat16, got {query.dtype}")
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} does not match kv_cache head_dim {cache_head_dim}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton kernels, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_dim) dimension")
    if meta.block_tables.dim() != 2 or meta.block_tables.stride(-1) != 1:
        raise ValueError("meta.block_tables must be a 2-D tensor contiguous in its last dimension")
    if num_tokens != sum(meta.query_lens_host):
        raise ValueError(
            f"query has {num_tokens} tokens but the metadata's query lengths sum to {sum(meta.query_lens_host)}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if alibi is not None and tuple(alibi.shape) != (num_heads,):
        raise ValueError(f"alibi slopes must have shape ({num_heads},), got {tuple(alibi.shape)}")


def triton_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: PagedAttentionInputMetadata,
    scale: float,
    sliding_window: int | None = None,
    alibi: torch.Tensor | None = None,  # [num_heads] slopes
    *,
    num_splits: int | None = None,  # decode only; None = choose_num_splits (fix it for CUDA graphs)
    out: torch.Tensor | None = None,  # written in place and returned; shaped like query
) -> torch.Tensor:
    """Causal attention of each query token over its sequence's cached context.

    Same contract as pagedllm.kernels.reference.paged_attention; the step's K/V must already
    be in the cache (triton_write_kv_cache).
    """
    _check_inputs(query, kv_cache, meta, sliding_window, alibi)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be a {query.dtype} tensor of shape {tuple(query.shape)} contiguous in its last "
            f"dimension, got {out.dtype} {tuple(out.shape)}"
        )
    if query.shape[0] == 0:
        return out

    num_heads, head_dim = query.shape[1:]
    group = num_heads // kv_cache.shape[3]
    if alibi is not None:
        alibi = alibi.to(device=query.device, dtype=torch.float32).contiguous()
    common = dict(
        qk_scale=scale * LOG2E,
        sliding_window=sliding_window or 0,
        BLOCK_SIZE=kv_cache.shape[2],
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_c_kv=kv_cache.stride(0),
        stride_c_block=kv_cache.stride(1),
        stride_c_offset=kv_cache.stride(2),
        stride_c_head=kv_cache.stride(3),
        stride_bt=meta.block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        USE_WINDOW=sliding_window is not None,
        USE_ALIBI=alibi is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        FP16_DOTS=(FP8_KV_FP16_DOTS and kv_cache.dtype == torch.float8_e4m3fn
                   and query.dtype != torch.float32),
    )
    alibi_arg = alibi if alibi is not None else meta.seq_lens  # any tensor; never read

    # Decode indexes sequences by token; a sequence without a query token breaks that.
    if meta.max_query_len == 1 and query.shape[0] == meta.num_seqs:
        _decode(out, query, kv_cache, meta, alibi_arg, num_splits, common)
    else:
        _prefill(out, query, kv_cache, meta, alibi_arg, common)
    return out


def _prefill(out, query, kv_cache, meta, alibi_arg, common) -> None:
    group_pad = triton.next_power_of_2(common["GROUP"])
    block_q = max(PREFILL_BLOCK_M, group_pad) // group_pad
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, block_q), kv_cache.shape[3])
    _paged_prefill_kernel[grid](
        out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, alibi_arg,
        GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=PREFILL_BLOCK_N,
        PREFETCH=PREFILL_PREFETCH, num_warps=PREFILL_NUM_WARPS,
        num_stages=PREFILL_NUM_STAGES + PREFILL_PREFETCH, **common,
    )


def _partial_buffers(num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device):
    """Per-split (max, sum, acc) in fp32; every element is written by the decode kernel."""
    f32 = dict(dtype=torch.float32, device=device)
    return (
        torch.empty(num_seqs, num_heads, num_splits, **f32),
        torch.empty(num_seqs, num_heads, num_splits, **f32),
        torch.empty(num_seqs, num_heads, num_splits, head_dim, **f32),
    )


def _decode(out, query, kv_cache, meta, alibi_arg, num_splits, common) -> None:
    num_seqs = meta.num_seqs
    num_heads = query.shape[1]
    num_kv_heads, head_dim = kv_cache.shape[3:]
    if num_splits is None:
        num_splits = choose_num_splits(meta.max_seq_len, num_seqs, num_kv_heads, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    # One per (sequence, KV head), zero between launches: the merging program resets its own.
    # Passed with one split too: unused there, but the kernel's atomics compile for int32 only.
    count = counters("paged_decode", query.device, num_seqs * num_kv_heads)
    if num_splits == 1:
        part_m = part_l = part_acc = out  # unused: the kernel writes the output directly
    else:
        part_m, part_l, part_acc = _partial_buffers(num_seqs, num_heads, num_splits, head_dim, query.device)

    group_pad = max(16, triton.next_power_of_2(common["GROUP"]))
    # A function of the batch size only, as num_splits is: a CUDA graph replays it fixed.
    block_n = decode_block_n(head_dim, kv_cache.element_size())
    min_tiles = min_split_tiles(num_seqs, num_kv_heads, query.device, block_n)
    # Sequences by context length, longest first: one sort a step (the first layer's),
    # on the device, so a CUDA graph replays it with the step's lengths.
    order = meta.step_cache(("decode_order",), lambda: torch.argsort(
        meta.seq_lens, descending=True)) if DECODE_ORDER else meta.seq_lens
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_m, part_l, part_acc, count,
        query, kv_cache, meta.block_tables, meta.seq_lens, alibi_arg, order,
        num_heads=num_heads, min_tiles=min_tiles, GROUP_PAD=group_pad, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, num_warps=DECODE_NUM_WARPS, PREFETCH=DECODE_PREFETCH,
        L2_PREFETCH=triton_pdl.l2_prefetch(query.device) and not DECODE_ORDER,
        ORDERED=DECODE_ORDER,
        num_stages=decode_num_stages(kv_cache.element_size()), **common,
        **triton_pdl.launch_kwargs(query.device),
    )
