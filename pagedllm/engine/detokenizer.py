"""Incremental detokenization and stop-string detection.

Decoding a window that starts a few tokens back keeps tokenizer context (leading spaces,
multi-byte characters split over tokens); text ending in U+FFFD is an unfinished character
and waits for the next token.
"""
from __future__ import annotations

from pagedllm.engine.sequence import Sequence

PREFIX_WINDOW = 5


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        n = seq.get_prompt_len()
        seq.prefix_offset = max(n - PREFIX_WINDOW, 0)
        seq.read_offset = n

    def decode_new(self, seq: Sequence, skip_special_tokens: bool = True,
                   end: int | None = None) -> str:
        """Append the text of newly generated tokens (those before `end`, all by default)
        to seq.output_text; return that text."""
        if self.tokenizer is None:
            return ""
        # the window only: copying the whole prompt + output per token costs O(length)
        length = seq.get_len() if end is None else end
        ids = seq.token_slice(seq.prefix_offset, length)
        decode = self.tokenizer.decode
        prefix = decode(ids[: seq.read_offset - seq.prefix_offset],
                        skip_special_tokens=skip_special_tokens)
        full = decode(ids, skip_special_tokens=skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new_text = full[len(prefix):]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = length
        seq.output_text += new_text
        return new_text


    def decode_all(self, seq: Sequence, skip_special_tokens: bool = True) -> str:
        """The whole output text at once, with the same prompt context as decode_new."""
        if self.tokenizer is None:
            return ""
        start = max(seq.get_prompt_len() - PREFIX_WINDOW, 0)
        ids = seq.token_slice(start, seq.get_len())
        prefix = self.tokenizer.decode(ids[: seq.get_prompt_len() - start],
                                       skip_special_tokens=skip_special_tokens)
        full = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return full[len(prefix):]


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends inside the newest `new_len` characters, and where it
    starts. A stop may begin in older text (split across tokens), so search a bit further back."""
    if not stops or new_len == 0:
        return None
    longest = max(len(s) for s in stops)
    from_index = max(len(text) - new_len - longest + 1, 0)
    best: tuple[str, int] | None = None
    for stop in stops:
        at = text.find(stop, from_index)
        if at != -1 and (best is None or at < best[1]):
            best = (stop, at)
    return best
