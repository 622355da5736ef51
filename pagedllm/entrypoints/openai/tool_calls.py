"""Tool calling on /v1/chat/completions: the prompt, the grammar, the parser.

The model writes calls in the Hermes format (NousResearch's Hermes and Qwen templates use it;
most small instruct models have seen it):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. The tools reach the model through the chat template when it renders them
(`tools=` of Hugging Face's apply_chat_template: a template that mentions `tools`), else
through TOOLS_SYSTEM_PROMPT, added to (or as) the system message.

tool_choice:
- "none": the tools are not shown and nothing is parsed;
- "auto": the model may call; `<tool_call>` blocks are parsed out of its text;
- "required" / a named function: the output is constrained by a grammar (call_grammar) to
  one call (several with parallel_tool_calls) of the allowed functions whose arguments
  match their parameters schema, so it always parses.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.structured_grammar import JSON_DEFAULTS, close_objects

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

TOOLS_SYSTEM_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist "
    "with the user query. Don't make assumptions about what values to plug into functions. "
    "Here are the available tools:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a JSON object with the function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE)
                    + r"|$)", re.DOTALL)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str

    @staticmethod
    def make(name: str, arguments: Any) -> "ParsedCall":
        text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                        ensure_ascii=False)
        return ParsedCall(name, text, new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_dicts(tools: list[Any]) -> list[dict[str, Any]]:
    """The request's tools as plain OpenAI-shaped dicts (what templates take)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_SYSTEM_PROMPT.format(tools=listed)


def with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                      ) -> list[dict[str, Any]]:
    """The messages with the tools described in the system message (added first if none)."""
    prompt = tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def template_renders_tools(chat_template: Any) -> bool:
    """A template that reads the `tools` variable renders the definitions itself."""
    return isinstance(chat_template, str) and re.search(r"\btools\b", chat_template) is not None


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = close_objects(function.get("parameters") or {"type": "object",
                                                                "properties": {}})
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def call_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of one `<tool_call>` block, or several with
    `parallel`, each a call of one of `functions` with arguments valid for its schema."""
    schemas = [call_schema(f) for f in functions]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": JSON_DEFAULTS}
    repeat = ' ("\\n" call)*' if parallel else ""
    return (
        f"start: call{repeat}\n"
        f'call: "{TOOL_CALL_OPEN}\\n" body "\\n{TOOL_CALL_CLOSE}"\n'
        f"body: %json {json.dumps(schema)}\n"
    )


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """(the text outside the calls, or None when empty; the calls) from the model's text.
    A block must hold a JSON object with a known "name" and object "arguments" to count
    (an unclosed last block counts when its JSON is whole); a block that is no such call
    stays in the text."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _call_of(match.group(1), names)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    if not calls:
        return text, []
    content = "".join(kept).strip()
    return content or None, calls


def _call_of(body: str, names: set[str]) -> ParsedCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall.make(data["name"], arguments)


class ToolTextFilter:
    """Streaming with tool_choice "auto": text is sent as it comes until a `<tool_call>` may
    be starting; from there on it is held back and parsed when the choice ends. Only a
    suffix that could begin the tag waits for the next delta."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.in_call = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_call:
            return ""
        at = self.text.find(TOOL_CALL_OPEN, self.sent)
        if at >= 0:
            self.in_call = True
            out, self.sent = self.text[self.sent:at], at
            return out
        end = len(self.text)
        for k in range(min(len(TOOL_CALL_OPEN) - 1, end - self.sent), 0, -1):
            if TOOL_CALL_OPEN.startswith(self.text[end - k:]):
                end -= k
                break
        out, self.sent = self.text[self.sent:end], end
        return out

    def rest(self) -> str:
        """The text held back (call at the end): what the parser reads."""
        return self.text[self.sent:]
