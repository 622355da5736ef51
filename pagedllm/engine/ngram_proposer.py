"""N-gram (prompt lookup) proposer for speculative decoding: the sequence's own tokens are
the draft. The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked
up earlier in prompt + output; the tokens that followed the latest match are proposed.
Free to compute and exact where the output copies its input (editing, quoting, code)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` proposed continuations of `token_ids`; [] when no suffix of
    min_n..max_n tokens occurs earlier."""
    length = len(token_ids)
    if num_tokens < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0 .. length - n - 1: each is followed by at least one token
        # and none is the suffix itself.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start: start + num_tokens].tolist()
    return []
