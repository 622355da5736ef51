"""Chat messages to prompt token ids, as vLLM's LLM.chat and chat server do.

A message is a dict with a "role" and a "content": a string, None, or a list of OpenAI
content parts of which only text parts ({"type": "text", "text": ...}, or a bare string)
are supported; the parts' texts are joined with newlines, as vLLM does for chat templates
that take string content. The conversation then goes through the tokenizer's chat template
(or the one given), and the rendered text is tokenized without adding special tokens (the
template writes them).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Arguments of tokenizer.apply_chat_template that the caller sets through its own
# parameters, not through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "tools", "documents", "chat_template",
                             "add_generation_prompt", "continue_final_message", "tokenize",
                             "padding", "truncation", "max_length", "return_tensors",
                             "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def parse_chat_messages(messages: Any) -> list[dict[str, Any]]:
    """One conversation as the chat template takes it: content parts become one string.

    Other keys of a message (name, tool_calls, tool_call_id, ...) go to the template as
    they are.
    """
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"a conversation is a list of message dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("the conversation has no messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', "
                            f"got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] has no 'role' string")
        d = dict(message)
        d["content"] = _content_text(message.get("content"), f"messages[{i}].content")
        parsed.append(d)
    return parsed


def _content_text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise TypeError(f"{where} must be a string or a list of content parts, "
                        f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            shown = repr(kind) if kind is not None else type(part).__name__
            raise ValueError(f"{where}[{j}]: content part {shown} is not supported "
                             "(only text parts: {'type': 'text', 'text': ...})")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}]: a text part needs a 'text' string")
        texts.append(part["text"])
    return "\n".join(texts)


def apply_chat_template(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt token ids of one conversation (see the module docstring).

    continue_final_message leaves the last message open, so the model continues it (for
    example a partial assistant answer); it cannot be combined with add_generation_prompt.
    """
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it has no chat template; "
                         "pass token ids to generate()")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass chat_template=...")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                         "True: pass add_generation_prompt=False to continue the last message")
    conversation = parse_chat_messages(messages)
    if continue_final_message and not conversation[-1].get("content"):
        raise ValueError("continue_final_message needs a last message with content to continue")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & set(_RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)} "
                         "(pass them as arguments of their own)")
    text = tokenizer.apply_chat_template(
        conversation, chat_template=chat_template, tools=tools, tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, **kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=False)
