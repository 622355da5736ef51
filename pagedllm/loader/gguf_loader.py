"""GGUF files (llama.cpp): config from the metadata, tensors dequantized to Hugging Face names."""
from __future__ import annotations

import functools
import logging
import os
import re
import struct
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pagedllm.config import ModelConfig
from pagedllm.layers.gguf_linear import PackedWeight
from pagedllm.loader.errors import ModelLoadError, first_line
from pagedllm.loader.gguf_dequant import dequantize
from pagedllm.loader.source import WeightIterator

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Llama 3.1 GGUFs carry the llama3 RoPE frequency factors as a tensor; Hugging Face keeps them
# in rope_scaling, which the GGUF metadata does not spell out, so this one is left behind.
_SKIPPED = {"rope_freqs.weight"}
# Quantization suffixes of GGUF file names ("Model.Q4_1", "Model-Q4_K_M", "model-f16").
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|B?F16|F32)$", re.IGNORECASE)


def gguf_model_name(path: str) -> str:
    return _QUANT_SUFFIX.sub("", Path(path).stem) or Path(path).stem


def file_key(path: str) -> tuple[str, int, int]:
    """Identifies a file's current contents cheaply, for in-process caches."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_mtime_ns, st.st_size


def open_gguf(path: str) -> gguf.GGUFReader:
    """Read the header and tensor index, turning every low-level failure into one line.

    Parsing the metadata takes seconds (tens of thousands of vocabulary strings), so a
    process that builds several engines from one file parses it once.
    """
    key = file_key(path)
    if key not in _READERS:
        _READERS.clear()  # keep at most one file mapped
        _READERS[key] = _open_gguf(path)
    return _READERS[key]


_READERS: dict[tuple[str, int, int], gguf.GGUFReader] = {}


class _Reader(gguf.GGUFReader):
    """GGUFReader with a fast header parse; the fields and tensors it builds are the same.

    The stock reader slices the memory map once or twice per array element: ~250,000 numpy
    views for a 49k-token vocabulary with its merges, about 2 s on 2 cores. Here every slice
    reads a plain ndarray view of the map (np.memmap slicing runs Python code each time), and
    the elements of an array field are located in one pass and viewed only when read.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            orig_offs = offs
            key_len, key = self._get_str(offs)
            raw_type = self._get(offs + 8 + int(key_len[0]), np.uint32)
            offs += 12 + int(key_len[0])
            head = [key_len, key, raw_type]
            lazy = self._lazy_array(offs, head) if raw_type[0] == gguf.GGUFValueType.ARRAY \
                else None
            if lazy is None:
                size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
                parts, idxs = head + parts, [i + len(head) for i in idxs]
            else:
                size, parts, idxs, types = lazy
            name = str(bytes(key), encoding="utf-8")
            self._push_field(gguf.ReaderField(orig_offs, name, parts, idxs, types), skip_sum=True)
            offs += size
        return offs

    def _lazy_array(self, offs: int, head: list[np.ndarray]):
        """(size, parts, data indices, types) of a flat array of strings or scalars, as the
        stock reader builds them, with the element parts viewed when read; None otherwise."""
        item_type = self._get(offs, np.uint32)
        if self.byte_order != "I" or not (
            item_type[0] == gguf.GGUFValueType.STRING or item_type[0] in _SCALAR_SIZES
        ):
            return None
        count = self._get(offs + 4, np.uint64)
        head = [*head, item_type, count]
        n, start = int(count[0]), offs + 12
        if item_type[0] == gguf.GGUFValueType.STRING:
            starts, end = _string_starts(self._plain, start, n)
            parts: Sequence = _StringParts(self, head, starts)
            idxs = range(len(head) + 1, len(head) + 2 * n, 2)
        else:
            end = start + _SCALAR_SIZES[int(item_type[0])] * n
            dtype = self.gguf_scalar_to_np[gguf.GGUFValueType(int(item_type[0]))]
            parts = _ScalarParts(self, head, start, dtype, n)
            idxs = range(len(head), len(head) + n)
        types = [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(int(item_type[0]))]
        return end - offs, parts, idxs, types


