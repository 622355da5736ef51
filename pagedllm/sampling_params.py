"""SamplingParams: how to pick the next tokens of one request (vLLM names and defaults)."""
from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is greedy (argmax): dividing by it would overflow.
GREEDY_TEMPERATURE = 1e-5
# repetition_penalty divides (or multiplies) float32 logits: within these bounds the result
# stays finite (a logit of 100 / 1e-30 is 1e32 < float32's 3.4e38), outside it is refused.
MIN_REPETITION_PENALTY = 1e-30
MAX_REPETITION_PENALTY = 1e30
# Most top alternatives a request may ask for, per generated or prompt token.
MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names); exactly one of them:

    json: a JSON schema (dict or JSON string); regex: a regular expression the whole output
    matches; choice: the output is one of these strings; grammar: a Lark grammar (llguidance's
    dialect; a GBNF grammar, recognised by `::=`, is converted); json_object: any JSON object.
    Checked at construction: a schema, regex or grammar that cannot compile is a ValueError
    naming the problem.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The llguidance grammar the fields compile to (computed, not an argument).
    compiled: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from pagedllm.structured_grammar import compile_grammar  # imports llguidance

        self.compiled = compile_grammar(self)


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How extreme values behave (the sampler works in float32):
    - temperature below GREEDY_TEMPERATURE (1e-300 too) is greedy; a huge one is uniform;
    - top_p in (0, 1]: below float32's smallest positive (~1e-45) it rounds to 0, and, like
      any top_p under the top token's probability, keeps only the top token (greedy);
    - min_p in [0, 1]: a tiny one cuts nothing, 1 keeps only the most likely tokens;
    - presence/frequency_penalty in [-2, 2]; repetition_penalty in [1e-30, 1e30] (refused
      outside: dividing a logit by it must stay finite)."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None:
            _check_int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ValueError(
                    "best_of must be greater than or equal to n, "
                    f"got n={self.n}, best_of={self.best_of}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}"
            )
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        self.temperature = _check_float("temperature", self.temperature)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or at least 1, got {self.top_k}")
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                "min_tokens must be less than or equal to max_tokens, "
                f"got min_tokens={self.min_tokens}, max_tokens={self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, "
                             f"got {self.structured_outputs!r}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def has_penalties(self) -> bool:
        """Repetition, frequency or presence penalty: sampling reads the output so far."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def actual_best_of(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        for token_id in list(self.logit_bias or {}) + list(self.stop_token_ids or []):
            if token_id >= vocab_size:
                raise ValueError(
                    f"token id {token_id} is out of range for a vocabulary of {vocab_size}"
                )

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _normalise_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop must not contain an empty string")
    return list(stop)


def _normalise_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {ids!r}")
    return list(ids)


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token_id = _token_id_key(key)
        value = _check_float(f"logit_bias[{key!r}]", value)
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key!r}")
        out[token_id] = value
    return out


def _token_id_key(key: Any) -> int:
    """OpenAI clients send logit_bias keys as JSON strings: "123" means token 123."""
    if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
