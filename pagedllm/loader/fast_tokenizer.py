"""FastTokenizer: a saved Hugging Face tokenizer through the `tokenizers` library alone.

transformers takes ~1.5 s to import on two cores, all of it only to hand encode/decode to
the Rust tokenizer that `tokenizers` loads in milliseconds. This class is the part of
transformers' fast-tokenizer API that pagedllm and its users call (encode, decode,
convert_ids_to_tokens, len, the special tokens, chat_template, apply_chat_template,
save_pretrained, backend_tokenizer), with the same results: tests/test_fast_tokenizer.py
compares it with transformers' AutoTokenizer of the same folder.

A folder qualifies only where transformers would do nothing beyond tokenizer.json (the
generic fast classes, no cleanup of spaces on a non-BPE model); anything else returns None
from `from_folder` and goes through transformers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pagedllm.loader import chat_template as templates

# Classes whose from_pretrained is tokenizer.json plus the config's special tokens.
_GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "special_tokens_map.json")


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _template_of(folder: Path, config: dict) -> Any:
    jinja = folder / "chat_template.jinja"  # transformers >= 4.50 saves it apart
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return config.get("chat_template")


def _same_added_tokens(backend: Any, declared: dict) -> bool:
    """The config's added tokens are tokenizer.json's own (as Hub folders save them)."""
    have = backend.get_added_tokens_decoder()
    for key, token in declared.items():
        mine = have.get(int(key))
        if mine is None or mine.content != _content(token) or (
                isinstance(token, dict) and bool(token.get("special")) != mine.special):
            return False
    return True


class FastTokenizer:
    def __init__(self, backend: Any, config: dict, template: Any, folder: Path) -> None:
        self.backend_tokenizer = backend
        self.chat_template = template
        self._folder = folder
        self.special_tokens_map = {name: _content(config[name]) for name in _SPECIAL_NAMES
                                   if _content(config.get(name)) is not None}
        for name in _SPECIAL_NAMES:
            token = self.special_tokens_map.get(name)
            setattr(self, name, token)
            setattr(self, name + "_id", None if token is None else backend.token_to_id(token))

    @classmethod
    def from_folder(cls, folder: str | Path) -> FastTokenizer | None:
        """None where the folder needs transformers to tokenize the same way."""
        folder = Path(folder)
        path, config_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not (path.is_file() and config_path.is_file()):
            return None
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.get("tokenizer_class") not in _GENERIC_CLASSES:
            return None
        if (folder / "added_tokens.json").is_file():
            return None  # tokens transformers adds on top of tokenizer.json
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(path))
        if not _same_added_tokens(backend, config.get("added_tokens_decoder") or {}):
            return None
        if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
            return None  # transformers rewrites spaces after decoding there
        if any(_content(config.get(n)) is not None
               and backend.token_to_id(_content(config[n])) is None for n in _SPECIAL_NAMES):
            return None  # transformers would add the missing special token
        return cls(backend, config, _template_of(folder, config), folder)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        """id -> AddedToken (content, special), as transformers' attribute of that name."""
        return self.backend_tokenizer.get_added_tokens_decoder()

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt tokenized on the
        # server's thread pool must not stall the engine thread, as with transformers.
        batch = self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation: list[Any], tools: list | None = None,
                            documents: list | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            **kwargs: Any) -> str | list[int]:
        """transformers' apply_chat_template for one conversation: the text, or with
        tokenize=True its ids (the template writes the special tokens, so none are added)."""
        template = templates.pick_template(chat_template or self.chat_template, tools)
        if template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template "
                             "is not set and no template argument was passed!")
        text = templates.render(
            template, conversation, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in _FILES:
            if (self._folder / name).is_file():
                shutil.copyfile(self._folder / name, directory / name)
