"""The Triton LoRA pair (kernels/triton_lora.py) against the torch path of layers/lora.py,
compiled on CUDA, in the interpreter on the CPU: rows of several adapter slots and of the
base model mixed, one shrink and one expand for a fused projection's parts, ranks padded
past the adapter's own, row tiles spanning several tiles of one slot, K split over
programs; and a decode graph's LoRA forward (static row buffers) against the eager one."""
from __future__ import annotations

import pytest
import torch

from tests.triton_setup import DEVICE, skip_unless_runnable

from pagedllm.kernels import triton_lora  # noqa: E402
from pagedllm.kernels.triton_lora import lora_expand, lora_shrink  # noqa: E402
from pagedllm.layers import lora as lora_layer  # noqa: E402
from pagedllm.layers.lora import LoRALayer, LoRARows, lora_rows, segments  # noqa: E402
from pagedllm.lora.weights import JOINT_MAX_SHARE  # noqa: E402

skip_unless_runnable(triton_lora._shrink_kernel)


def test_segments_sort_rows_by_slot():
    perm, starts = segments(torch.tensor([2, -1, 0, 2, -1, 0]), 4)
    assert perm.tolist() == [1, 4, 2, 5, 0, 3]
    assert starts.tolist() == [2, 4, 4, 6, 6]  # slot 1 and 3: no rows


@pytest.mark.parametrize("k,parts,num_rows", [(40, [24, 8, 8], 8), (600, [40], 150),
                                              (48, [16, 32], 150)])
def test_shrink_expand_match_the_torch_path(k, parts, num_rows):
    g = torch.Generator().manual_seed(0)
    num_slots, rank = 3, 6  # rank 6: padded to 16 in the kernels
    layer = LoRALayer.of_parts([torch.randn(num_slots, rank, k, generator=g) for _ in parts],
                               [torch.randn(num_slots, n, rank, generator=g) for n in parts])
    layer.a_stacked, layer.b_stacked = layer.a_stacked.to(DEVICE), layer.b_stacked.to(DEVICE)
    layer.lora_a = list(layer.a_stacked.split(rank, dim=1))
    layer.lora_b = list(layer.b_stacked.split(parts, dim=1))
    layer.active = [[True] * len(parts) for _ in range(num_slots)]
    if len(parts) > 1:  # a part slot 1's adapter leaves out: zero, inactive
        layer.lora_a[1][1].zero_(), layer.lora_b[1][1].zero_()
        layer.active[1][1] = False
    # every slot and the base mixed; past row 24 mostly slot 0 (two row tiles of 64)
    slots = torch.tensor([(i * 7) % 4 - 1 if i < 24 or i % 9 == 0 else 0
                          for i in range(num_rows)])
    x = torch.randn(num_rows, k, generator=g).to(DEVICE)
    base = torch.randn(num_rows, sum(parts), generator=g).to(DEVICE)
    rows = LoRARows.build(slots)
    use_triton, lora_layer.USE_TRITON = lora_layer.USE_TRITON, False
    try:
        with lora_rows(rows):
            want = layer(x.cpu(), base.clone().cpu()) if DEVICE == "cpu" else \
                layer(x, base.clone())
    finally:
        lora_layer.USE_TRITON = use_triton
    perm, starts = rows.segments_on(torch.device(DEVICE), num_slots)
    got = base.clone()
    y = lora_shrink(x, layer.a_stacked, perm, starts, len(parts))
    lora_expand(got, y, layer.b_stacked, perm, starts, layer.part_ends)
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-4)
    base_rows = slots < 0
    assert torch.equal(got[base_rows.to(DEVICE)], base[base_rows.to(DEVICE)])


@pytest.mark.parametrize("parts", [[24, 8, 8], [40], [16, 32]])
def test_expand_of_every_slots_ranks_matches_the_torch_path(parts):
    """One row whose y holds every slot's x A^T side by side (the joint GEMV's extra
    columns, rank 6 unpadded): the expand picks the row's own slot's ranks."""
    g = torch.Generator().manual_seed(1)
    num_slots, rank, k = 3, 6, 40
    layer = LoRALayer.of_parts([torch.randn(num_slots, rank, k, generator=g) for _ in parts],
                               [torch.randn(num_slots, n, rank, generator=g) for n in parts])
    layer.active = [[True] * len(parts) for _ in range(num_slots)]
    x = torch.randn(1, k, generator=g)
    base = torch.randn(1, sum(parts), generator=g)
    y = x @ layer.a_stacked.reshape(-1, k).T  # [1, slots * parts * rank], slot-major
    for slot in range(num_slots):
        rows = LoRARows.build([slot])
        use_triton, lora_layer.USE_TRITON = lora_layer.USE_TRITON, False
        try:
            with lora_rows(rows):
                want = layer(x, base.clone())
        finally:
            lora_layer.USE_TRITON = use_triton
        perm, starts = (t.to(DEVICE) for t in rows.segments_on(torch.device("cpu"), num_slots))
        got = base.clone().to(DEVICE)
        lora_expand(got, y.to(DEVICE), layer.b_stacked.to(DEVICE), perm, starts,
                    layer.part_ends, y_per_slot=True)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_expand_refuses_part_ends_that_do_not_cover_the_columns():
    b = torch.zeros(2, 32, 16)
    with pytest.raises(ValueError, match=r"part ends \[16\] do not split 32 columns"):
        lora_expand(torch.zeros(4, 32), torch.zeros(4, 16), b, torch.zeros(4, dtype=torch.long),
                    torch.zeros(3, dtype=torch.long), [16])


