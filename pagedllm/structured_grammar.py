"""Structured output's grammars: StructuredOutputsParams -> one llguidance grammar.

Ground floor (beside sampling_params.py, which calls it when a StructuredOutputsParams is
made): it needs no tokenizer, so a schema, regex or grammar that cannot compile is refused
before any request reaches an engine. llguidance (https://github.com/guidance-ai/llguidance)
compiles JSON schemas, regexes and Lark grammars lazily against the tokenizer while
sampling; the engine's matchers are in engine/structured_output.py.
"""
from __future__ import annotations

import json
from typing import Any

# JSON is written compactly (", " and ": " between items, no other whitespace): a small
# model sampled at temperature 1 otherwise spends its tokens on newlines. A schema's own
# "x-guidance" options override this.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}

# json_object: any JSON object (OpenAI's {"type": "json_object"}).
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


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
    return close_objects(value)


def choice_lark(choices: Any) -> str:
    """A Lark grammar whose sentences are exactly the given strings."""
    if (not isinstance(choices, (list, tuple)) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choices!r}")
    return "start: " + " | ".join(json.dumps(c) for c in choices)
