"""Loaders: the default GGUF against transformers, tiny GGUFs and HF directories, presets."""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedllm.loader import (
    ModelSource,
    default_model_path,
    initialize_dummy_weights,
    load_model_source,
    load_tokenizer,
    preset_names,
)
from pagedllm.loader.errors import ModelLoadError
from pagedllm.loader.fast_tokenizer import FastTokenizer
from pagedllm.loader.gguf_dequant import dequantize
from pagedllm.loader.gguf_loader import open_gguf, unpermute_rotary_rows

Q8_0 = gguf.GGMLQuantizationType.Q8_0
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=128, layers=2)


# ---------------------------------------------------------------------------- helpers


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order: per head, row 2i is row i of the first half, 2i+1 of the second."""
    head_dim = weight.shape[0] // num_heads
    half = head_dim // 2
    order = [h * head_dim + j + part * half for h in range(num_heads) for j in range(half) for part in (0, 1)]
    return weight[order]


def tiny_hf_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of a tiny llama/qwen2/qwen3, Hugging Face names and shapes."""
    rng = np.random.default_rng(seed)
    h, d, ffn = TINY["hidden"], TINY["head_dim"], TINY["ffn"]
    q_rows, kv_rows = TINY["heads"] * d, TINY["kv_heads"] * d

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(TINY["vocab"], h), "model.norm.weight": w(h)}
    if not tied:
        weights["lm_head.weight"] = w(TINY["vocab"], h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": w(q_rows, h),
            p + "self_attn.k_proj.weight": w(kv_rows, h),
            p + "self_attn.v_proj.weight": w(kv_rows, h),
            p + "self_attn.o_proj.weight": w(h, q_rows),
            p + "mlp.gate_proj.weight": w(ffn, h),
            p + "mlp.up_proj.weight": w(ffn, h),
            p + "mlp.down_proj.weight": w(h, ffn),
            p + "input_layernorm.weight": w(h),
            p + "post_attention_layernorm.weight": w(h),
        }
        if arch == "qwen2":
            weights |= {p + f"self_attn.{x}_proj.bias": w(n) for x, n in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))}
        if arch == "qwen3":
            weights |= {p + "self_attn.q_norm.weight": w(d), p + "self_attn.k_norm.weight": w(d)}
    return weights


GGUF_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_GLOBALS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in GGUF_GLOBALS:
        return f"{GGUF_GLOBALS[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{GGUF_PARTS[part]}.{kind}"


def write_tiny_gguf(
    path: Path, arch: str = "llama", tied: bool = False, quantize: bool = True,
    extra: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] | None = None,
) -> dict[str, np.ndarray]:
    """A tiny GGUF as llama.cpp's converter would write it; returns the expected HF weights.

    2-D weights are stored as Q8_0 (the expected values are their dequantized form), q/k of
    llama permuted into llama.cpp's rotary order.
    """
    weights = tiny_hf_weights(arch, tied)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(512)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_key_length(TINY["head_dim"])
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    expected = {}
    for name, value in weights.items():
        stored = value
        if arch == "llama" and ".q_proj." in name:
            stored = llama_cpp_permute(value, TINY["heads"])
        elif arch == "llama" and ".k_proj." in name:
            stored = llama_cpp_permute(value, TINY["kv_heads"])
        if quantize and value.ndim == 2:
            # Q8_0 scales each block of 32 along a row, so it commutes with the row permutation.
            w.add_tensor(gguf_name(name), gguf.quants.quantize(stored, Q8_0), raw_dtype=Q8_0)
            expected[name] = gguf.quants.dequantize(gguf.quants.quantize(value, Q8_0), Q8_0)
        else:
            w.add_tensor(gguf_name(name), stored)
            expected[name] = value
    for name, (value, qtype) in (extra or {}).items():
        w.add_tensor(name, value, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def save_tiny_hf(path: Path, cls=transformers.LlamaConfig, **overrides) -> transformers.PreTrainedModel:
    config = cls(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return model


# ------------------------------------------------------------------ the default model


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return load_model_source()


@pytest.fixture(scope="module")
def default_reader() -> gguf.GGUFReader:
    return open_gguf(default_model_path())


@pytest.fixture(scope="module")
def default_weights(default_source) -> dict[str, torch.Tensor]:
    return dict(default_source.iter_weights(torch.float32))


def test_default_model_config(default_source):
    c = default_source.config
    assert default_source.name == "SmolLM2-135M-Instruct"
    assert default_source.load_format == "gguf"
    assert default_source.path == default_model_path() and default_source.path.endswith(".gguf")
    assert (c.architecture, c.num_hidden_layers, c.hidden_size) == ("llama", 30, 576)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (49152, 1536, 8192)
    assert c.rope_theta == 1e5 and c.rope_scaling is None
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]


def test_default_tokenizer_matches_gguf_vocabulary(default_source, default_reader):
    tok = default_source.tokenizer
    vocab = default_reader.fields["tokenizer.ggml.tokens"].contents()
    assert tok.convert_ids_to_tokens(list(range(len(vocab)))) == vocab
    assert tok.convert_tokens_to_ids(tok.eos_token) in default_source.config.eos_token_ids
    text = "Hello, world! PagedAttention keeps KV blocks in 16-token pages. 12345 éà"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) and tok.decode(ids) == text
    # Merges are applied: a common word is one token, not its letters.
    assert len(tok.encode(" world", add_special_tokens=False)) == 1


