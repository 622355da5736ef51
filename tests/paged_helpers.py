"""Test helpers: drive a model through the paged cache by hand (no scheduler), and build a
random paged attention step with its float64 answer (the CPU attention tests)."""
from __future__ import annotations

import math
import random

import torch

from pagedllm.kernels.reference import write_kv_cache
from pagedllm.kernels.metadata import PagedAttentionInputMetadata


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


NAN = float("nan")


def naive_attention(q, keys, values, context, scale, window=None, slopes=None):
    """q [q_len, heads, d] are the last q_len of `context` positions; keys/values [context,
    kv_heads, d]. float64, one head at a time."""
    q_len, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(q_len, heads, q.shape[-1], dtype=torch.float64)
    for j in range(q_len):
        pos = context - q_len + j
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(heads):
            k = keys[lo: pos + 1, h // group].double()
            scores = k @ q[j, h].double() * scale
            if slopes is not None:
                scores += slopes[h].double() * (torch.arange(lo, pos + 1) - pos)
            out[j, h] = torch.softmax(scores, 0) @ values[lo: pos + 1, h // group].double()
    return out


def random_step(seq_lens, query_lens, *, heads=6, kv_heads=2, d=16, block_size=4, seed=0,
                dtype=torch.float32):
    """A cache whose blocks are shuffled, the step's query/key/value, and the metadata.
    Blocks no sequence owns are NaN (reading one shows up as NaN); the unwritten tail of a
    partial block holds large values (attending to one shows up as a wrong result: a masked
    NaN would still poison SDPA's weighted sum, and a real cache never holds NaN)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil(s / block_size))] for s in seq_lens]
    cache = torch.full((2, num_blocks, block_size, kv_heads, d), NAN, dtype=dtype)
    cache[:, [b for t in tables for b in t]] = 1e4
    keys = [torch.randn(s, kv_heads, d, generator=g).to(dtype) for s in seq_lens]
    values = [torch.randn(s, kv_heads, d, generator=g).to(dtype) for s in seq_lens]

    def slots(i, start, end):
        return [tables[i][p // block_size] * block_size + p % block_size for p in range(start, end)]

    # The cached context (everything before this step's tokens) is already in the cache.
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        write_kv_cache(keys[i][: s - q], values[i][: s - q], cache, torch.tensor(slots(i, 0, s - q), dtype=torch.long))
    step_slots = [p for i, (s, q) in enumerate(zip(seq_lens, query_lens)) for p in slots(i, s - q, s)]
    positions = [p for s, q in zip(seq_lens, query_lens) for p in range(s - q, s)]
    meta = PagedAttentionInputMetadata.build(positions, step_slots, query_lens, seq_lens, tables)
    query = torch.randn(sum(query_lens), heads, d, generator=g).to(dtype)
    key = torch.cat([k[s - q:] for k, s, q in zip(keys, seq_lens, query_lens)])
    value = torch.cat([v[s - q:] for v, s, q in zip(values, seq_lens, query_lens)])
    return cache, meta, query, key, value, keys, values


# Greedy parity across implementations or batch shapes holds token for token except where
# the reference's two best tokens are closer than the two sides' logits can differ: there
# either choice is right, and the continuations part ways. The parity tests bound that
# difference: logits within 1e-3 of transformers' (test_default_model), while our own paths
# differ by fp32 rounding only (~1e-6) when the batch shape changes.
NEAR_TIE_VS_TRANSFORMERS = 5e-3
NEAR_TIE_ACROSS_BATCH_SHAPES = 1e-4


def assert_same_greedy(got: list[int], want: list[int], want_logprobs: list[dict[int, float]],
                       near_tie: float, where: str = "") -> int:
    """Exact greedy tokens, allowing one parting of ways at a near tie of the reference.

    want_logprobs[i] holds the reference's log-probabilities at step i for at least its two
    best tokens (the logprobs the reference chose among). Returns how many tokens agree.
    """
    for i, (a, b) in enumerate(zip(got, want)):
        if a == b:
            continue
        step = want_logprobs[i]
        gap = step[b] - step.get(a, -math.inf)
        assert gap <= near_tie, (
            f"{where} token {i}: got {a}, want {b}; the reference prefers {b} by {gap:.3g} "
            f"(a near tie is at most {near_tie})")
        return i
    assert len(got) == len(want), f"{where}: {len(got)} tokens, want {len(want)}"
    return len(got)


def top_logprobs(logits: torch.Tensor, k: int = 5) -> list[dict[int, float]]:
    """[steps, vocab] logits -> each step's k most likely tokens and their log-probabilities."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return [dict(zip(i.tolist(), v.tolist())) for i, v in zip(ids, values)]


def hf_greedy_reference(model, tokenizer, prompts: list[str], max_tokens: int
                        ) -> list[tuple[list[int], list[dict[int, float]]]]:
    """transformers' greedy continuations (token ids, EOS included when reached) with each
    step's top log-probabilities, generated as one left-padded batch (transformers' fp32
    logits do not depend on the batch shape)."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        gen = model.generate(**batch, max_new_tokens=max_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(gen.logits, dim=1)  # [prompts, steps, vocab]
    out = []
    for row, row_logits in zip(gen.sequences[:, batch.input_ids.shape[1]:].tolist(), logits):
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append((row[:cut], top_logprobs(row_logits[:cut])))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_agreement(ours, want) -> tuple[int, float]:
    """Two runs' RequestOutputs (greedy, logprobs=0) -> the tokens they agree on before their
    first difference, summed over requests, and the largest |logprob difference| there."""
    agree, worst = 0, 0.0
    for a, b in zip(ours, want):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = common_prefix(ta, tb)
        agree += n
        for i in range(n):
            worst = max(worst, abs(a.outputs[0].logprobs[i][ta[i]].logprob
                                   - b.outputs[0].logprobs[i][tb[i]].logprob))
    return agree, worst
