import re

import pytest

from pagedllm.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be at least 1, got 0"),
        ({"n": 1.5}, "n must be an integer, got 1.5"),
        ({"n": 4, "best_of": 2}, "best_of must be greater than or equal to n, got n=4, best_of=2"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0"),
        ({"repetition_penalty": -1}, "repetition_penalty must be greater than zero, got -1.0"),
        ({"temperature": -1.0}, "temperature must be non-negative, got -1.0"),
        ({"temperature": float("inf")}, "temperature must be non-negative, got inf"),
        ({"temperature": float("nan")}, "temperature must be a number, got nan"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k must be -1 or 0 (off) or at least 1, got -2"),
        ({"top_k": 2.0}, "top_k must be an integer, got 2.0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"seed": "x"}, "seed must be an integer, got 'x'"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be non-negative, got -1"),
        (
            {"min_tokens": 5, "max_tokens": 3},
            "min_tokens must be less than or equal to max_tokens, got min_tokens=5, max_tokens=3",
        ),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"prompt_logprobs": 25}, "prompt_logprobs must be in [0, 20], got 25"),
        ({"logit_bias": {5: 150}}, "logit_bias values must be in [-100, 100], got 150.0 for token 5"),
        ({"logit_bias": {"7": -101}}, "logit_bias values must be in [-100, 100], got -101.0 for token '7'"),
        ({"logit_bias": {"abc": 1}}, "logit_bias keys must be non-negative token ids, got 'abc'"),
        ({"logit_bias": {-3: 1}}, "logit_bias keys must be non-negative token ids, got -3"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict of token id to bias, got [1, 2]"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop": ["a", 3]}, "stop must be a string or a list of strings, got ['a', 3]"),
        ({"stop": [""]}, "stop must not contain an empty string"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must be a list of non-negative integers, got [1, -1]"),
    ],
)
def test_bad_values_raise_with_exact_message(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"min_p": 1.0},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"temperature": 0.0},
        {"max_tokens": None, "min_tokens": 100},
        {"min_tokens": 3, "max_tokens": 3},
        {"logprobs": 0, "prompt_logprobs": 20},
        {"logit_bias": {1: -100, 2: 100}},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_logit_bias_string_keys_become_ints():
    p = SamplingParams(logit_bias={"123": 5, 7: -1.5})
    assert p.logit_bias == {123: 5.0, 7: -1.5}
    assert all(type(k) is int for k in p.logit_bias)


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=3).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_actual_best_of_and_greedy_best_of():
    assert SamplingParams(n=3).actual_best_of == 3
    assert SamplingParams(n=2, best_of=5).actual_best_of == 5
    # Greedy with best_of > 1 is allowed: every sample is the same.
    assert SamplingParams(temperature=0, n=2, best_of=4).actual_best_of == 4


def test_check_vocab():
    SamplingParams(logit_bias={9: 1}, stop_token_ids=[9]).check_vocab(10)
    with pytest.raises(ValueError, match="^token id 10 is out of range for a vocabulary of 10$"):
        SamplingParams(logit_bias={10: 1}).check_vocab(10)
    with pytest.raises(ValueError, match="^token id 12 is out of range for a vocabulary of 10$"):
        SamplingParams(stop_token_ids=[12]).check_vocab(10)


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], logit_bias={1: 2.0}, stop_token_ids=[4])
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.logit_bias[3] = 1.0
    q.stop_token_ids.append(5)
    assert p.stop == ["x"] and p.logit_bias == {1: 2.0} and p.stop_token_ids == [4]
