"""The C kernels of the CPU path (pagedllm/kernels/cpu) against the pure-torch code they
replace, which stays the oracle: the KV cache write, decode attention, RMSNorm, rotary, the
gated activation; a whole model with and without them; the packed MKL linears; and the
fallback when the library cannot be built."""
from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels import reference
from pagedllm.kernels.cpu import build
from pagedllm.layers import dispatch
from pagedllm.layers.linear import Linear, linear, pack_for_mkl, prepack_model
from pagedllm.layers.norms import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.loader import initialize_dummy_weights
from pagedllm.models.registry import build_model
from tests.paged_helpers import PagedRunner, naive_attention, random_step

pytestmark = pytest.mark.skipif(build.load_library() is None,
                                reason="no C compiler: the CPU runs the pure-torch kernels")


@pytest.fixture
def torch_path():
    """Route every layer to the pure-torch code, as on a machine without the library."""
    with dispatch.force("torch"):
        yield


def fused_qkv(tokens: int, heads: int, kv_heads: int, d: int, seed: int = 0):
    """q, k, v as the model has them: [T, heads, d] views into one [T, (heads + 2 kv) d]."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return (q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d))


# ----------------------------------------------------------------------------- KV cache write


def test_write_kv_cache_matches_the_reference_and_skips_minus_one_slots():
    _, k, v = fused_qkv(6, heads=4, kv_heads=2, d=16)
    assert not k.is_contiguous()  # strided rows, read in place
    slots = torch.tensor([5, -1, 0, 17, -1, 9])
    want = torch.zeros(2, 5, 4, 2, 16)
    got = want.clone()
    reference.write_kv_cache(k, v, want, slots)
    cpu_kernels.write_kv_cache(k, v, got, slots)
    assert torch.equal(got, want)
    assert got.view(2, -1, 2, 16)[:, [1, 2, 3, 4]].abs().sum() == 0  # nothing else written


# ----------------------------------------------------------------------------- decode attention

DECODE_LENS = [1, 5, 8, 13, 40, 37, 2, 64, 129]


@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 16), (9, 3, 64), (8, 8, 128), (4, 1, 24)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_attention_matches_float64_attention(heads, kv_heads, d, block_size):
    """head_dim 64 and 128 take the AVX-512 loops or the AVX2 path (where built for), 16
    and 24 the generic; lengths 1-129: whole and partial runs of 8 keys."""
    cache, meta, query, key, value, keys, values = random_step(
        DECODE_LENS, [1] * len(DECODE_LENS), heads=heads, kv_heads=kv_heads, d=d,
        block_size=block_size, seed=d)
    reference.write_kv_cache(key, value, cache, meta.slot_mapping)
    out = cpu_kernels.paged_attention_decode(query, cache, meta, d ** -0.5)
    assert not out.isnan().any(), "read a slot the sequence does not own"
    for i, (s, k, v) in enumerate(zip(DECODE_LENS, keys, values)):
        want = naive_attention(query[i:i + 1], k, v, s, d ** -0.5)
        torch.testing.assert_close(out[i:i + 1].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["sliding_window", "alibi"])
def test_decode_attention_sliding_window_and_alibi(variant):
    heads = 6
    cache, meta, query, key, value, keys, values = random_step(
        DECODE_LENS, [1] * len(DECODE_LENS), heads=heads, kv_heads=2, d=64, seed=7)
    reference.write_kv_cache(key, value, cache, meta.slot_mapping)
    window = 6 if variant == "sliding_window" else None
    slopes = reference.alibi_slopes(heads) if variant == "alibi" else None
    out = cpu_kernels.paged_attention_decode(query, cache, meta, 0.125, window, slopes)
    want = reference.paged_attention(query, cache, meta, 0.125, window, slopes)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for i, (s, k, v) in enumerate(zip(DECODE_LENS, keys, values)):
        expected = naive_attention(query[i:i + 1], k, v, s, 0.125, window, slopes)
        torch.testing.assert_close(out[i:i + 1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_lens", [[9, 1], [1, 0, 1]])  # a prompt; a sequence without a query
def test_decode_attention_rejects_steps_that_are_not_one_query_per_sequence(query_lens):
    cache, meta, query, *_ = random_step([9, 4, 6][:len(query_lens)], query_lens)
    assert not cpu_kernels.is_decode_step(query, meta)
    with pytest.raises(ValueError, match="takes decode-only steps"):
        cpu_kernels.paged_attention_decode(query, cache, meta, 0.25)


# ----------------------------------------------------------------------------- norm and rotary


@pytest.mark.parametrize("rows", [1, 32, 700])  # 700 x 576 runs threaded
def test_rms_norm_matches_the_torch_path(rows, torch_path):
    norm = RMSNorm(576, eps=1e-5)
    g = torch.Generator().manual_seed(rows)
    norm.weight.data = torch.randn(576, generator=g)
    # Small activations (mean square near eps): a wrong eps shows.
    x = torch.randn(rows, 576, generator=g) * 3e-3
    residual = torch.randn(rows, 576, generator=g) * 3e-3
    want_alone = norm(x)
    want_out, want_sum = norm(x, residual)
    got_alone = cpu_kernels.rms_norm(x, norm.weight, 1e-5)
    got_out, got_sum = cpu_kernels.rms_norm(x, norm.weight, 1e-5, residual)
    torch.testing.assert_close(got_alone, want_alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_sum, want_sum)  # one IEEE add per element: exact on any CPU


def test_rotary_in_place_matches_the_torch_path(torch_path):
    rotary = RotaryEmbedding(head_dim=64, max_position=256, theta=1e5)
    q, k, _ = fused_qkv(7, heads=9, kv_heads=3, d=64, seed=2)
    positions = torch.tensor([0, 1, 17, 100, 255, 3, 64])
    want_q, want_k = rotary(positions, q, k)  # the torch path returns new tensors
    got_q, got_k = q.clone(), k.clone()
    cpu_kernels.rotary_embedding_(positions, got_q, got_k, *rotary.tables(torch.device("cpu")))
    # Exact on any CPU: per element x1*c - x2*s and x2*c + x1*s, each product and sum
    # rounded once on both sides (the C is built with -ffp-contract=off: no fused multiply-add).
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("rows,dim", [(3, 1536), (700, 96), (5, 21)])  # 21: the scalar tail
def test_silu_and_mul_matches_torch(rows, dim):
    """Gates across the float range (the vectorised exp) against float64 and torch's silu."""
    g = torch.Generator().manual_seed(dim)
    gate = torch.linspace(-87.0, 87.0, rows * dim).view(rows, dim)
    gate = gate[:, torch.randperm(dim, generator=g)]
    x = torch.cat([gate, torch.randn(rows, dim, generator=g)], dim=-1)
    got = cpu_kernels.silu_and_mul(x)
    exact = (gate.double() * torch.sigmoid(gate.double())) * x[:, dim:].double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * x[:, dim:],
                               rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("vocab", [49152, 1000, 13, 1])  # 13, 1: the scalar code alone
