"""Tokenizers (with their chat templates): HF files, GGUF metadata or hub.

Folders that `tokenizers` alone reads the way transformers does load as a FastTokenizer
(milliseconds, no transformers import); the others, and the first build of a GGUF's
tokenizer, go through transformers' AutoTokenizer.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.loader import hub
from pagedllm.loader.errors import ModelLoadError, first_line
from pagedllm.loader.fast_tokenizer import FastTokenizer
from pagedllm.loader.gguf_loader import file_key, open_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Tokenizer = "FastTokenizer | PreTrainedTokenizerBase"
_GGUF_TOKENIZERS: dict[tuple[str, int, int], Tokenizer] = {}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def _from_folder(folder: Path) -> Tokenizer:
    fast = FastTokenizer.from_folder(folder)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _gguf_tokenizer(path: Path) -> Tokenizer:
    """transformers' tokenizer of a GGUF, saved once under the cache directory.

    transformers builds it from the GGUF's vocabulary, merges and chat template after
    parsing the whole file again (5-10 s on 2 cores); the saved tokenizer.json loads in
    milliseconds (through `tokenizers` alone). The cache key is a hash of the file's header
    (everything but the tensor data: the tokenizer's only source) and of the transformers
    version.
    """
    folder = _cache_folder(path)
    if (folder / "tokenizer_config.json").is_file():
        try:
            return _from_folder(folder)
        except Exception as e:  # a damaged entry: rebuild it
            logger.warning("ignoring the cached tokenizer in %s (%s)", folder, first_line(e))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=folder.parent, prefix=".partial-")
        try:
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(folder, ignore_errors=True)  # a damaged entry
            os.replace(tmp, folder)  # whole entries only; another process may win the race
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # e.g. a read-only home: it works, only slower next time
        logger.warning("cannot cache the tokenizer in %s (%s)", folder, first_line(e))
        return tokenizer
    # The saved entry, as every later process reads it (one tokenizer class per file).
    return FastTokenizer.from_folder(folder) or tokenizer


def _cache_folder(path: Path) -> Path:
    from importlib.metadata import version  # not transformers.__version__: no import

    reader = open_gguf(str(path))
    digest = hashlib.sha256(version("transformers").encode())
    digest.update(bytes(reader.data[: reader.data_offset]))
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm"
    return Path(root) / "tokenizers" / digest.hexdigest()[:32]


def load_tokenizer(path: str) -> Tokenizer:
    """From a .gguf file, a directory (tokenizer files, or a single .gguf) or a hub id."""
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
            key = file_key(str(p))
            if key not in _GGUF_TOKENIZERS:
                _GGUF_TOKENIZERS[key] = _gguf_tokenizer(p)
            return _GGUF_TOKENIZERS[key]
        return _from_folder(p)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(path, f"cannot load the tokenizer ({first_line(e)})") from e
