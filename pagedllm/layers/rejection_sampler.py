"""Speculative decoding's acceptance rule: a row's k proposals scored by the target model at
k+1 positions -> the 1..k+1 tokens it keeps.

Greedy rows keep the longest prefix of proposals equal to the target's argmax at each
position, then the target's own argmax after it (a mismatch's correction, or the bonus token
when every proposal matched): exactly the tokens greedy decoding would produce.

Random rows use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): proposal d_i,
drawn from the proposer's distribution q_i, is kept with probability min(1, p_i(d_i) /
q_i(d_i)), p_i the target's distribution (after temperature, top-k, top-p, min-p); the first
rejected position draws from the residual max(0, p_i - q_i), renormalised, and ends the row;
if all k are kept, a bonus token is drawn from p_k. Each kept or drawn token is then
distributed as the target's p, whatever q was. An n-gram proposer is deterministic: q_i is
one-hot on d_i, so d_i is kept with probability p_i(d_i) and the residual is p_i without d_i.
"""
from __future__ import annotations

import torch

from pagedllm.kernels.metadata import host_to_device
from pagedllm.layers.sampler import (
    Sampler, SamplingRow, _exponential_noise, _pack_logprobs, _random_probs,
)
from pagedllm.sampling_params import SamplingType


def _uniform(shape: tuple[int, int], generators: list[torch.Generator | None],
             device: torch.device) -> torch.Tensor:
    """U(0, 1) draws, one row per generator (a seeded row draws from its own)."""
    u = torch.empty(shape, device=device)
    if all(g is None for g in generators):
        return u.uniform_()
    for i, g in enumerate(generators):
        u[i].uniform_(generator=g) if g is not None else u[i].uniform_()
    return u


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_draft: list[int],
    draft_probs: torch.Tensor | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """target_probs [R, K+1, V] (each row a distribution), draft_ids [R, K] (row r's first
    num_draft[r] are real), draft_probs [R, K, V] or None (one-hot proposals: n-gram).
    Returns tokens [R, K+1] and, per row, how many of them it keeps (1..num_draft[r]+1)."""
    num_rows, width, vocab = target_probs.shape
    device = target_probs.device
    generators = generators or [None] * num_rows
    k = width - 1
    if k == 0:
        accepted = torch.zeros(num_rows, dtype=torch.long, device=device)
    else:
        p_draft = target_probs[:, :k].gather(2, draft_ids[:, :, None]).squeeze(2)
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = draft_probs.gather(2, draft_ids[:, :, None]).squeeze(2)
        u = _uniform((num_rows, k), generators, device)
        valid = torch.arange(k, device=device)[None, :] < host_to_device(
            num_draft, torch.long, device)[:, None]
        # Keep with probability min(1, p/q): u * q < p (q > 0 wherever d was drawn).
        keep = (u * q_draft < p_draft) & valid
        accepted = keep.long().cumprod(dim=1).sum(dim=1)  # leading kept proposals
    # The distribution of the token after them: the residual at a rejection, p at the end.
    rows = torch.arange(num_rows, device=device)
    p_at = target_probs[rows, accepted]  # [R, V]
    if k > 0:
        rejected = accepted < host_to_device(num_draft, torch.long, device)
        at = accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_at = torch.zeros_like(p_at)
            q_at[rows, draft_ids[rows, at]] = 1.0
        else:
            q_at = draft_probs[rows, at]
        residual = (p_at - q_at).clamp_min(0.0)
        # p == q leaves no residual, but then p/q = 1 and nothing is rejected; rounding only.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, p_at, residual)
        p_at = torch.where(rejected[:, None], residual, p_at)
    noise = _exponential_noise(p_at.shape, generators, [1] * num_rows, device)
    last = (p_at / noise).argmax(dim=1)
    tokens = torch.cat([draft_ids, torch.zeros_like(draft_ids[:, :1])], dim=1) if k else \
        torch.zeros(num_rows, 1, dtype=torch.long, device=device)
    tokens[rows, accepted] = last
    return tokens, (accepted + 1).tolist()


def _reads_output(row: SamplingRow) -> bool:
    """Penalties and a pending min_tokens read the output: each position then needs its own
    (the proposals before it appended); other rows share one list."""
    p = row.params
    return p.has_penalties or len(row.output_token_ids) < p.min_tokens


class SpecVerifier:
    """Scores speculative rows: the target's logits at each row's k+1 positions -> the
    tokens each row keeps, packed as the Sampler packs samples (the target's logprobs)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        proposals: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> tuple[torch.Tensor, list[int]]:
        """logits [sum(k_r + 1), V]: row r's positions in order; `rows` is the SamplingRow
        of each sequence (its output so far, before the proposals); draft_probs[r] is
        [k_r, V] or None (one-hot). Returns the packed samples [sum(k_r + 1), 3 + 2k] (the
        first n_r of row r are its tokens) and n_r per row."""
        device = logits.device
        logits = logits.float()
        # One SamplingRow per position: position i has seen proposals [:i] as output, so
        # penalties and min_tokens apply as they would have one token at a time.
        flat_rows = [
            SamplingRow(row.params, row.prompt_token_ids,
                        row.output_token_ids + d[:i] if i and _reads_output(row)
                        else row.output_token_ids, generator=row.generator)
            for row, d in zip(rows, proposals) for i in range(len(d) + 1)
        ]
        x = self.sampler.process_logits(logits, flat_rows)
        tokens = x.max(dim=-1).indices  # greedy rows' choice at every position
        starts = [0]
        for d in proposals:
            starts.append(starts[-1] + len(d) + 1)
        greedy = [i for i, r in enumerate(rows) if r.params.sampling_type == SamplingType.GREEDY]
        random_rows = [i for i, r in enumerate(rows)
                       if r.params.sampling_type != SamplingType.GREEDY]
        num_tokens = [0] * len(rows)
        if greedy:
            argmax = tokens.tolist()
            for i in greedy:
                d, s = proposals[i], starts[i]
                n = 0
                while n < len(d) and argmax[s + n] == d[n]:
                    n += 1
                num_tokens[i] = n + 1
        if random_rows:
            k = max(len(proposals[i]) for i in random_rows)
            flat = [s for i in random_rows for s in range(starts[i], starts[i + 1])]
            params = [flat_rows[s].params for s in flat]
            probs = _random_probs(x[host_to_device(flat, torch.long, device)], params)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            vocab = probs.shape[1]
            p = torch.zeros(len(random_rows), k + 1, vocab, device=device)
            ids = torch.zeros(len(random_rows), k, dtype=torch.long, device=device)
            with_q = any(draft_probs[i] is not None for i in random_rows)
            q = torch.zeros(len(random_rows), k, vocab, device=device) if with_q else None
            offset = 0
            for j, i in enumerate(random_rows):
                n = len(proposals[i])
                p[j, : n + 1] = probs[offset: offset + n + 1]
                offset += n + 1
                if n:
                    ids[j, :n] = host_to_device(proposals[i], torch.long, device)
                    if q is not None:
                        q[j, :n] = draft_probs[i]
            out, kept = rejection_sample(p, ids, [len(proposals[i]) for i in random_rows], q,
                                         [rows[i].generator for i in random_rows])
            for j, i in enumerate(random_rows):
                n = len(proposals[i])
                tokens[starts[i]: starts[i] + n + 1] = out[j, : n + 1]
                num_tokens[i] = kept[j]
        top = max((r.params.logprobs or 0) for r in rows)
        with_rank = any(r.params.logprobs is not None for r in rows)
        return _pack_logprobs(logits, None, tokens, top, with_rank), num_tokens
