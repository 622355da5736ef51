"""Structured output's token bitmask applied to the logits in place, in one pass.

The mask is llguidance's packed form: int32 words, bit t % 32 of word t // 32 set = token t
allowed. Each program covers one constrained row's block of the vocabulary: it reads the
words its tokens fall in and writes -inf over the refused ones (ids past the mask's
32 * words are refused too); other rows are not touched. The torch version
(layers/token_bitmask.py) unpacks the mask into a bool matrix, pads it to the vocabulary
and goes through an index_select / masked_fill / index_copy of the rows: several launches
and passes where this is one. Runs under TRITON_INTERPRET=1 on the CPU for the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(logits_ptr, logits_stride, mask_ptr, mask_stride, rows_ptr,
                          vocab, num_bits, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    # ids past the mask read a zero word: refused
    words = tl.load(mask_ptr + i * mask_stride + offs // 32, mask=in_vocab & (offs < num_bits),
                    other=0)
    refused = in_vocab & (((words >> (offs % 32)) & 1) == 0)
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + offs, neg_inf, mask=refused)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t % 32 of bitmask[i, t // 32] is clear
    or t >= 32 * bitmask.shape[1]. logits [n, vocab] (rows contiguous), bitmask int32
    [len(rows), words] and rows int64, all on logits' device."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows, got shape "
                         f"{tuple(logits.shape)} and strides {logits.stride()}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != rows.numel():
        raise ValueError(f"bitmask must be int32 [len(rows)={rows.numel()}, words], got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.numel() == 0:
        return
    bitmask = bitmask.contiguous()
    vocab = logits.shape[1]
    grid = (rows.numel(), triton.cdiv(vocab, BLOCK))
    _apply_bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), rows,
                                vocab, bitmask.shape[1] * 32, BLOCK=BLOCK)