def _tiny_model_with_adapters(joint_share: float = JOINT_MAX_SHARE):
    """A tiny Llama on the Triton backend with adapters in slots 0 and 2 of 3, the joint
    weights made where `joint_share` allows."""
    from pagedllm.layers import dispatch
    from pagedllm.lora import LoRAWeights, weights as lora_weights
    from tests.test_cuda_graphs_cpu import tiny_llama

    with dispatch.force("triton"):
        model, c = tiny_llama()
    share, lora_weights.JOINT_MAX_SHARE = lora_weights.JOINT_MAX_SHARE, joint_share
    try:
        weights = LoRAWeights(model, 3, 8)
    finally:
        lora_weights.JOINT_MAX_SHARE = share
    g = torch.Generator().manual_seed(1)
    for layer in weights.layers.values():
        for slot in (0, 2):  # slot 1 stays empty: its rows must get the base output
            for a, b in zip(layer.lora_a, layer.lora_b):
                a[slot].copy_(torch.randn(a[slot].shape, generator=g) * 0.3)
                b[slot].copy_(torch.randn(b[slot].shape, generator=g) * 0.3)
            layer.active[slot] = [True] * len(layer.lora_a)
    return model, c, weights


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU half of the graphs == eager check "
                                            "(tests/gpu/test_lora.py replays real graphs)")
def test_graph_lora_forward_matches_the_eager_torch_path():
    """What a LoRA decode graph replays, run eagerly over the static buffers (rows sorted
    into StaticLoRARows, the Triton pair on every projection): the same hidden rows as the
    plain eager forward's torch LoRA path, padding rows and base rows included."""
    from pagedllm.kernels.metadata import PagedAttentionInputMetadata
    from tests.test_cuda_graphs_cpu import make_graphs

    model, c, _ = _tiny_model_with_adapters()
    g = torch.Generator().manual_seed(2)
    block_size, num_blocks = 4, 12
    shape = (2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    caches = [torch.randn(shape, generator=g) for _ in range(c.num_hidden_layers)]
    tables, seq_lens, ids = [[5, 1], [0, 7, 3], [10], [2, 4]], [7, 10, 3, 6], [4, 50, 96, 7]
    lora_slots = torch.tensor([2, -1, 0, 2])
    positions = [n - 1 for n in seq_lens]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions)]
    meta = PagedAttentionInputMetadata.build(positions, slots, [1] * 4, seq_lens, tables)
    cpu = torch.device("cpu")
    with torch.inference_mode(), lora_rows(lora_slots):
        expected = model(torch.tensor(ids), [x.clone() for x in caches], {cpu: meta})
    with torch.inference_mode():
        base = model(torch.tensor(ids), [x.clone() for x in caches], {cpu: meta})
    graphs = make_graphs(model, c, max_num_seqs=8, max_model_len=64, block_size=block_size)
    graphs.lora = lora_layer.StaticLoRARows([cpu], graphs.max_batch_size, 3)
    bucket = graphs.load_inputs(ids + [9], positions + [0], slots + [-1], seq_lens + [1],
                                tables + [[0]], lora_slots=torch.tensor([2, -1, 0, 2, 1]))
    assert bucket == 8
    assert graphs.lora.starts[cpu].tolist() == [4, 5, 6, 8]  # 3 padding rows
    with torch.inference_mode():
        got = graphs._forward(bucket, [x.clone() for x in caches], lora=True)
    torch.testing.assert_close(got[:4], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], base[1], rtol=1e-4, atol=1e-4)  # a base row
    assert (got[:4] - base).abs().amax(dim=1)[[0, 2, 3]].min() > 1e-2  # adapters matter


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU half; tests/gpu/test_lora.py on CUDA")
@pytest.mark.parametrize("slot", [0, 1, 2, -1])
def test_one_row_joint_forward_matches_the_eager_torch_path(slot):
    """A one-row decode graph's forward over joint weights (base weight and every slot's A
    in one GEMM, then the expand alone): the hidden row of the plain torch LoRA path, for
    a row of each slot (slot 1 empty) and of the base model."""
    from pagedllm.kernels.metadata import PagedAttentionInputMetadata
    from tests.test_cuda_graphs_cpu import make_graphs

    model, c, weights = _tiny_model_with_adapters(joint_share=1.0)
    assert all(layer.joint is not None for layer in weights.layers.values())
    g = torch.Generator().manual_seed(3)
    block_size = 4
    shape = (2, 6, block_size, c.num_key_value_heads, c.head_dim)
    caches = [torch.randn(shape, generator=g) for _ in range(c.num_hidden_layers)]
    table, seq_len, ids = [5, 1], 7, [50]
    position = seq_len - 1
    cache_slot = table[position // block_size] * block_size + position % block_size
    meta = PagedAttentionInputMetadata.build([position], [cache_slot], [1], [seq_len], [table])
    cpu = torch.device("cpu")
    with torch.inference_mode(), lora_rows(torch.tensor([slot])):
        expected = model(torch.tensor(ids), [x.clone() for x in caches], {cpu: meta})
    graphs = make_graphs(model, c, max_num_seqs=8, max_model_len=64, block_size=block_size)
    graphs.lora = lora_layer.StaticLoRARows([cpu], graphs.max_batch_size, 3)
    bucket = graphs.load_inputs(ids, [position], [cache_slot], [seq_len], [table],
                                lora_slots=torch.tensor([slot]))
    assert bucket == 1
    with torch.inference_mode():
        got = graphs._forward(bucket, [x.clone() for x in caches], lora=True)
    torch.testing.assert_close(got[:1], expected, rtol=1e-4, atol=1e-4)
