"""The draft model of speculative decoding: a second (small) model in the worker that
proposes each speculative row's next k tokens, with its own paged KV cache.

Its cache has the target's block numbers and block size: a sequence's block table addresses
both, so the scheduler's allocation, copy-on-write copies and swaps (applied to both caches)
and the rollback of rejected slots serve the draft as they serve the target. The draft keeps,
per sequence, how many leading tokens have K/V in its cache (`computed`). Every step it first
catches up on each row's known tokens [computed, last token] (a prefill chunk, a one-token
decode, two tokens after a window whose proposals were all accepted: the last proposal was
never fed to it, or many after steps without speculation, which it skips; so is a first
prefill, caught up at the first speculative step), which also
gives the first proposal's logits; then k - 1 one-token steps. After verification the
count drops to the accepted prefix: the slots of rejected proposals are overwritten later.
Its K/V only ever changes what is proposed, never which tokens the target keeps.

Greedy requests get the draft's argmax; sampled requests a sample from the draft's
distribution under the same temperature / top-k / top-p / min-p, which is kept (q) for
rejection sampling.
"""
from __future__ import annotations


import torch
from torch import nn

from pagedllm.kernels.metadata import PagedAttentionInputMetadata, host_to_device, slots_for
from pagedllm.layers.sampler import Sampler, SamplingRow, _exponential_noise, _random_probs
from pagedllm.loader import initialize_dummy_weights, load_model_source
from pagedllm.models.device_map import DeviceMap
from pagedllm.models.registry import build_empty_model
from pagedllm.sampling_params import SamplingType
from pagedllm.contract import StepBatch
from pagedllm.worker.placement import place_model


def load_draft_model(model: str, load_format: str, seed: int, dtype: torch.dtype,
                     device: torch.device, vocab_size: int, max_model_len: int) -> nn.Module:
    """The draft model on `device`, in `dtype`; its vocabulary must be the target's."""
    source = load_model_source(model, load_format, None, with_tokenizer=False)
    config = source.config
    if config.vocab_size != vocab_size:
        raise ValueError(f"speculative_config: the draft model {model!r} has a vocabulary of "
                         f"{config.vocab_size} tokens, the target model {vocab_size}: they "
                         f"must share the tokenizer")
    if config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config: the draft model {model!r} takes "
                         f"{config.max_position_embeddings} positions, less than the target's "
                         f"context of {max_model_len} (lower max_model_len)")
    draft = build_empty_model(config, dtype)
    place_model(draft, DeviceMap.single(device, config.num_hidden_layers))
    if source.load_format == "dummy":
        initialize_dummy_weights(draft, seed)
    else:
        draft.load_weights(source.iter_weights(dtype))
    return draft.eval()


def _reads_output(params, output: list[int]) -> bool:
    """Penalties or a pending min_tokens: the draft's rows need their proposals appended."""
    return params.has_penalties or len(output) < params.min_tokens


