"""Structured output on the engine's side: one grammar matcher per constrained sequence.

A request with `SamplingParams.structured_outputs` gets an llguidance `LLMatcher` per
sequence (its grammar compiled when the params were made, sampling_params.py). Before each
step that samples a constrained sequence the engine fills that row's allowed-token bitmask
(packed int32, bit t of word t // 32 = token t allowed) into the StepBatch; the worker applies
it to the logits before sampling. Each accepted token advances the matcher; a matcher that
reaches its end state finishes the sequence.

The matcher lives with the engine's Sequence, so preemption loses nothing: recompute keeps
the output tokens the matcher has consumed, and swapping moves only KV. A fork (n/best_of)
deep-copies its parent's matcher before either takes its own sample.

Constrained sequences decode in multi-step windows too: each step of a window samples once
the engine has advanced the grammars by the step before's samples (`advance`) and filled
its masks, while the device already runs its forward (worker DecodeWindow). Under async
scheduling the next window is launched ahead the same way, and its masks are filled on a
background thread (`start_fill`) while the engine updates the window before. Tokens
consumed ahead are recorded, and `accept` answers from that record when the engine appends
them.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from pagedllm.engine.sequence import SequenceGroup
    from pagedllm.contract import StepBatch

logger = logging.getLogger(__name__)

# llguidance's tokenizer is built from the HF tokenizer's whole vocabulary (slow): once per
# tokenizer object and EOS set.
# Keyed by id(tokenizer); the entry keeps the tokenizer alive so the id stays its own.
_LL_TOKENIZERS: dict[tuple[int, tuple[int, ...]], tuple[Any, Any]] = {}
# Fresh matchers kept per grammar: building one validates and compiles the grammar, a copy of
# a fresh one is far cheaper, and a batch of requests usually shares a few schemas. Each
# fresh matcher keeps its own lexer (its DFA grows as masks are computed): the total kept
# is bounded too, the least recently used grammars going first.
MAX_CACHED_GRAMMARS = 64
MAX_CACHED_MATCHERS = 256


@dataclass
class _Fresh:
    """A grammar's unused matchers, handed out in turn. Copies of one matcher share its
    lexer behind one lock (llguidance's `deep_copy` keeps the parser's shared state), so
    their masks are computed one at a time: up to one per mask-filling thread is built."""

    matchers: list[Any]
    handed: int = 0


def _from_backend(tokenizer: Any, eos: list[int] | None) -> Any:
    """llguidance.hf.from_tokenizer's own steps on the Rust tokenizer, which a FastTokenizer
    and a transformers fast tokenizer both carry (llguidance.hf imports transformers)."""
    from copy import copy

    from llguidance import LLTokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("Only fast tokenizers are supported")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return LLTokenizer(backend.to_str(), eos_token=eos if eos is not None
                       else tokenizer.eos_token_id)


def ll_tokenizer(tokenizer: Any, eos_token_ids: list[int]) -> Any:
    key = (id(tokenizer), tuple(sorted(eos_token_ids)))
    entry = _LL_TOKENIZERS.get(key)
    if entry is None:
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        # An id past the tokenizer's vocabulary (a model whose embedding is wider, paired
        # with a smaller tokenizer) has no token to end a grammar with: it is masked anyway.
        eos = sorted(i for i in eos_token_ids if i < len(tokenizer)) or None
        try:
            ll = _from_backend(tokenizer, eos)
        except ValueError as e:
            raise ValueError(f"structured output: {e}") from None
        entry = _LL_TOKENIZERS[key] = (tokenizer, ll)
    return entry[1]


_LIMITS: Any = None


def parser_limits() -> Any:
    """The llguidance limits every matcher of the engine runs under (and the server's check
    before admission, `check_grammar`): its defaults, with short error messages (no parser
    state dumped into an API error)."""
    global _LIMITS
    if _LIMITS is None:
        import llguidance

        _LIMITS = llguidance.LLParserLimits(verbose_errors=False)
    return _LIMITS


def new_matcher(ll: Any, grammar: str, validate: bool = True) -> Any:
    """A fresh matcher under `parser_limits`; ValueError naming the problem when the grammar
    does not compile against this tokenizer, or when it fails on its first mask (a grammar
    that allows no token: a JSON schema whose $ref loops with no base case)."""
    import llguidance

    limits = parser_limits()
    error = validate and llguidance.LLMatcher.validate_grammar(grammar, ll, limits=limits)
    if error:
        raise ValueError(f"structured output: {error.strip()}")
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0, limits=limits)
    if validate and not matcher.is_error():
        mask = torch.empty((ll.vocab_size + 31) // 32, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if matcher.is_error():
            raise ValueError("structured output: the grammar allows no output "
                             f"({first_line(matcher.get_error())}); a recursive schema needs "
                             "a branch that ends")
    if matcher.is_error():
        raise ValueError(f"structured output: {first_line(matcher.get_error())}")
    return matcher


def first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


class StructuredOutputManager:
    """The matchers of the engine's constrained sequences, by seq_id."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], vocab_size: int,
                 pin_masks: bool = False) -> None:
        self._tokenizer = tokenizer
        # Masks bound for a GPU are filled in pinned memory: their copy is queued as is.
        self.pin_masks = pin_masks
        self._eos = list(eos_token_ids)
        self.vocab_size = vocab_size
        self._ll: Any = None
        self._executor: Any = None
        # Every core this process may run on fills masks (up to 32, llguidance's cap).
        self.mask_threads = min(32, _usable_cpus())
        # The mask fill in flight (start_fill): its batch, mask, rows and completion.
        self._filling: tuple[Any, torch.Tensor | None, list[int], Future] | None = None
        self._filler: ThreadPoolExecutor | None = None
        self.matchers: dict[int, Any] = {}
        self._fresh: OrderedDict[str, _Fresh] = OrderedDict()  # grammar -> unused matchers
        # seq_id -> per token consumed ahead (`advance`), in order: did it end the grammar
        self._ahead: dict[int, deque[bool]] = {}
        # seq_id -> why its grammar failed mid-way (a limit hit): the sequence ends "error".
        self.errors: dict[int, str] = {}
        # Seconds the engine's thread spent filling masks (or waiting for a background
        # fill) and advancing matchers (`bench structured`).
        self.host_seconds = 0.0

    @property
    def ll(self) -> Any:
        if self._ll is None:
            self._ll = ll_tokenizer(self._tokenizer, self._eos)
        return self._ll

    @property
    def words(self) -> int:
        """int32 words per bitmask row (llguidance's vocabulary, which may be smaller than
        the model's: the worker masks the model's extra ids)."""
        return (self.ll.vocab_size + 31) // 32

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def start(self, seq_id: int, group: "SequenceGroup") -> None:
        """A matcher for a new constrained sequence; ValueError when the grammar does not
        compile against this tokenizer."""
        grammar = group.sampling_params.structured_outputs.compiled
        fresh = self._fresh.get(grammar)
        if fresh is None:
            fresh = self._fresh[grammar] = _Fresh([self._compile(grammar)])
        else:
            self._fresh.move_to_end(grammar)
        turn = fresh.handed % self.mask_threads
        fresh.handed += 1
        if turn == len(fresh.matchers):  # validated with the first one
            fresh.matchers.append(self._compile(grammar, validate=False))
        self.matchers[seq_id] = fresh.matchers[turn].deep_copy()
        kept = sum(len(f.matchers) for f in self._fresh.values())
        while len(self._fresh) > 1 and (len(self._fresh) > MAX_CACHED_GRAMMARS or
                                        kept > MAX_CACHED_MATCHERS):
            kept -= len(self._fresh.popitem(last=False)[1].matchers)

    def _compile(self, grammar: str, validate: bool = True) -> Any:
        return new_matcher(self.ll, grammar, validate)

    def fork(self, parent_id: int, child_id: int) -> None:
        self._settle()
        matcher = self.matchers.get(parent_id)
        if matcher is not None:
            self.matchers[child_id] = matcher.deep_copy()

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Advance the sequence's matcher by its new token; True when the grammar is done
        (the sequence should finish). A token the grammar refuses (it cannot be sampled
        under the mask; only a model vocabulary wider than the tokenizer's could) also ends
        it, with a warning. A token `advance` consumed already is not consumed again."""
        ahead = self._ahead.get(seq_id)
        if ahead:
            return ahead.popleft()
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return False
        self._settle()
        start = time.perf_counter()
        done = self._consume(seq_id, matcher, token_id, self.errors)
        self.host_seconds += time.perf_counter() - start
        return done

    def advance(self, batch: "StepBatch", token_ids: np.ndarray) -> None:
        """Consume one step's sampled token ids (host int64 [samples], one sample per
        sampled row of `batch`) into the constrained rows' matchers, ahead of the engine's
        append; a finished or failed grammar takes no more tokens."""
        self._settle()
        start = time.perf_counter()
        matchers = self.matchers
        tokens = token_ids.tolist()
        sampled = (s for s, do_sample in zip(batch.seq_ids, batch.do_sample) if do_sample)
        for seq_id, token in zip(sampled, tokens):
            matcher = matchers.get(seq_id)
            if matcher is None or matcher.is_stopped() or matcher.is_error():
                continue
            done = self._consume(seq_id, matcher, int(token), self.errors)
            self._ahead.setdefault(seq_id, deque()).append(done)
        self.host_seconds += time.perf_counter() - start

    @staticmethod
    def _consume(seq_id: int, matcher: Any, token_id: int, errors: dict[int, str]) -> bool:
        """Advance by one token; True when the sequence ends. A matcher that failed (on
        this token, or on the mask before it: a limit of llguidance's hit mid-way) ends it
        with its error recorded in `errors`, never as a plain stop."""
        if matcher.is_error() or not matcher.consume_token(token_id):
            error = first_line(matcher.get_error()) if matcher.is_error() else \
                f"token {token_id} is outside the grammar"
            logger.warning("sequence %d: structured output failed: %s", seq_id, error)
            errors[seq_id] = f"structured output failed during generation: {error}"
            return True
        return matcher.is_stopped()

    def error(self, seq_id: int) -> str | None:
        """Why the sequence's grammar failed, if it did (read before `free`)."""
        return self.errors.get(seq_id)

    def free(self, seq_ids: Any) -> None:
        for seq_id in seq_ids:
            self.matchers.pop(seq_id, None)
            self._ahead.pop(seq_id, None)
            self.errors.pop(seq_id, None)

    def fill_bitmask(self, batch: "StepBatch") -> None:
        """Set `batch.token_bitmask` (one row per constrained sampled row) and
        `batch.token_bitmask_rows` (their indices among the batch's sampled rows)."""
        self.start_fill(batch, background=False)
        self.finish_fill()

    def start_fill(self, batch: "StepBatch", background: bool = True) -> None:
        """Begin filling `batch`'s masks; `finish_fill` sets them on the batch. In the
        background they are computed on another thread (llguidance works without the GIL)
        while the engine's thread goes on; every call here that touches a matcher waits for
        them first. A fill still in flight from an abandoned step is dropped."""
        self._settle()
        self._filling = None
        start = time.perf_counter()
        rows, which = self._constrained_rows(batch)
        mask = None
        if rows:
            mask = torch.empty(len(rows), self.words, dtype=torch.int32,
                               pin_memory=self.pin_masks)
        if rows and background:
            if self._filler is None:
                self._filler = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-masks")
            done = self._filler.submit(self._compute_masks, which, mask)
        else:
            if rows:
                self._compute_masks(which, mask)
            done = Future()
            done.set_result(None)
        self._filling = (batch, mask, rows, done)
        self.host_seconds += time.perf_counter() - start

    def filling(self, batch: "StepBatch") -> bool:
        """`batch`'s masks are started and not yet set (finish_fill)."""
        return self._filling is not None and self._filling[0] is batch

    def fill_ready(self) -> bool:
        """finish_fill would not wait."""
        return self._filling is None or self._filling[3].done()

    def finish_fill(self) -> None:
        """Wait for the masks started last and set them on their batch."""
        if self._filling is None:
            return
        start = time.perf_counter()
        batch, mask, rows, done = self._filling
        self._filling = None
        done.result()
        batch.token_bitmask, batch.token_bitmask_rows = mask, rows
        self.host_seconds += time.perf_counter() - start

    def _settle(self) -> None:
        """The matchers are free again (a fill in flight holds them). A failed fill raises
        in finish_fill, to the step that owns it."""
        if self._filling is not None:
            wait([self._filling[3]])

    def _constrained_rows(self, batch: "StepBatch") -> tuple[list[int], list[Any]]:
        """The constrained rows' indices among the batch's sampled rows, and their matchers."""
        matchers = self.matchers
        rows: list[int] = []
        which: list[Any] = []
        sampled = 0
        for seq_id, do_sample in zip(batch.seq_ids, batch.do_sample):
            if not do_sample:
                continue
            matcher = matchers.get(seq_id)
            # A grammar that ended in the step before: the row's sample is not kept.
            if matcher is not None and not (matcher.is_stopped() or matcher.is_error()):
                rows.append(sampled)
                which.append(matcher)
            sampled += 1
        return rows, which

    def _compute_masks(self, which: list[Any], mask: torch.Tensor) -> None:
        if len(which) == 1:
            which[0].unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)
            return
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self.mask_threads)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(which)], mask.data_ptr(), mask.shape[1] * 4,
            len(which))