def test_row_argmax_logsumexp_matches_torch(vocab):
    """Each row's first maximal index (ties, a maximum in the vector body and in the tail)
    and its logsumexp, against torch's max(dim) and float64 logsumexp."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g) * 8
    x[1, vocab // 3] = x[1, vocab - 1] = 100.0  # a tie: the first index wins
    x[2, -1] = 100.0  # the maximum in the tail
    x[3] = 0.5  # every entry equal
    x[4, : vocab // 2] = -float("inf")
    idx, lse = cpu_kernels.row_argmax_logsumexp(x)
    assert torch.equal(idx, x.max(dim=-1).indices)
    assert lse.shape == (5, 1)
    torch.testing.assert_close(lse.double(), x.double().logsumexp(-1, keepdim=True),
                               rtol=1e-6, atol=1e-6)


def test_row_argmax_logsumexp_nan_and_infinite_rows():
    """NaN counts as the maximum (torch.max's rule) and gives a NaN logsumexp; a row of
    -inf has logsumexp -inf, one with +inf has +inf; a row of a strided tensor."""
    x = torch.randn(4, 100)
    x[0, 37] = x[0, 60] = float("nan")
    x[1] = -float("inf")
    x[2, 5] = float("inf")
    idx, lse = cpu_kernels.row_argmax_logsumexp(x)
    assert idx.tolist()[:3] == [37, 0, 5] and idx[3] == x[3].argmax()
    assert lse[0].isnan() and lse[1] == -float("inf") and lse[2] == float("inf")
    wide = torch.randn(3, 64)
    idx, lse = cpu_kernels.row_argmax_logsumexp(wide[:, 8:40])
    assert torch.equal(idx, wide[:, 8:40].argmax(-1))
    torch.testing.assert_close(lse, wide[:, 8:40].logsumexp(-1, keepdim=True))


def test_rotary_rejects_heads_that_are_not_contiguous():
    rotary = RotaryEmbedding(head_dim=8, max_position=16, theta=1e4)
    q = torch.randn(3, 8, 4).transpose(1, 2)  # [3, 4 heads, 8] with strided heads
    with pytest.raises(ValueError, match="needs each token's heads contiguous"):
        cpu_kernels.rotary_embedding_(torch.arange(3), q, q, *rotary.tables(torch.device("cpu")))


# ----------------------------------------------------------------------------- a whole model


def test_model_logits_match_the_pure_torch_path():
    """Prefill then decode steps of a small Llama (head_dim 64, tied embeddings): the C
    kernels and packed linears against plain torch."""
    config = ModelConfig(architecture="llama", vocab_size=300, hidden_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=384, max_position_embeddings=128,
                         tie_word_embeddings=True)
    model = build_model(config)
    initialize_dummy_weights(model, seed=5)
    model.eval()
    prompts = {0: [3, 14, 15, 92, 65, 35], 1: [8, 9], 2: list(range(1, 20))}

    def run() -> list[torch.Tensor]:
        runner = PagedRunner(model, config, num_blocks=32, block_size=4)
        logits = [runner.step(prompts)]
        ends = torch.tensor([5, 7, 26])  # each sequence's last prompt token in the flat batch
        next_ids = logits[0][ends].argmax(-1)
        for _ in range(4):
            logits.append(runner.step({s: [int(t)] for s, t in zip(prompts, next_ids)}))
            next_ids = logits[-1].argmax(-1)
        return logits

    with dispatch.force("torch"):
        dispatch.select(model)
    plain = run()
    dispatch.select(model)  # back to the CPU backend: the C kernels
    assert prepack_model(model) == 2 * 4 + 1  # 4 linears per layer, and the tied head
    fused = run()
    for want, got in zip(plain, fused):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- packed linears


@pytest.mark.parametrize("rows", [1, 32, 129, 600])
def test_packed_linear_matches_f_linear(rows):
    layer = Linear(576, 1536, bias=True)
    x = torch.randn(rows, 576)
    want = layer(x)
    assert layer.prepack()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.view(1, rows, 576)), want.view(1, rows, 1536),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_the_lm_head_is_packed_on_the_first_batched_call(tied):
    config = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64,
                         num_hidden_layers=1, num_attention_heads=4, intermediate_size=96,
                         tie_word_embeddings=tied)
    model = build_model(config)
    initialize_dummy_weights(model, seed=1)
    model.pack_head_when_batched = True
    head = model.embed_tokens if tied else model.lm_head
    packed = (lambda: model.packed_tied_head) if tied else (lambda: model.lm_head.packed)
    hidden = torch.randn(4, 64)
    want = torch.nn.functional.linear(hidden, head.weight)
    torch.testing.assert_close(model.compute_logits(hidden[:1]), want[:1], rtol=1e-5, atol=1e-5)
    assert getattr(model, "packed_tied_head", None) is None and model.pack_head_when_batched
    torch.testing.assert_close(model.compute_logits(hidden), want, rtol=1e-5, atol=1e-5)
    assert packed() is not None and not model.pack_head_when_batched
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear)
               and m is not model.lm_head)  # the other linears stay as they are


def test_packing_skips_what_it_cannot_pack():
    assert pack_for_mkl(torch.randn(8, 4, dtype=torch.bfloat16)) is None
    x, w = torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x, w, packed=None), torch.nn.functional.linear(x, w))


# ----------------------------------------------------------------------------- building


def test_no_library_without_a_working_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING):
        assert build.load_library.__wrapped__() is None
    assert "could not build the CPU kernels" in caplog.text
    assert list(tmp_path.rglob("*.so")) == []  # no torn library left behind


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert build.load_library.__wrapped__() is None


def test_library_is_built_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    assert build.load_library.__wrapped__() is not None
    (built,) = tmp_path.rglob("*.so")
    stamp = built.stat().st_mtime_ns
    assert build.load_library.__wrapped__() is not None
    assert built.stat().st_mtime_ns == stamp