class DraftProposer:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, sampler: Sampler) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.computed: dict[int, int] = {}  # seq_id -> tokens with K/V in the draft's cache
        self._windows: dict[int, tuple[int, int]] = {}  # seq_id -> (first position, k)

    def _run(self, ids: list[int], positions: list[int], slots: list[int], query_lens: list[int],
             seq_lens: list[int], tables: list[list[int]], rows: list[int]) -> torch.Tensor:
        meta = PagedAttentionInputMetadata.build(positions, slots, query_lens, seq_lens, tables,
                                                 device=self.device)
        hidden = self.model(host_to_device(ids, torch.long, self.device), self.kv_caches,
                            {self.device: meta})
        return self.model.compute_logits(
            hidden.index_select(0, host_to_device(rows, torch.long, hidden.device)))

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        """The draft's token per row, and its distribution q for sampled rows."""
        x = self.sampler.process_logits(logits.float(), rows)
        tokens = x.max(dim=-1).indices
        qs: list[torch.Tensor | None] = [None] * len(rows)
        random_rows = [i for i, r in enumerate(rows)
                       if r.params.sampling_type != SamplingType.GREEDY]
        if random_rows:
            index = host_to_device(random_rows, torch.long, x.device)
            probs = _random_probs(x[index], [rows[i].params for i in random_rows])
            probs = probs / probs.sum(dim=-1, keepdim=True)
            noise = _exponential_noise(probs.shape, [rows[i].generator for i in random_rows],
                                       [1] * len(random_rows), x.device)
            tokens[index] = (probs / noise).argmax(dim=-1)
            for j, i in enumerate(random_rows):
                qs[i] = probs[j]
        return tokens.tolist(), qs

    @torch.inference_mode()
    def propose(self, batch: StepBatch, seqs: dict) -> dict[int, tuple[list[int],
                                                                     torch.Tensor | None]]:
        """Follow the batch (forks, freed sequences, every row's known tokens) and propose
        for its rows in batch.num_draft_tokens: seq_id -> (k tokens, q [k, vocab] or None
        for a greedy row). `seqs`: the model runner's SeqStates, already updated."""
        computed = self.computed
        for fork in batch.forks:
            computed[fork.child_seq_id] = computed.get(fork.parent_seq_id, 0)
        for seq_id in batch.freed_seq_ids:
            computed.pop(seq_id, None)
            self._windows.pop(seq_id, None)
        if not batch.num_draft_tokens:
            # No row speculates (speculation off for this batch size): the draft catches up
            # later, in one chunk. Only what it must not miss: a recomputed sequence's
            # cache starts again from `start`.
            for seq_id, start in zip(batch.seq_ids, batch.num_computed_tokens):
                if computed.get(seq_id, 0) > start:
                    computed[seq_id] = start
            return {}
        logits, spec = self._catch_up(batch, seqs)
        if not spec:
            return {}
        return self._draft(logits, spec)

    def _catch_up(self, batch: StepBatch, seqs: dict) -> tuple[torch.Tensor | None, list]:
        """The draft's forward over every row's known tokens it has not computed; returns
        its logits at each row's last token and the speculative rows, (seq_id, logits row,
        k, block table, SeqState)."""
        computed, want, bs = self.computed, batch.num_draft_tokens, self.block_size
        ids, positions, slots, qlens, slens, tables, last = [], [], [], [], [], [], []
        spec: list[tuple[int, int, int, list[int], object]] = []  # (seq_id, row, k, table, st)
        for i, seq_id in enumerate(batch.seq_ids):
            st = seqs[seq_id]
            start = batch.num_computed_tokens[i]
            k = want.get(seq_id, 0)
            end = start + batch.num_scheduled_tokens[i] - k  # the known tokens' end
            begin = min(computed.get(seq_id, 0), start)
            known = len(st.prompt_token_ids) + len(st.output_token_ids)
            end = min(end, known)
            if end <= begin:
                continue
            ids += st.token_slice(begin, end)
            positions += range(begin, end)
            slots += slots_for(st.block_table, begin, end, bs)
            qlens.append(end - begin)
            slens.append(end)
            tables.append(st.block_table)
            computed[seq_id] = end
            if k:
                spec.append((seq_id, len(last), k, st.block_table, st))
                self._windows[seq_id] = (end - 1, k)
            last.append(len(ids) - 1)
        if not ids:
            return None, []
        return self._run(ids, positions, slots, qlens, slens, tables, last), spec

    def _draft(self, logits: torch.Tensor, spec: list) -> dict[int, tuple[list[int],
                                                                       torch.Tensor | None]]:
        """Each speculative row's k proposals, one draft decode step per token after the
        first (the rows asking for fewer drop out as they have theirs)."""
        computed, bs = self.computed, self.block_size
        logits = logits[[row for _, row, _, _, _ in spec]]
        proposals: dict[int, list[int]] = {seq_id: [] for seq_id, *_ in spec}
        dists: dict[int, list[torch.Tensor]] = {seq_id: [] for seq_id, *_ in spec}
        active = spec
        for step in range(max(k for _, _, k, _, _ in spec)):
            rows = [SamplingRow(st.params, st.prompt_token_ids,
                                st.output_token_ids + proposals[seq_id]
                                if proposals[seq_id] and _reads_output(st.params,
                                                                       st.output_token_ids)
                                else st.output_token_ids, generator=st.generator)
                    for seq_id, _, _, _, st in active]
            tokens, qs = self._choose(logits, rows)
            for (seq_id, *_), t, q in zip(active, tokens, qs):
                proposals[seq_id].append(t)
                if q is not None:
                    dists[seq_id].append(q)
            active = [a for a in active if a[2] > step + 1]
            if not active:
                break
            # The proposal just drawn, one token each: position = last known + step + 1.
            ids, positions, slots, slens, tables = [], [], [], [], []
            for seq_id, _, _, table, _ in active:
                pos = self._windows[seq_id][0] + step + 1
                ids.append(proposals[seq_id][-1])
                positions.append(pos)
                slots += slots_for(table, pos, pos + 1, bs)
                slens.append(pos + 1)
                tables.append(table)
                computed[seq_id] = pos + 1
            logits = self._run(ids, positions, slots, [1] * len(ids), slens, tables,
                               list(range(len(ids))))
        return {seq_id: (proposals[seq_id],
                         torch.stack(dists[seq_id]) if dists[seq_id] else None)
                for seq_id in proposals}

    def accepted(self, kept: dict[int, int]) -> None:
        """Verification kept `n` tokens of each window: the draft's cache is valid up to the
        last token plus the n - 1 accepted proposals (rejected ones' slots are stale)."""
        for seq_id, n in kept.items():
            window = self._windows.pop(seq_id, None)
            if window is not None and seq_id in self.computed:
                first, k = window
                self.computed[seq_id] = min(self.computed[seq_id], first + n)