def test_default_chat_template_is_the_ggufs_chatml(default_source, default_reader):
    tok = default_source.tokenizer
    assert tok.chat_template == default_reader.fields["tokenizer.chat_template"].contents()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi there<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_default_weight_names_and_shapes(default_weights):
    expected = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (576, 576), p + "self_attn.k_proj.weight": (192, 576),
            p + "self_attn.v_proj.weight": (192, 576), p + "self_attn.o_proj.weight": (576, 576),
            p + "mlp.gate_proj.weight": (1536, 576), p + "mlp.up_proj.weight": (1536, 576),
            p + "mlp.down_proj.weight": (576, 1536), p + "input_layernorm.weight": (576,),
            p + "post_attention_layernorm.weight": (576,),
        }
    assert {k: tuple(v.shape) for k, v in default_weights.items()} == expected
    assert all(v.dtype == torch.float32 for v in default_weights.values())


def test_iter_weights_converts_dtype(default_source, default_weights):
    for name, tensor in itertools.islice(default_source.iter_weights(torch.bfloat16), 3):
        assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
        assert torch.equal(tensor, default_weights[name].to(torch.bfloat16))


@pytest.mark.slow
def test_default_weights_equal_transformers(default_weights, hf_reference):
    ref = dict(hf_reference[0].state_dict())
    assert torch.equal(ref.pop("lm_head.weight"), ref["model.embed_tokens.weight"])  # tied
    assert set(ref) == set(default_weights)
    unequal = [k for k in ref if not torch.equal(ref[k], default_weights[k])]
    assert unequal == []


# --------------------------------------------------------------------------- tiny GGUFs


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_tiny_gguf_round_trip(tmp_path, arch, tied):
    path = tmp_path / "tiny-model.Q8_0.gguf"
    expected = write_tiny_gguf(path, arch=arch, tied=tied)
    source = load_model_source(str(path))
    assert source.name == "tiny-model" and source.tokenizer is None  # no tokenizer metadata
    c = source.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.vocab_size) == (arch, 2, 64, 128)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.intermediate_size, c.max_position_embeddings, c.rope_theta) == (96, 512, 50000.0)
    assert c.tie_word_embeddings == tied
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert c.bos_token_id == 1 and c.eos_token_ids == [2, 3]
    got = dict(source.iter_weights(torch.float32))
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], torch.from_numpy(value)), name


def test_directory_with_one_gguf(tmp_path):
    expected = write_tiny_gguf(tmp_path / "m.gguf", quantize=False)
    source = load_model_source(str(tmp_path))
    assert source.load_format == "gguf" and source.path == str(tmp_path / "m.gguf")
    assert torch.equal(dict(source.iter_weights(torch.float32))["model.norm.weight"],
                       torch.from_numpy(expected["model.norm.weight"]))
    dummy = load_model_source(str(tmp_path), load_format="dummy")
    assert dummy.config == source.config and dummy.path is None and dummy.tokenizer is None
    assert load_model_source(str(tmp_path), load_format="gguf").config == source.config


def test_weights_with_a_progress_bar_are_the_same_weights(tmp_path, monkeypatch):
    import io

    from tqdm import tqdm

    write_tiny_gguf(tmp_path / "m.gguf")
    source = load_model_source(str(tmp_path / "m.gguf"))
    plain = list(source.iter_weights(torch.float32))
    total = sum(t.numel() * t.element_size() for _, t in plain)
    shown = io.StringIO()
    shown.isatty = lambda: True  # a terminal: the bar is drawn (no delay here)
    original = tqdm.__init__
    monkeypatch.setattr(tqdm, "__init__", lambda self, *a, **k: original(
        self, *a, **{**k, "file": shown, "delay": 0}))
    with_bar = list(source.iter_weights(torch.float32, total_bytes=total))
    assert [n for n, _ in with_bar] == [n for n, _ in plain]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(with_bar, plain))
    assert "Loading weights: 100%" in shown.getvalue()


