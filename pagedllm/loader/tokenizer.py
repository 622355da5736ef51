"""Tokenizers (with their chat templates) through transformers: HF files, GGUF metadata or hub."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.loader import hub
from pagedllm.loader.errors import ModelLoadError, first_line
from pagedllm.loader.gguf_loader import file_key

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_GGUF_TOKENIZERS: dict[tuple[str, int, int], PreTrainedTokenizerBase] = {}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """From a .gguf file, a directory (tokenizer files, or a single .gguf) or a hub id."""
    from transformers import AutoTokenizer

    p = Path(path).expanduser()
    if p.is_dir():
        if not has_tokenizer_files(p):
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ModelLoadError(
                    path, f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in this directory"
                )
            p = ggufs[0]
    elif not p.is_file():
        if hub.looks_like_hub_id(path):
            return load_tokenizer(hub.download(path, hub.TOKENIZER_PATTERNS))
        raise ModelLoadError(path, "no such file or directory")
    try:
        if p.is_file():
            if p.suffix != ".gguf":
                raise ModelLoadError(path, "a tokenizer is a directory, a .gguf file or a hub id")
            # transformers converts the GGUF's vocabulary, merges and chat template; that
            # re-reads the file (seconds), so do it once per file and process.
            key = file_key(str(p))
            if key not in _GGUF_TOKENIZERS:
                _GGUF_TOKENIZERS[key] = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
            return _GGUF_TOKENIZERS[key]
        return AutoTokenizer.from_pretrained(str(p))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(path, f"cannot load the tokenizer ({first_line(e)})") from e
