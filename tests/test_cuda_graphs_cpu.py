"""The CPU-checkable parts of the CUDA path: decode-graph buckets, input padding, and that a
padded static-buffer forward computes the same rows as the plain eager forward; plus the
fused Triton layer kernels against the torch layers (under the interpreter on CPU)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.layers import dispatch
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.layers.norms import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.loader import initialize_dummy_weights
from pagedllm.models.registry import build_model
from pagedllm.models.device_map import DeviceMap
from pagedllm.worker.cuda_graphs import (
    MAX_GRAPH_BATCH_SIZE,
    PAD_SEQ_LEN,
    PAD_SLOT,
    DecodeCUDAGraphs,
    choose_bucket,
    fits_decode_graph,
    graph_batch_sizes,
    graphs_supported,
    pad_decode_batch,
)

triton_ops = pytest.importorskip("pagedllm.kernels.triton_ops") if os.environ.get(
    "TRITON_INTERPRET") == "1" else None
needs_interpreter = pytest.mark.skipif(triton_ops is None, reason="needs TRITON_INTERPRET=1")

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # a device object only; nothing is allocated on it


# ------------------------------------------------------------------------- buckets


def test_batch_sizes_follow_the_bucket_ladder():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16)]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_num_seqs is always a bucket
    assert graph_batch_sizes(100)[-3:] == [80, 96, 100]
    assert graph_batch_sizes(10_000)[-1] == MAX_GRAPH_BATCH_SIZE


@pytest.mark.parametrize("value, expected", [("1024", "1024"), ("0", "must be at least 1")])
def test_the_graph_cap_moves_with_its_variable(value, expected):
    code = ("from pagedllm.worker.cuda_graphs import graph_batch_sizes\n"
            "print(graph_batch_sizes(10_000)[-1])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PAGEDLLM_MAX_GRAPH_BATCH": value})
    assert expected in result.stdout + result.stderr


def test_batch_sizes_reject_a_bad_limit():
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1, got 0"):
        graph_batch_sizes(0)


@pytest.mark.parametrize("max_num_seqs", [1, 7, 32, 100, 256])
def test_choose_bucket_is_the_smallest_that_fits(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        bucket = choose_bucket(sizes, n)
        assert bucket >= n
        assert all(s < n for s in sizes if s < bucket)
    assert choose_bucket(sizes, sizes[-1] + 1) is None


def test_choose_bucket_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        choose_bucket([1, 2], 0)


def test_only_decode_steps_that_fit_replay_a_graph():
    assert fits_decode_graph(max_query_len=1, num_tokens=5, num_seqs=5, max_batch_size=8)
    assert fits_decode_graph(1, 8, 8, 8)
    assert not fits_decode_graph(1, 9, 9, 8)  # larger than the largest bucket
    assert not fits_decode_graph(2, 6, 5, 8)  # a prompt chunk in the batch
    assert not fits_decode_graph(0, 0, 0, 8)  # nothing to run


def test_graphs_need_every_layer_on_cuda_and_no_enforce_eager():
    assert graphs_supported([CUDA] * 4, enforce_eager=False)
    assert graphs_supported([CUDA, torch.device("cuda", 1)], enforce_eager=False)
    assert not graphs_supported([CUDA] * 4, enforce_eager=True)
    assert not graphs_supported([CPU] * 4, enforce_eager=False)
    assert not graphs_supported([CUDA, CUDA, CPU], enforce_eager=False)


# ------------------------------------------------------------------------- padding


def test_pad_decode_batch_pads_rows_that_write_nothing():
    b = pad_decode_batch([11, 12], [5, 40], [101, 202], [6, 41], [[3], [7, 8, 9]], bucket=4)
    assert b.num_seqs == 2
    assert b.input_ids.tolist() == [11, 12, 0, 0]
    assert b.positions.tolist() == [5, 40, 0, 0]
    assert b.slot_mapping.tolist() == [101, 202, PAD_SLOT, PAD_SLOT]
    assert b.seq_lens.tolist() == [6, 41, PAD_SEQ_LEN, PAD_SEQ_LEN]
    assert b.block_tables.tolist() == [[3, 0, 0], [7, 8, 9], [0, 0, 0], [0, 0, 0]]
    assert b.input_ids.dtype == b.slot_mapping.dtype == torch.int64
    assert b.seq_lens.dtype == b.block_tables.dtype == torch.int32


def test_pad_decode_batch_rejects_bad_inputs():
    with pytest.raises(ValueError, match="does not fit a graph of 2"):
        pad_decode_batch([1, 2, 3], [0, 0, 0], [0, 1, 2], [1, 1, 1], [[0], [0], [0]], bucket=2)
    with pytest.raises(ValueError, match="disagree on the batch size: 2 ids, 1 positions"):
        pad_decode_batch([1, 2], [0], [0, 1], [1, 1], [[0], [0]], bucket=2)


# ------------------------------------------- static buffers vs the eager forward (CPU)


def tiny_llama():
    config = ModelConfig(
        architecture="llama", vocab_size=97, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        max_position_embeddings=64,
    )
    model = build_model(config)
    initialize_dummy_weights(model, seed=3)
    return model.eval(), config


def make_graphs(model, c, max_num_seqs, max_model_len, block_size=4, spec=None):
    device_map = (DeviceMap.parse(spec, c.num_hidden_layers) if spec
                  else DeviceMap.single(CPU, c.num_hidden_layers))
    return DecodeCUDAGraphs(model, device_map, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len, block_size=block_size,
                            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                            dtype=torch.float32)


@needs_interpreter
@pytest.mark.parametrize("spec", [None, "cpu:1,cpu:1"])
def test_padded_static_forward_matches_the_eager_rows_and_cache(spec):
    """What a graph replays, run eagerly through the Triton attention (which, unlike the
    reference, reads lengths from device tensors only): same hidden rows as the plain eager
    forward, same cache, and the padding row writes nothing."""
    with dispatch.force("triton"):  # every layer through Triton, in its interpreter
        model, c = tiny_llama()
    block_size, num_blocks = 4, 12
    shape = (2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(shape, generator=g) for _ in range(c.num_hidden_layers)]
    # Three sequences decoding at positions 6, 9 and 2, their blocks scattered.
    tables = [[5, 1], [0, 7, 3], [10]]
    seq_lens = [7, 10, 3]
    positions = [n - 1 for n in seq_lens]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    ids = [4, 50, 96]

    eager_caches = [x.clone() for x in caches]
    meta = PagedAttentionInputMetadata.build(positions, slots, [1, 1, 1], seq_lens, tables)
    with torch.inference_mode():
        expected = model(torch.tensor(ids), eager_caches, {CPU: meta})

    # A long max_model_len: the graph's fixed split count differs from the eager choice.
    graphs = make_graphs(model, c, max_num_seqs=8, max_model_len=1024, block_size=block_size,
                         spec=spec)
    assert graphs.num_splits(4) > 1
    static_caches = [x.clone() for x in caches]
    bucket = graphs.load_inputs(ids, positions, slots, seq_lens, tables)
    assert bucket == 4  # three sequences ride in the bucket of four
    with torch.inference_mode():
        got = graphs._forward(bucket, static_caches)

    assert got.shape == (4, c.hidden_size)
    assert len(graphs.states) == (1 if spec else 0)  # a second group starts from static state
    torch.testing.assert_close(got[:3], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()  # the padding row reads finite values
    # Only the three real tokens were written: every other slot still holds the random fill
    # bit for bit (the padding row's PAD_SLOT writes nothing). The written K/V rows come from a
    # 4-row GEMM here and a 3-row one in the eager forward, which need not round alike on every
    # BLAS (AVX2 vs AVX-512 kernels): fp32 values of order 1 after a 64-term dot product agree
    # to a few ulps (~1e-6), so 1e-5 is tight enough to catch a wrong or misplaced row.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    written = written.view(num_blocks, block_size)
    for start, a, b in zip(caches, static_caches, eager_caches):
        assert torch.equal(a[:, ~written], start[:, ~written])
        assert torch.equal(b[:, ~written], start[:, ~written])
        torch.testing.assert_close(a[:, written], b[:, written], rtol=1e-5, atol=1e-5)
        assert not torch.equal(a[:, written], start[:, written])  # the real tokens were written


def test_graph_metadata_fixes_the_split_count_per_bucket():
    model, c = tiny_llama()
    graphs = make_graphs(model, c, max_num_seqs=4, max_model_len=40)
    meta = graphs.metadata(2)
    assert meta.num_splits == graphs.num_splits(2) >= 1
    assert meta.block_tables.shape == (2, 10)  # room for max_model_len / block_size blocks
    assert meta.query_start_loc.tolist() == [0, 1, 2]
    assert meta.is_decode_only and meta.num_seqs == 2


def test_load_inputs_rejects_a_table_longer_than_max_model_len():
    model, c = tiny_llama()
    graphs = make_graphs(model, c, max_num_seqs=2, max_model_len=8)
    with pytest.raises(ValueError, match="block table of 3 blocks is longer than max_model_len"):
        graphs.load_inputs([1], [9], [9], [10], [[0, 1, 2]])


# ------------------------------------------ fused layer kernels (Triton interpreter on CPU)



@needs_interpreter
def test_rotary_cos_sin_cache_matches_the_torch_rotation():
    rotary = RotaryEmbedding(head_dim=32, max_position=64, theta=10000.0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 32, generator=g)
    k = torch.randn(5, 2, 32, generator=g)
    positions = torch.tensor([0, 3, 17, 40, 63])
    want_q, want_k = rotary(positions, q.clone(), k.clone())  # the CPU path (may rotate in place)
    got_q, got_k = q.clone(), k.clone()
    triton_ops.triton_rotary_embedding(positions, got_q, got_k, rotary.cos_sin_cache(CPU))
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_rms_norm_kernel_matches_the_layer_with_and_without_residual():
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    x, r = torch.randn(6, 48), torch.randn(6, 48)
    torch.testing.assert_close(triton_ops.triton_rms_norm(x, norm.weight, 1e-5), norm(x))
    got, got_res = triton_ops.triton_rms_norm(x, norm.weight, 1e-5, r)
    want, want_res = norm(x, r)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_res, want_res)


def test_memory_reserve_covers_the_pool_and_every_graph():
    model, c = tiny_llama()
    graphs = make_graphs(model, c, max_num_seqs=32, max_model_len=64)
    per_graph = graphs.memory_reserve(CPU, 0) // len(graphs.sizes)
    assert per_graph > 0
    assert graphs.memory_reserve(CPU, 5 << 20) == (5 << 20) + per_graph * len(graphs.sizes)
    fewer = make_graphs(model, c, max_num_seqs=4, max_model_len=64)
    assert fewer.memory_reserve(CPU, 0) < graphs.memory_reserve(CPU, 0)  # fewer buckets, less memory


def test_load_inputs_takes_input_ids_already_on_the_device():
    """Multi-step feeds the last step's samples (a tensor) as the next input ids."""
    model, c = tiny_llama()
    graphs = make_graphs(model, c, max_num_seqs=4, max_model_len=16)
    graphs.load_inputs([7, 8, 9], [0, 0, 0], [0, 4, 8], [1, 1, 1], [[0], [1], [2]])
    bucket = graphs.load_inputs(torch.tensor([5, 6]), [1, 1], [1, 5], [2, 2], [[0], [1]])
    assert bucket == 2
    assert graphs.input_ids[:2].tolist() == [5, 6]
    assert graphs.static_metadata[CPU].slot_mapping[:2].tolist() == [1, 5]