def assert_same_reader(ours: gguf.GGUFReader, stock: gguf.GGUFReader) -> None:
    assert list(ours.fields) == list(stock.fields)
    for name, a in stock.fields.items():
        b = ours.fields[name]
        assert (b.offset, b.types, list(b.data), len(b.parts)) == \
            (a.offset, a.types, list(a.data), len(a.parts)), name
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        assert b.contents() == a.contents(), name
        if a.types[0] == gguf.GGUFValueType.ARRAY and len(a.data) > 2:
            assert b.contents(1) == a.contents(1) and b.contents(slice(1, 3)) == a.contents(
                slice(1, 3)), name
    assert ours.data_offset == stock.data_offset
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in stock.tensors]
    for a, b in zip(stock.tensors, ours.tensors):
        assert np.array_equal(a.data, b.data)


def test_fast_header_parse_builds_the_stock_readers_fields(tmp_path):
    path = tmp_path / "fields.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    tokens = [f"tok{i}" for i in range(3000)] + ["", "é à ü", "<|im_end|>"]
    w.add_token_list(tokens)
    w.add_token_types([i % 5 for i in range(len(tokens))])
    w.add_token_scores([i / 7 for i in range(len(tokens))])
    w.add_token_merges(["a b", "ab c"])
    w.add_array("test.nested", [[1, 2, 3], [4]])
    w.add_array("test.empty", [])
    w.add_array("test.bools", [True, False, True])
    w.add_string("test.string", "hello")
    w.add_uint32("test.u32", 7)
    w.add_float64("test.f64", 2.5)
    w.add_bool("test.bool", True)
    w.add_tensor("token_embd.weight", np.arange(24, dtype=np.float32).reshape(3, 8))
    w.add_tensor("output_norm.weight", np.ones(8, np.float16))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert_same_reader(open_gguf(str(path)), gguf.GGUFReader(str(path)))


def test_fast_header_parse_rejects_a_string_array_cut_short(tmp_path):
    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list([f"token number {i}" for i in range(2000)])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF file"):
        open_gguf(str(path))


def test_unpermute_inverts_llama_cpp_order():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)
    assert np.array_equal(unpermute_rotary_rows(llama_cpp_permute(w, 4), 4), w)


def byte_level_chars() -> list[str]:
    """GPT-2's byte-to-character table (the 256 single-byte tokens of a byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(others))]


def write_tokenizer_gguf(path: Path, chat_template: str) -> None:
    """A GGUF holding a tiny byte-level BPE tokenizer (llama.cpp's "gpt2" model)."""
    tokens = byte_level_chars() + ["he", "ll", "hell", "Ġw", "<|endoftext|>", "<|im_start|>",
                                   "<|im_end|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    w.add_token_merges(["h e", "l l", "he ll", "Ġ w"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_gguf_tokenizer_is_cached_by_the_header(tmp_path, monkeypatch):
    from pagedllm.loader import tokenizer as tokenizer_module

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_module, "_GGUF_TOKENIZERS", {})  # no in-process copies
    built = []
    from_pretrained = transformers.AutoTokenizer.from_pretrained

    def counted(name, *args, **kwargs):
        built.append(kwargs.get("gguf_file"))
        return from_pretrained(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    write_tokenizer_gguf(tmp_path / "a.gguf", template)
    first = load_tokenizer(str(tmp_path / "a.gguf"))
    tokenizer_module._GGUF_TOKENIZERS.clear()
    again = load_tokenizer(str(tmp_path / "a.gguf"))
    assert built == ["a.gguf"]  # converted once, then read from the cache without transformers
    assert isinstance(again, FastTokenizer)
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1  # no partial entries
    for text in ["hello world<|im_end|>", " héllo\n\tw", "<|im_start|>hi<|im_end|>"]:
        assert again.encode(text) == first.encode(text)
        assert again.convert_ids_to_tokens(again.encode(text)) == first.convert_ids_to_tokens(
            first.encode(text))
    assert first.convert_ids_to_tokens(first.encode("hello world")) == ["hell", "o", "Ġw", "o",
                                                                       "r", "l", "d"]
    assert (again.bos_token, again.eos_token) == (first.bos_token, first.eos_token) == (
        "<|im_start|>", "<|im_end|>")
    assert again.chat_template == first.chat_template == template
    # A file with another header (here its chat template) is another entry.
    write_tokenizer_gguf(tmp_path / "b.gguf", template + "!")
    assert load_tokenizer(str(tmp_path / "b.gguf")).chat_template == template + "!"
    assert built[-1] == "b.gguf"
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "Q5_0"])
def test_dequantize_is_gguf_bit_for_bit(qtype):
    """The torch dequantizers do gguf's fp32 operations in gguf's order (one rounding each,
    no fused multiply-add), so the values are identical, not merely close; Q5_0 goes to gguf."""
    qtype = gguf.GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((5, 3, 128)).astype(np.float32) * 0.05
    values[0, 0, :32] = 0.0  # a zero block: scale 0
    data = gguf.quants.quantize(values, qtype)
    got = dequantize(data, qtype)
    want = gguf.quants.dequantize(data, qtype)
    assert got.dtype == np.float32 and got.shape == want.shape == values.shape
    assert np.array_equal(got, want)


