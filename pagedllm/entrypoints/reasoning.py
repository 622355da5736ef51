"""Reasoning output (vLLM's --reasoning-parser qwen3 | deepseek_r1): the text a model writes
between <think> and </think> is its reasoning, the rest its answer.

Where the output starts is read from the prompt's end (`thinking_mode`): a prompt that opens
<think> (DeepSeek-R1's template, Qwen3's thinking models) starts the output inside the
thinking; one that closes it (Qwen3's template with enable_thinking false) starts in the
answer; otherwise qwen3 lets the model open <think> itself, and deepseek_r1 reads the output
as thinking until </think> (R1 models often leave the opening tag out).

`split_reasoning` splits a whole output, `ReasoningSplitter` a streamed one the same way
(the concatenated deltas of a stream equal the split of its text), and `thinking_grammar`
puts a free thinking section before a grammar, so that a response_format or a tool grammar
constrains the answer alone (and `thinking_token_budget` can bound the thinking).
"""
from __future__ import annotations

import json
from typing import Literal

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")

# open: the output starts inside the thinking; closed: it does not think; may_open: it may
# start with <think>; implicit: it thinks until </think>, with or without the opening tag.
ThinkingMode = Literal["open", "closed", "may_open", "implicit"]


def thinking_mode(parser: str, prompt_tail: str) -> ThinkingMode:
    """Where the output of a prompt ending with `prompt_tail` starts (see the docstring)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; choose from "
                         f"{', '.join(REASONING_PARSERS)}")
    tail = prompt_tail.rstrip()
    if tail.rfind(THINK_START) > tail.rfind(THINK_END):
        return "open"
    if tail.endswith(THINK_END):
        return "closed"
    return "may_open" if parser == "qwen3" else "implicit"


class ReasoningSplitter:
    """Splits a streamed output into (reasoning, content) deltas. Text that may be the start
    of a tag is held back until the next delta (or `finish`) tells."""

    def __init__(self, mode: ThinkingMode) -> None:
        self.mode = mode
        self.state = "content" if mode == "closed" else "start"
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the output so far that is no longer in doubt."""
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(THINK_START):
                    self.pending = head[len(THINK_START):]
                    self.state = "thinking"
                    continue
                if THINK_START.startswith(head):  # maybe the tag, not all of it here yet
                    break
                self._no_opening_tag()
            elif self.state == "thinking":
                end = self.pending.find(THINK_END)
                if end >= 0:
                    reasoning.append(self.pending[:end])
                    self.pending = self.pending[end + len(THINK_END):]
                    self.state = "content"
                    continue
                keep = _partial_suffix(self.pending, THINK_END)
                reasoning.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            else:
                content.append(self.pending)
                self.pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        if self.state == "start":
            self._no_opening_tag()
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == "thinking" else ("", rest)

    def _no_opening_tag(self) -> None:
        self.state = "thinking" if self.mode in ("open", "implicit") else "content"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (shorter than the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(text: str, mode: ThinkingMode) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None where empty. An output cut short while
    thinking is all reasoning."""
    splitter = ReasoningSplitter(mode)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2) or None, (c1 + c2) or None


def thinking_grammar(answer: str | None, mode: ThinkingMode, budget: int | None = None,
                     end_tag_tokens: int = 0) -> str:
    """One llguidance grammar: a free thinking section (at most `budget` tokens, then
    </think> is forced), then `answer` (a compiled grammar: JSON of a TopLevelGrammar or
    Lark text; None: any text, and the result is Lark text). With thinking closed, the
    answer grammar alone.

    llguidance counts the tokens of a `stop` string in the lexeme's max_tokens: the budget
    is raised by `end_tag_tokens`, the tokens </think> takes in this vocabulary."""
    if mode == "closed":
        if answer is None:
            raise ValueError("no grammar: the prompt closed the thinking")
        return answer
    limit = f", max_tokens={budget + end_tag_tokens}" if budget is not None else ""
    starts = {"open": "think", "implicit": f'"{THINK_START}"? think',
              "may_open": f'("{THINK_START}" think)?'}[mode]
    grammars: list[dict] = []
    if answer is None:
        rest = "TEXT\nTEXT: /(?s:.*)/"
    else:
        grammars = _named(answer, "answer")
        rest = "@answer"
    lark = (f"start: {starts} {rest}\n"
            f'think: thinking "{THINK_END}"\n'
            f'thinking[stop="{THINK_END}"{limit}]: /(?s:.*)/\n')
    if not grammars:  # Lark text alone is a grammar too
        return lark
    return json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]})


def _named(compiled: str, name: str) -> list[dict]:
    """The grammars of a compiled grammar, its top one renamed `name`."""
    text = compiled.lstrip()
    if text.startswith("{"):
        top = json.loads(text)
        grammars = [dict(g) for g in top["grammars"]]
        if len(grammars) != 1:  # index references (@1) would shift under the new top
            raise ValueError("a grammar of several grammars cannot follow the thinking")
    else:
        grammars = [{"lark_grammar": compiled}]
    grammars[0]["name"] = name
    return grammars


def constrain_after_thinking(structured, mode: ThinkingMode, budget: int | None,
                             end_tag_tokens: int = 0):
    """The StructuredOutputsParams a request samples under with thinking: its own grammar
    after a free thinking section (bounded by `budget`); None when there is nothing to
    constrain. ValueError when the grammar cannot follow the thinking."""
    import copy

    from llguidance import LLMatcher

    from pagedllm.sampling_params import StructuredOutputsParams

    if mode == "closed" or (structured is None and budget is None):
        return structured
    grammar = thinking_grammar(structured.compiled if structured is not None else None,
                               mode, budget, end_tag_tokens)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"the grammar cannot follow the thinking: {error.strip()}")
    out = copy.copy(structured) if structured is not None else StructuredOutputsParams(
        regex="(?s:.*)")  # any text: its compiled grammar is replaced below
    out.compiled = grammar
    return out