def test_a_windows_block_tables_are_copied_in_once():
    """The steps of a decode window share their padded block tables (FlatBatch): the
    static buffer takes them at the first step only, and again after other tables."""
    from pagedllm.worker.model_runner import FlatBatch

    model, c = tiny_llama()
    graphs = make_graphs(model, c, max_num_seqs=4, max_model_len=16)
    static = graphs.static_metadata[CPU].block_tables
    window = FlatBatch(input_ids=[7, 8], positions=[1, 5], slot_mapping=[1, 9], query_lens=[1, 1],
                       seq_lens=[2, 6], block_tables=[[0], [2, 3]], logits_indices=[0, 1])

    def load(b):
        return graphs.load_inputs(b.input_ids, b.positions, b.slot_mapping, b.seq_lens,
                                  b.block_tables, b.padded_block_tables)

    load(window)
    assert static[:2, :2].tolist() == [[0, 0], [2, 3]]
    static[0, 0] = 42  # what a second copy would overwrite
    step = window.next_decode_step(block_size=4)
    assert step.slot_mapping == [2, 14] and step.seq_lens == [3, 7]
    load(step)
    assert static[0, 0].item() == 42
    load(FlatBatch(input_ids=[1], positions=[0], slot_mapping=[4], query_lens=[1], seq_lens=[1],
                   block_tables=[[1]], logits_indices=[0]))
    load(step.next_decode_step(block_size=4))
    assert static[:2, :2].tolist() == [[0, 0], [2, 3]]
    split = window.as_decode_rows()
    assert split.padded is not window.padded  # other tables: padded anew
