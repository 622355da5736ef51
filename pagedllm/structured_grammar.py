"""Structured output's grammars: StructuredOutputsParams -> one llguidance grammar.

Ground floor (beside sampling_params.py, which calls it when a StructuredOutputsParams is
made): it needs no tokenizer, so a schema, regex or grammar that cannot compile is refused
before any request reaches an engine. llguidance (https://github.com/guidance-ai/llguidance)
compiles JSON schemas, regexes and Lark grammars lazily against the tokenizer while
sampling; the engine's matchers are in engine/structured_output.py.
"""
from __future__ import annotations

import json
import re
from typing import Any

# JSON is written compactly (", " and ": " between items, no other whitespace): a small
# model sampled at temperature 1 otherwise spends its tokens on newlines. A schema's own
# "x-guidance" options override this.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}

# json_object: any JSON object (OpenAI's {"type": "json_object"}).
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

# Stated bounds, checked before anything is generated (llguidance's lexer gives up on
# larger ones mid-way, after the first tokens): options of a choice, and the count of a
# bounded repeat (`a{N}`, `{M,N}`) in a regex or a JSON schema's "pattern".
MAX_CHOICES = 10_000
MAX_REGEX_REPEAT = 10_000


def compile_grammar(params: Any) -> str:
    """The llguidance grammar (a JSON string) for one StructuredOutputsParams; ValueError
    naming the field and the problem when it does not compile."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    given = [name for name in ("json", "regex", "choice", "grammar")
             if getattr(params, name) is not None]
    if params.json_object:
        given.append("json_object")
    if len(given) != 1:
        raise ValueError(
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
            f"got {', '.join(given) if given else 'none'}")
    kind = given[0]
    try:
        if kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(_schema(params.json), JSON_DEFAULTS)
            what = "JSON schema"
        elif kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, JSON_DEFAULTS)
            what = "JSON schema"
        elif kind == "regex":
            if not isinstance(params.regex, str):
                raise ValueError(f"regex must be a string, got {params.regex!r}")
            check_regex_repeats(params.regex, "regex")
            grammar = LLMatcher.grammar_from_regex(params.regex)
            what = "regex"
        elif kind == "choice":
            grammar = LLMatcher.grammar_from_lark(choice_lark(params.choice))
            what = "choice"
        else:
            text = params.grammar
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"grammar must be a non-empty string, got {text!r}")
            if "::=" in text:  # GBNF (llama.cpp's, xgrammar's): llguidance converts it
                text = gbnf_to_lark(text)
            grammar = LLMatcher.grammar_from_lark(text)
            what = "grammar"
    except ValueError:
        raise
    except Exception as e:  # llguidance raises its own types for some malformed input
        raise ValueError(f"invalid {kind}: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {what}: {error.strip()}")
    return grammar


# Left as they are: data, not schemas; allOf branches (see below); and the schemas whose
# tightening would loosen the whole (`not`) or move which branch applies (`if`).
_KEEP_AS_IS = frozenset({"enum", "const", "default", "examples", "allOf", "not", "if"})


def close_objects(schema: Any) -> Any:
    """A copy of the schema where every object schema that lists `properties` and says
    nothing of `additionalProperties` allows no others (OpenAI's strict mode). Every output
    valid under the copy is valid under the original; a small model sampling under the
    open schema tends to invent keys until max_tokens. `allOf` branches stay open (closing
    one would refuse the other branches' properties), and so do `not` and `if`."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _KEEP_AS_IS else close_objects(v)) for k, v in schema.items()}
    properties = schema.get("properties")
    required = schema.get("required")
    if (isinstance(properties, dict) and not _OPEN_BY.intersection(schema)
            and (not isinstance(required, list) or set(required) <= set(properties))):
        out["additionalProperties"] = False
    return out


# An object schema with one of these keeps its other keys open: they say how (or they may
# name properties that `properties` does not list, which closing would make unsatisfiable).
_OPEN_BY = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties",
                      "allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas",
                      "dependentRequired"})


def _schema(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON schema: not valid JSON ({e})") from None
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise ValueError(f"invalid JSON schema: a schema is a JSON object, got {value!r}")
    _check_schema_bounds(value)
    return close_objects(value)


# String lengths become bounded repeats in llguidance's lexer: the same bound applies.
_LENGTH_KEYS = ("minLength", "maxLength")


def _check_schema_bounds(schema: Any, depth: int = 0) -> None:
    """Every "pattern" (and patternProperties key) and string length of a schema within
    MAX_REGEX_REPEAT (check_regex_repeats)."""
    if depth > 200:
        raise ValueError("invalid JSON schema: nested deeper than 200 levels")
    if isinstance(schema, list):
        for item in schema:
            _check_schema_bounds(item, depth + 1)
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key == "enum" and isinstance(value, list) and len(value) > MAX_CHOICES:
            raise ValueError(f"JSON schema enum has {len(value)} values; at most "
                             f"{MAX_CHOICES} are allowed")
        if key in ("enum", "const", "default", "examples"):
            continue
        if key == "pattern" and isinstance(value, str):
            check_regex_repeats(value, "JSON schema pattern")
        elif key == "patternProperties" and isinstance(value, dict):
            for pattern in value:
                check_regex_repeats(pattern, "JSON schema patternProperties")
        elif key in _LENGTH_KEYS and isinstance(value, int) and value > MAX_REGEX_REPEAT:
            raise ValueError(f"JSON schema {key} is {value}; at most {MAX_REGEX_REPEAT} "
                             "is allowed")
        _check_schema_bounds(value, depth + 1)


def choice_lark(choices: Any) -> str:
    """A Lark grammar whose sentences are exactly the given strings: one lexeme (a
    terminal, upper case), so the options are one alternation of the lexer's and not one
    parser item each (llguidance's parser refuses a row of over 2,000 items mid-way)."""
    if (not isinstance(choices, (list, tuple)) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choices!r}")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"choice has {len(choices)} options; at most {MAX_CHOICES} are allowed")
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


def check_regex_repeats(regex: str, what: str) -> None:
    """ValueError when a bounded repeat of the regex counts over MAX_REGEX_REPEAT. A regex
    Python cannot parse (llguidance's syntax is wider: `\\p{L}`) is left to llguidance."""
    import re._parser as sre_parse  # the parser of Python's own `re`

    try:
        parsed = sre_parse.parse(regex)
    except (re.error, OverflowError, RecursionError):
        return
    largest = _largest_repeat(parsed)
    if largest > MAX_REGEX_REPEAT:
        raise ValueError(f"{what} repeats {largest} times; at most {MAX_REGEX_REPEAT} "
                         "repetitions are allowed")


def _largest_repeat(parsed: Any) -> int:
    """The largest finite bound of any {M,N} repeat in a parsed regex (sre_parse's tree)."""
    largest = 0
    for op, arg in parsed:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            bound = low if str(high) == "MAXREPEAT" else max(low, high)
            largest = max(largest, bound, _largest_repeat(sub))
        elif name == "SUBPATTERN":
            largest = max(largest, _largest_repeat(arg[-1]))
        elif name == "BRANCH":
            largest = max([largest] + [_largest_repeat(b) for b in arg[1]])
        elif name in ("ASSERT", "ASSERT_NOT"):
            largest = max(largest, _largest_repeat(arg[1]))
    return largest