_SCALAR_SIZES = {t: np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}


def _string_starts(buf: np.ndarray, offset: int, count: int) -> tuple[np.ndarray, int]:
    """Offsets of the `count` length-prefixed strings stored back to back from `offset`, and
    the offset after the last one."""
    starts = [0] * count
    unpack = struct.Struct("<Q").unpack_from
    for i in range(count):
        starts[i] = offset
        offset += 8 + unpack(buf, offset)[0]
    if offset > len(buf):
        raise ValueError("string array runs past the end of the file")
    return np.asarray(starts, dtype=np.int64), offset


class _StringParts(Sequence):
    """[*head, len 0, bytes 0, len 1, bytes 1, ...], each element viewed when read."""

    def __init__(self, reader: _Reader, head: list[np.ndarray], starts: np.ndarray):
        self.reader, self.head, self.starts = reader, head, starts

    def __len__(self) -> int:
        return len(self.head) + 2 * len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, bounds
        if i < len(self.head):
            return self.head[i]
        j, is_bytes = divmod(i - len(self.head), 2)
        length = self.reader._get(int(self.starts[j]), np.uint64)
        return self.reader._get(int(self.starts[j]) + 8, np.uint8, length[0]) if is_bytes \
            else length


class _ScalarParts(Sequence):
    """[*head, element 0, element 1, ...], each a one-element view when read."""

    def __init__(self, reader: _Reader, head: list[np.ndarray], start: int, dtype, count: int):
        self.head, self.values = head, reader._get(start, dtype, count)
        if len(self.values) != count:
            raise ValueError("array runs past the end of the file")

    def __len__(self) -> int:
        return len(self.head) + len(self.values)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        k = i - len(self.head)
        return self.head[i] if k < 0 else self.values[k:k + 1]


def _open_gguf(path: str) -> gguf.GGUFReader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(path, "not a GGUF file (bad magic bytes)")
    try:
        return _Reader(path)
    except Exception as e:  # numpy reshape / index errors from a cut or damaged file
        raise ModelLoadError(path, "truncated or corrupt GGUF file") from e


def hf_tensor_name(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        hf = _LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    hf = _GLOBAL_NAMES.get(stem)
    return None if hf is None else f"{hf}.{kind}"


def load_gguf(path: str) -> tuple[ModelConfig, WeightIterator, bool]:
    """Config, weight iterator and whether the file carries a tokenizer.

    The whole file is validated here; the iterator only dequantizes.
    """
    reader = open_gguf(path)
    config = gguf_model_config(reader, path)
    plan = _weight_plan(reader, path, config)
    has_tokenizer = "tokenizer.ggml.model" in reader.fields
    return config, functools.partial(_iter_weights, path, plan), has_tokenizer


def gguf_model_config(reader: gguf.GGUFReader, path: str) -> ModelConfig:
    arch = _field(reader, path, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            path,
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}",
        )

    def key(name: str, default: Any = ...) -> Any:
        return _field(reader, path, f"{arch}.{name}", default)

    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError(path, "GGUF file has no token_embd.weight tensor")
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    eos = [_field(reader, path, f"tokenizer.ggml.{kind}_token_id", None)
           for kind in ("eos", "eot", "eom")]
    try:
        return ModelConfig(
            architecture=arch,
            # The embedding's rows, which the weights must match (the token list may be shorter).
            vocab_size=int(names["token_embd.weight"].shape[-1]),
            hidden_size=hidden,
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            intermediate_size=int(key("feed_forward_length")),
            max_position_embeddings=int(key("context_length", 2048)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(key),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            bos_token_id=_field(reader, path, "tokenizer.ggml.bos_token_id", None),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)),
        )
    except ValueError as e:
        raise ModelLoadError(path, first_line(e)) from e


