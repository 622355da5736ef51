"""FastTokenizer (tokenizers + jinja2, no transformers) against transformers' AutoTokenizer.

The oracle is transformers' tokenizer built from the default GGUF (conftest's hf_reference),
so the whole path (GGUF -> saved tokenizer.json -> `tokenizers`) is compared with what
transformers does with the same file.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.loader import load_tokenizer
from pagedllm.loader.fast_tokenizer import FastTokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing  ",
    "héllo wörld — ünïcode ✓ 日本語 🙂",
    "tabs\tand\nnewlines\r\n\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "numbers 1234567890 3.14159 and code: def f(x): return x**2",
    "It was the best of times, it was the worst of times. " * 20,
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

# Templates that use what transformers' environment adds: tojson with options, namespace,
# loop controls, raise_exception, trim_blocks/lstrip_blocks, the generation tag, tools.
TEMPLATES = {
    "kwargs": ("{{ greeting }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
               "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"),
    "tools": """{%- set ns = namespace(first=true) -%}
{% if tools %}<tools>
{% for t in tools %}{{ t | tojson(indent=2) }}
{% endfor %}</tools>
{% endif %}
{% for m in messages %}
    {% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system first') }}{% endif %}
    {% if m['role'] == 'skip' %}{% continue %}{% endif %}
{{ bos_token }}{{ m['role'] }}: {% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}
    {% set ns.first = false %}
{% endfor %}
{% if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}""",
    "json": "{% for m in messages %}{{ m | tojson }}|{{ {'k': 'é<>&'} | tojson }}{% endfor %}",
}

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünïcode"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "Hi"}, {"role": "skip", "content": "x"},
     {"role": "assistant", "content": "Partial answer "}],
]


@pytest.fixture(scope="module")
def pair(default_gguf, hf_reference):
    fast = load_tokenizer(default_gguf)
    assert isinstance(fast, FastTokenizer)
    return fast, hf_reference[1]


def test_encode_decode_and_vocabulary_match_transformers(pair):
    fast, hf = pair
    assert len(fast) == len(hf)
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id, fast.unk_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id)
    assert fast.special_tokens_map == hf.special_tokens_map
    assert ({i: (t.content, t.special) for i, t in fast.added_tokens_decoder.items()}
            == {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()})
    assert fast.convert_ids_to_tokens(list(range(len(hf)))) == hf.convert_ids_to_tokens(
        list(range(len(hf))))
    for text in TEXTS:
        for special in (True, False):
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)
    assert fast.decode(5) == hf.decode(5)


def outcome(tokenizer, conversation, kwargs) -> tuple[str, str]:
    """The rendered text, or the error's type and message."""
    try:
        return "text", tokenizer.apply_chat_template(conversation, **kwargs)
    except ValueError as exc:
        return "ValueError", str(exc)


@pytest.mark.parametrize("name", [None, *TEMPLATES])
def test_chat_templates_render_as_transformers(pair, name):
    fast, hf = pair
    template = TEMPLATES.get(name)
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            kwargs = dict(chat_template=template, add_generation_prompt=generation_prompt,
                          tokenize=False, greeting="Welcome! ")
            if name == "tools":
                kwargs["tools"] = TOOLS
            assert fast.apply_chat_template(conversation, **kwargs) == hf.apply_chat_template(
                conversation, **kwargs)
        continued = dict(chat_template=template, continue_final_message=True, tokenize=False)
        assert outcome(fast, conversation, continued) == outcome(hf, conversation, continued)
    ids = fast.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    assert ids == hf.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True,
                                         return_dict=False)


def test_template_errors_are_transformers_errors(pair):
    import jinja2

    fast, _ = pair
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="system first"):
        fast.apply_chat_template(bad, chat_template=TEMPLATES["tools"], tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        fast.apply_chat_template(CONVERSATIONS[0], tokenize=False,
                                 chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(ValueError, match="empty conversation"):
        fast.apply_chat_template([], tokenize=False)


def test_saved_folder_loads_fast_and_others_go_through_transformers(pair, tmp_path):
    import json

    fast, hf = pair
    fast.save_pretrained(tmp_path / "tok")
    again = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(again, FastTokenizer) and again.chat_template == fast.chat_template
    assert again.encode(TEXTS[2]) == hf.encode(TEXTS[2])
    # A class transformers builds its own way is left to transformers.
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizerFast"
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    assert FastTokenizer.from_folder(tmp_path / "tok") is None
    assert not isinstance(load_tokenizer(str(tmp_path / "tok")), FastTokenizer)


def test_the_default_model_starts_without_transformers():
    code = ("import sys; from pagedllm import LLM; llm = LLM(); "
            "llm.generate('hi', use_tqdm=False); "
            "print('transformers' in sys.modules, 'triton' in sys.modules, "
            "'fastapi' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr[-2000:]
