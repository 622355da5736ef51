"""Model loaders: GGUF, Hugging Face safetensors directories, hub ids and dummy weights."""
from pagedllm.loader.default_model import default_model_path
from pagedllm.loader.dummy import initialize_dummy_weights, preset_names
from pagedllm.loader.errors import ModelLoadError
from pagedllm.loader.resolve import LOAD_FORMATS, load_model_source
from pagedllm.loader.source import ModelSource
from pagedllm.loader.tokenizer import load_tokenizer

__all__ = [
    "LOAD_FORMATS",
    "ModelLoadError",
    "ModelSource",
    "default_model_path",
    "initialize_dummy_weights",
    "load_model_source",
    "load_tokenizer",
    "preset_names",
]
