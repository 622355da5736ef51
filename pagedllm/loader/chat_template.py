"""Chat templates rendered with jinja2 the way transformers' apply_chat_template renders them.

The same sandboxed environment (trim_blocks, lstrip_blocks, loop controls, the
`{% generation %}` tag accepted), the same globals (raise_exception, strftime_now, a
restricted dict and namespace), the same tojson filter, the same variables (messages,
tools, documents, add_generation_prompt, the special tokens, then the caller's kwargs) and
the same continue_final_message trick. tests/test_fast_tokenizer.py compares the output
with transformers'. jinja2 alone is imported (tens of milliseconds), not transformers.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

# Names a message's reasoning may come under; templates read the first (as transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers only
        tracks its span for assistant masks, which nothing here asks for)."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateDict:  # dict() without attribute access to the type
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore names on a namespace
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}. Please rename the attribute.")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(source)


def plain(value: Any) -> Any:
    """Only JSON types reach the template (as transformers' _plain_template_data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums ...) lose their methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(conversation: list[Any]) -> list[dict]:
    out = []
    for message in conversation:
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, dict):
            raise TypeError("Chat messages should be dicts, dataclasses or pydantic models, "
                            f"but got {message!r}.")
        message = plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def pick_template(template: str | list | dict | None, tools: Any) -> str | None:
    """A tokenizer's template may be a dict of named ones: "tool_use" when tools are
    given and it has one, else "default" (as transformers' get_chat_template)."""
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict):
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" not in template:
            raise ValueError("This tokenizer has several chat templates and none named "
                             f"'default': pass one of {sorted(template)} as chat_template")
        return template["default"]
    return template


def render(template: str, conversation: list[Any], *, tools: list | None = None,
           documents: list | None = None, add_generation_prompt: bool = False,
           continue_final_message: bool | str = False, **kwargs: Any) -> str:
    """The rendered text of one conversation; kwargs hold the special tokens and the
    caller's own variables (the caller's win)."""
    if not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation. "
                         "Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("Tools should be JSON schemas (dicts).")
    chat = _messages(conversation)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if not isinstance(final, str):
            raise ValueError(f'continue_final_message is set but the final message has no '
                             f'"{field}" to continue!')
        fields = [field]
        if field in _REASONING_FIELDS:  # copied under several names: tag every copy
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message is set to "{field}" but this is not an '
                             'accepted field in the chat_template')
        for f in fields:
            chat[-1][f] = final + _CONTINUE_TAG
    text = compile_template(template).render(
        messages=chat, tools=plain(tools), documents=plain(documents),
        add_generation_prompt=add_generation_prompt, **plain(kwargs))
    if final is None:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message is set but the final message does not appear "
                         "in the chat after applying the chat template!")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
