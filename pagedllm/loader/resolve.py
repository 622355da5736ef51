"""load_model_source: turn what the user typed into a ModelSource.

None -> the default GGUF; a .gguf file, or a directory holding one -> GGUF; a directory with
config.json -> safetensors; a preset name, or load_format="dummy" -> dummy weights;
'org/name' -> a Hugging Face hub download.
"""
from __future__ import annotations

from pathlib import Path

from pagedllm.config import LOAD_FORMATS
from pagedllm.loader import hub
from pagedllm.loader.default_model import default_model_path
from pagedllm.loader.dummy import DEFAULT_PRESET, preset_config_file, preset_names
from pagedllm.loader.errors import ModelLoadError
from pagedllm.loader.gguf_loader import gguf_model_config, gguf_model_name, load_gguf, open_gguf
from pagedllm.loader.hf_loader import config_from_hf_json, load_hf_dir
from pagedllm.loader.source import ModelSource
from pagedllm.loader.tokenizer import has_tokenizer_files, load_tokenizer


def load_model_source(
    model: str | None = None, load_format: str = "auto", tokenizer: str | None = None,
    with_tokenizer: bool = True,
) -> ModelSource:
    """Config, tokenizer and weights of a model; `tokenizer` overrides the model's own.
    `with_tokenizer` False: the tokenizer's path only (ModelSource.tokenizer_path), not
    loaded (the engine loads it on rank 0; a worker never needs it).

    The model's own tokenizer is None for dummy weights, and for a GGUF without tokenizer
    metadata or a directory without tokenizer files (bare test checkpoints).
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(
            "load_format", f"must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}"
        )
    if load_format == "dummy":
        source, own_tokenizer = _dummy_source(model or DEFAULT_PRESET), None
    elif model is None:
        source, own_tokenizer = _gguf_source(default_model_path())
    else:
        source, own_tokenizer = _source(model, load_format)
    source.tokenizer_path = tokenizer or own_tokenizer
    if with_tokenizer and source.tokenizer_path is not None:
        source.tokenizer = load_tokenizer(source.tokenizer_path)
    return source


def _source(model: str, load_format: str) -> tuple[ModelSource, str | None]:
    path = Path(model).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_file():
        if load_format == "safetensors":
            raise ModelLoadError(
                model, "load_format='safetensors' needs a directory with config.json"
            )
        if path.suffix == ".safetensors":
            raise ModelLoadError(model, "pass the directory that holds it and its config.json")
        if path.suffix == ".json":
            raise ModelLoadError(model, "a config alone has no weights; use load_format='dummy'")
        return _gguf_source(str(path))
    if path.is_dir():
        if (path / "config.json").is_file() and load_format != "gguf":
            return _hf_source(str(path), _folder_name(path))
        gguf_file = _single_gguf(path, model)
        if gguf_file is None or load_format == "safetensors":
            wanted = {"auto": "config.json or .gguf file", "gguf": ".gguf file",
                      "safetensors": "config.json"}[load_format]
            raise ModelLoadError(model, f"no {wanted} in this directory")
        return _gguf_source(str(gguf_file))
    if preset_config_file(model) is not None:
        if load_format != "auto":
            raise ModelLoadError(
                model, f"a preset has no {load_format} weights; use load_format='dummy'"
            )
        return _dummy_source(model), None
    if hub.looks_like_hub_id(model):
        if load_format == "gguf":
            raise ModelLoadError(
                model, "GGUF files are not downloaded from the hub; pass the .gguf file's path"
            )
        folder = hub.download(model, hub.MODEL_PATTERNS)
        if not (Path(folder) / "config.json").is_file():
            raise ModelLoadError(
                model, "the hub repository has no config.json (for a GGUF repository, "
                "download the .gguf file and pass its path)"
            )
        return _hf_source(folder, model)
    raise ModelLoadError(model, "no such file or directory")


def _gguf_source(path: str) -> tuple[ModelSource, str | None]:
    config, weights, has_tokenizer = load_gguf(path)
    source = ModelSource(gguf_model_name(path), path, config, None, "gguf", weights)
    return source, path if has_tokenizer else None


def _hf_source(folder: str, name: str) -> tuple[ModelSource, str | None]:
    config, weights = load_hf_dir(folder)
    source = ModelSource(name, folder, config, None, "safetensors", weights)
    return source, folder if has_tokenizer_files(folder) else None


def _dummy_source(model: str) -> ModelSource:
    """Only the shape: from a preset, a config.json (or its directory), a .gguf or a hub id."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            path = path / "config.json"
        else:
            gguf_file = _single_gguf(path, model)
            if gguf_file is None:
                raise ModelLoadError(model, "no config.json or .gguf file in this directory")
            path = gguf_file
    if path.is_file():
        if path.suffix == ".gguf":
            config = gguf_model_config(open_gguf(str(path)), str(path))
            return ModelSource(gguf_model_name(str(path)), None, config, None, "dummy")
        name = _folder_name(path.parent) if path.name == "config.json" else path.stem
        return ModelSource(name, None, config_from_hf_json(path, model), None, "dummy")
    preset = preset_config_file(model)
    if preset is not None:
        return ModelSource(model.lower(), None, config_from_hf_json(preset, model), None, "dummy")
    if hub.looks_like_hub_id(model):
        folder = Path(hub.download(model, ["config.json", "generation_config.json"]))
        config = config_from_hf_json(folder / "config.json", model)
        return ModelSource(model, None, config, None, "dummy")
    raise ModelLoadError(
        model, f"no such file, directory or preset (presets: {', '.join(preset_names())})"
    )


def _single_gguf(folder: Path, where: str) -> Path | None:
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        raise ModelLoadError(
            where,
            f"several .gguf files in this directory ({', '.join(f.name for f in files)}); pass one",
        )
    return files[0] if files else None


def _folder_name(folder: Path) -> str:
    return folder.resolve().name