def test_gguf_rope_scaling_metadata(tmp_path):
    path = tmp_path / "scaled.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 96),
                       (w.add_head_count, 4), (w.add_rope_scaling_type, gguf.RopeScalingType.YARN),
                       (w.add_rope_scaling_factor, 4.0), (w.add_rope_scaling_orig_ctx_len, 4096)]:
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((128, 64), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    config = load_model_source(str(path), load_format="dummy").config
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


# ------------------------------------------------------------------ Hugging Face dirs


def assert_same_weights(source: ModelSource, model: torch.nn.Module, tied: bool) -> None:
    ref = model.state_dict()
    if tied:
        ref.pop("lm_head.weight")
    got = dict(source.iter_weights(torch.float32))
    assert set(got) == set(ref)
    for name, value in ref.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize(
    "cls,arch,overrides",
    [
        (transformers.LlamaConfig, "llama", dict(tie_word_embeddings=False)),
        (transformers.LlamaConfig, "llama", dict(tie_word_embeddings=True)),
        (transformers.MistralConfig, "mistral", dict(sliding_window=32)),
        (transformers.Qwen2Config, "qwen2", dict()),
        (transformers.Qwen3Config, "qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    ],
)
def test_hf_dir_round_trip(tmp_path, cls, arch, overrides):
    model = save_tiny_hf(tmp_path, cls, **overrides)
    source = load_model_source(str(tmp_path))
    assert source.load_format == "safetensors" and source.path == str(tmp_path)
    assert source.name == tmp_path.name and source.tokenizer is None
    assert source.config.architecture == arch
    assert source.config.tie_word_embeddings == model.config.tie_word_embeddings
    if arch == "qwen2":
        assert source.config.attention_bias
        assert "model.layers.0.self_attn.q_proj.bias" in dict(source.iter_weights(torch.float32))
    if arch == "qwen3":
        assert source.config.head_dim == 32 and source.config.qk_norm
    assert_same_weights(source, model, model.config.tie_word_embeddings)
    bf16 = next(iter(source.iter_weights(torch.bfloat16)))[1]
    assert bf16.dtype == torch.bfloat16


def test_hf_dir_sharded_with_index(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    (tmp_path / "stray.safetensors").write_bytes(b"not listed in the index, so never opened")
    assert_same_weights(load_model_source(str(tmp_path)), model, tied=False)


def test_hf_dir_bloom_names(tmp_path):
    config = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM(config)
    model.save_pretrained(tmp_path / "lm", safe_serialization=True)
    source = load_model_source(str(tmp_path / "lm"))
    assert source.config.architecture == "bloom"
    assert_same_weights(source, model, tied=True)
    # Checkpoints saved from the base model (bigscience/bloom-560m) lack "transformer.".
    model.transformer.save_pretrained(tmp_path / "base", safe_serialization=True)
    cfg = json.loads((tmp_path / "base" / "config.json").read_text())
    (tmp_path / "base" / "config.json").write_text(json.dumps(cfg | {"architectures": ["BloomForCausalLM"]}))
    assert_same_weights(load_model_source(str(tmp_path / "base")), model, tied=True)


def test_hf_dir_tokenizer_files_and_override(tmp_path, default_source):
    default_source.tokenizer.save_pretrained(tmp_path / "tok")
    save_tiny_hf(tmp_path / "bare")
    with_override = load_model_source(str(tmp_path / "bare"), tokenizer=str(tmp_path / "tok"))
    assert with_override.tokenizer.encode("hello world") == default_source.tokenizer.encode("hello world")
    save_tiny_hf(tmp_path / "full")
    default_source.tokenizer.save_pretrained(tmp_path / "full")
    source = load_model_source(str(tmp_path / "full" / "config.json"))  # config.json means its folder
    assert source.path == str(tmp_path / "full") and source.load_format == "safetensors"
    assert source.tokenizer.chat_template == default_source.tokenizer.chat_template
    assert source.tokenizer.encode("hello world") == default_source.tokenizer.encode("hello world")


def test_generation_config_eos_ids_are_merged(tmp_path):
    save_tiny_hf(tmp_path, eos_token_id=2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model_source(str(tmp_path)).config.eos_token_ids == [2, 7]


def test_config_json_as_dummy(tmp_path):
    save_tiny_hf(tmp_path / "m")
    source = load_model_source(str(tmp_path / "m" / "config.json"), load_format="dummy")
    assert (source.load_format, source.path, source.tokenizer, source.name) == ("dummy", None, None, "m")
    assert source.config.hidden_size == 64 and list(source.iter_weights(torch.float32)) == []


# ------------------------------------------------------------------ presets and dummy


PUBLISHED = {  # (layers, hidden, heads, kv heads, head_dim, intermediate, vocab, rope_theta)
    "llama-3-8b": ("llama", 32, 4096, 32, 8, 128, 14336, 128256, 500000.0),
    "qwen3-0.6b": ("qwen3", 28, 1024, 16, 8, 128, 3072, 151936, 1e6),
    "mistral-7b": ("mistral", 32, 4096, 32, 8, 128, 14336, 32000, 10000.0),
    "qwen2-7b": ("qwen2", 28, 3584, 28, 4, 128, 18944, 152064, 1e6),
    "smollm2-135m": ("llama", 30, 576, 9, 3, 64, 1536, 49152, 1e5),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_load_as_dummy(name):
    source = load_model_source(name)
    c = source.config
    shape = (c.architecture, c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
             c.num_key_value_heads, c.head_dim, c.intermediate_size, c.vocab_size, c.rope_theta)
    assert shape == PUBLISHED[name]
    assert (source.name, source.path, source.tokenizer, source.load_format) == (name, None, None, "dummy")
    assert list(source.iter_weights(torch.bfloat16)) == []
    assert load_model_source(name, load_format="dummy").config == c
    assert c.qk_norm == (name == "qwen3-0.6b") and c.attention_bias == (name == "qwen2-7b")
    assert c.sliding_window == (4096 if name == "mistral-7b" else None)
    assert c.tie_word_embeddings == (name in ("qwen3-0.6b", "smollm2-135m"))


def test_all_presets_listed():
    assert set(PUBLISHED) <= set(preset_names())
    for name in preset_names():
        assert load_model_source(name).config.num_hidden_layers > 0


def test_dummy_default_is_smollm2_shape(default_source):
    dummy = load_model_source(load_format="dummy")
    assert dummy.config.hidden_size == default_source.config.hidden_size
    fields = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings")
    assert all(getattr(dummy.config, f) == getattr(default_source.config, f) for f in fields)


class TinyNet(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(100, 256, dtype=dtype)
        self.proj = torch.nn.Linear(256, 512, bias=True, dtype=dtype)
        self.input_layernorm = torch.nn.LayerNorm(512, dtype=dtype)
        self.q_norm = torch.nn.Module()
        self.q_norm.weight = torch.nn.Parameter(torch.zeros(16, dtype=dtype))
        self.ln_f = torch.nn.LayerNorm(512, dtype=dtype)


def test_initialize_dummy_weights():
    net = TinyNet()
    initialize_dummy_weights(net, seed=3)
    params = dict(net.named_parameters())
    for name in ("input_layernorm.weight", "q_norm.weight", "ln_f.weight"):
        assert torch.all(params[name] == 1), name
    for name in ("proj.bias", "input_layernorm.bias", "ln_f.bias"):
        assert torch.all(params[name] == 0), name
    for name, fan_in in (("proj.weight", 256), ("embed_tokens.weight", 256)):
        p = params[name]
        assert p.abs().max() <= 1 / math.sqrt(fan_in) and p.std() > 0.5 / math.sqrt(3 * fan_in)
    # Same seed, same weights; another seed, others.
    again, other = TinyNet(), TinyNet()
    initialize_dummy_weights(again, seed=3)
    initialize_dummy_weights(other, seed=4)
    assert torch.equal(again.proj.weight, net.proj.weight)
    assert not torch.equal(other.proj.weight, net.proj.weight)


def test_initialize_dummy_weights_bf16_keeps_activations_finite():
    layers = torch.nn.ModuleList(torch.nn.Linear(512, 512, dtype=torch.bfloat16) for _ in range(32))
    initialize_dummy_weights(layers, seed=0)
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    for layer in layers:  # a residual stream like a decoder's
        x = x + layer(torch.nn.functional.normalize(x, dim=-1) * math.sqrt(512))
    assert torch.isfinite(x).all() and x.abs().max() < 1e3