def _rope_scaling(key) -> dict[str, Any] | None:
    kind = key("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(key("rope.scaling.factor", 1.0))}
    original = key("rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _field(reader: gguf.GGUFReader, path: str, name: str, default: Any = ...) -> Any:
    field = reader.fields.get(name)
    if field is None:
        if default is ...:
            raise ModelLoadError(path, f"GGUF metadata has no {name!r}")
        return default
    return field.contents()


@dataclass
class _PlannedTensor:
    hf_name: str
    tensor: gguf.ReaderTensor
    permute_heads: int | None  # llama.cpp's rotary row order to undo, by this many heads


def _weight_plan(reader: gguf.GGUFReader, path: str, config: ModelConfig) -> list[_PlannedTensor]:
    plan = []
    for t in reader.tensors:
        if t.name in _SKIPPED:
            logger.warning("%s: ignoring %s (not used by Hugging Face models)", path, t.name)
            continue
        hf_name = hf_tensor_name(t.name)
        if hf_name is None:
            raise ModelLoadError(
                path, f"unexpected tensor {t.name!r} for a {config.architecture} model"
            )
        if not _can_dequantize(t.tensor_type):
            raise ModelLoadError(
                path,
                f"tensor {t.name!r} has type {t.tensor_type.name}, "
                "which the gguf package cannot dequantize",
            )
        heads = None
        if config.architecture == "llama":  # only llama.cpp's llama converter permutes q/k
            if ".attn_q." in t.name:
                heads = config.num_attention_heads
            elif ".attn_k." in t.name:
                heads = config.num_key_value_heads
        plan.append(_PlannedTensor(hf_name, t, heads))
    return plan


@functools.cache
def _can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    sizes = gguf.GGML_QUANT_SIZES.get(qtype)
    if sizes is None:
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, sizes[1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _iter_weights(
    path: str, plan: list[_PlannedTensor], dtype: torch.dtype,
    keep_packed: Collection[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """Dequantized tensors, except those named in keep_packed: their blocks as stored."""
    for item in plan:
        t = item.tensor
        if item.hf_name in keep_packed:
            yield item.hf_name, _packed(item)
            continue
        try:
            array = dequantize(t.data, t.tensor_type)
            # GGUF lists dimensions innermost first.
            array = array.reshape([int(d) for d in reversed(t.shape)])
        except Exception as e:
            problem = f"cannot dequantize tensor {t.name!r} ({first_line(e)})"
            raise ModelLoadError(path, problem) from e
        if item.permute_heads is not None:
            array = unpermute_rotary_rows(array, item.permute_heads)
        if not array.flags.writeable:  # a view of the read-only memory map
            array = array.copy()
        yield item.hf_name, torch.from_numpy(array).to(dtype)


def _packed(item: _PlannedTensor) -> PackedWeight:
    t = item.tensor
    blocks = t.data  # [rows, row_bytes] of the memory map; rows hold whole blocks
    if item.permute_heads is not None:  # rows move whole, so the packed rows permute as well
        blocks = unpermute_rotary_rows(blocks, item.permute_heads)
    return PackedWeight(int(t.tensor_type), blocks, int(t.shape[1]), int(t.shape[0]))


def packed_tensor_types(path: str) -> dict[str, tuple[int, int, int]]:
    """Hugging Face name -> (GGML type, rows, cols) of each 2-D tensor of a GGUF file: what
    `--quantization gguf` can keep packed."""
    types = {}
    for t in open_gguf(path).tensors:
        name = hf_tensor_name(t.name)
        if name is not None and len(t.shape) == 2:
            types[name] = (int(t.tensor_type), int(t.shape[1]), int(t.shape[0]))
    return types


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order.

    Its converter interleaves the two halves of each head's rows (row 2i from the first half,
    row 2i+1 from the second) because its RoPE rotates adjacent pairs; Hugging Face rotates
    the first half of a head against the second.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weight.shape)
