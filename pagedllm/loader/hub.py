"""Hugging Face hub ids ('org/name'): download a snapshot, or say clearly why we cannot."""
from __future__ import annotations

import re

from pagedllm.loader.errors import ModelLoadError, first_line

MODEL_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "*.model",
    "special_tokens_map.json",
    "chat_template.jinja",
]
TOKENIZER_PATTERNS = [
    "config.json",
    "tokenizer*",
    "*.model",
    "special_tokens_map.json",
    "chat_template.jinja",
]
OFFLINE = (
    "cannot download from the Hugging Face hub: no network access (offline). "
    "Pass a local path to a model directory or a .gguf file."
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_FILE_SUFFIXES = (".gguf", ".json", ".safetensors", ".bin")


def looks_like_hub_id(name: str) -> bool:
    """'org/name' that is not a file path someone mistyped."""
    return bool(_HUB_ID.match(name)) and ".." not in name and not name.endswith(_FILE_SUFFIXES)


def download(repo_id: str, patterns: list[str]) -> str:
    """snapshot_download, with the hub's errors turned into one line naming the repo.

    How long an unreachable hub is waited for follows HF_HUB_ETAG_TIMEOUT; HF_HUB_OFFLINE=1
    skips the network and answers from the local cache only.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError, TimeoutError) as e:
        raise ModelLoadError(repo_id, OFFLINE) from e
    except RepositoryNotFoundError as e:  # also gated and private repositories
        raise ModelLoadError(
            repo_id,
            "not found on the Hugging Face hub (a private or gated model needs `hf auth login`)",
        ) from e
    except RevisionNotFoundError as e:
        problem = f"revision not found on the Hugging Face hub ({first_line(e)})"
        raise ModelLoadError(repo_id, problem) from e
    except (HfHubHTTPError, OSError) as e:
        problem = f"download from the Hugging Face hub failed ({first_line(e)})"
        raise ModelLoadError(repo_id, problem) from e
