"""Test helpers: drive a model through the paged cache by hand (no scheduler)."""
from __future__ import annotations

import random

import torch

from pagedllm.layers.metadata import PagedAttentionInputMetadata


class PagedRunner:
    """Runs sequences through a model with shuffled (non-contiguous) cache blocks."""

    def __init__(self, model, config, num_blocks: int, block_size: int, seed: int = 0):
        self.model, self.block_size = model, block_size
        shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(config.num_hidden_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slots(self, seq: int, new: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        start = self.lens.get(seq, 0)
        while len(table) * self.block_size < start + new:
            table.append(self.free.pop())
        return [table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, start + new)]

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """chunks: seq id -> its new token ids. Returns logits of every new token."""
        ids, positions, slots, qlens, slens, tables = [], [], [], [], [], []
        for seq, toks in chunks.items():
            start = self.lens.get(seq, 0)
            slots += self._slots(seq, len(toks))
            ids += toks
            positions += range(start, start + len(toks))
            self.lens[seq] = start + len(toks)
            qlens.append(len(toks))
            slens.append(self.lens[seq])
            tables.append(self.tables[seq])
        meta = PagedAttentionInputMetadata.build(positions, slots, qlens, slens, tables)
        hidden = self.model(torch.tensor(ids), self.kv_caches, {torch.device("cpu"): meta})
        return self.model.compute_logits(hidden)


@torch.no_grad()
def assert_matches_transformers(hf, ours, config, prompts, decode_steps: int = 16,
                                atol: float = 1e-4) -> None:
    """Prefill `prompts` in one flat batch, then greedy-decode them together through the
    paged cache (block size 4, scattered blocks); every logit within `atol` of transformers'
    own forward and cached decode."""
    runner = PagedRunner(ours, config, num_blocks=64, block_size=4)
    logits = runner.step(dict(enumerate(prompts)))
    offset = 0
    pasts, nexts = [], []
    for prompt in prompts:
        ref = hf(torch.tensor([prompt]), use_cache=True)
        assert (logits[offset: offset + len(prompt)] - ref.logits[0]).abs().max().item() <= atol
        offset += len(prompt)
        pasts.append(ref.past_key_values)
        nexts.append(int(ref.logits[0, -1].argmax()))
    for _ in range(decode_steps):
        logits = runner.step({i: [t] for i, t in enumerate(nexts)})
        for i in range(len(prompts)):
            ref = hf(torch.tensor([[nexts[i]]]), past_key_values=pasts[i], use_cache=True)
            assert (logits[i] - ref.logits[0, -1]).abs().max().item() <= atol
            pasts[i] = ref.past_key_values
            nexts[i] = int(ref.logits[0, -1].argmax())
    # The sequences really spanned many scattered blocks.
    assert all(len(t) >= 7 for t in runner.tables.values())
