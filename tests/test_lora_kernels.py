"""The Triton LoRA pair (kernels/triton_lora.py) against the torch path of layers/lora.py,
compiled on CUDA, in the interpreter on the CPU: rows of several adapter slots and of the base model mixed, a fused
projection's parts in their column ranges, ranks padded past the adapter's own."""
from __future__ import annotations

import torch

from tests.triton_setup import DEVICE, skip_unless_runnable

from pagedllm.kernels import triton_lora  # noqa: E402
from pagedllm.kernels.triton_lora import lora_expand, lora_shrink  # noqa: E402
from pagedllm.layers.lora import LoRALayer, lora_rows  # noqa: E402

skip_unless_runnable(triton_lora._shrink_kernel)


def test_shrink_expand_match_the_torch_path():
    g = torch.Generator().manual_seed(0)
    num_slots, rank, k, parts = 3, 6, 40, [24, 8, 8]  # rank 6: padded to 8 in the kernel
    lora_a = [torch.randn(num_slots, rank, k, generator=g).to(DEVICE) for _ in parts]
    lora_b = [torch.randn(num_slots, n, rank, generator=g).to(DEVICE) for n in parts]
    layer = LoRALayer(lora_a, lora_b)
    layer.active = [[True, True, True], [True, False, True], [True, True, True]]
    for slot, part in ((1, 1),):
        lora_a[part][slot].zero_(), lora_b[part][slot].zero_()  # part left out by slot 1
    slots = torch.tensor([-1, 0, 2, 0, 1, -1, 2, 1], device=DEVICE)
    x = torch.randn(len(slots), k, generator=g).to(DEVICE)
    base = torch.randn(len(slots), sum(parts), generator=g).to(DEVICE)
    with lora_rows(slots):
        want = layer(x, base.clone())
    got = base.clone()
    col = 0
    for a, b in zip(lora_a, lora_b):
        lora_expand(got, lora_shrink(x, a, slots), b, slots, col)
        col += b.shape[1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base_rows = slots < 0
    assert torch.equal(got[base_rows], base[base_rows])
