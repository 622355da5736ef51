"""FP8 E4M3 weights (--quantization fp8, layers/fp8_linear.py, kernels/triton_fp8.py; the
small-batch kernel kernels/triton_gemv.py is tests/test_kernels.py's),
checked on the CPU: the Triton kernels under the interpreter against torch, FP8Linear with
torch's CPU _scaled_mm against a plain fp32 emulation, and the engine's load-time swap.
The CUDA speed and bf16 agreement are scripts/gpu_check.sh's fp8 step."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import triton_fp8
from pagedllm.layers import fp8_linear
from pagedllm.layers.fp8_linear import FP8Linear, fp8_matmul_reference, quantize_rows
from pagedllm.worker import worker as worker_module

FP8 = torch.float8_e4m3fn


def awkward_rows() -> torch.Tensor:
    """Rows that reach every rounding case: random values, exact powers of two and values
    just below them (where a rounding carry changes the exponent), ties between E4M3 values,
    subnormals, an all-zero row."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 300, generator=g) * torch.tensor([[1.0], [1e-3], [50.0], [1], [1], [1]])
    pow2 = 2.0 ** torch.arange(-12, 9).float()
    rows[3, :21] = pow2 * 448 / 256  # the row's max is 448 * 1.75: scale = 1.75
    rows[3, 21:42] = pow2 * (1 - 2**-6) * 1.75  # just below powers of two, after scaling
    rows[4, :16] = torch.arange(16) * 2.0**-10 * 1.0001  # subnormal range, near ties
    rows[4, 16] = 448.0  # scale 1: values land as they are
    rows[5] = 0.0
    return rows


def test_triton_quantize_rows_equals_torch_bit_for_bit():
    x = awkward_rows()
    for dtype in (torch.float32, torch.bfloat16):
        want_q, want_s = quantize_rows(x.to(dtype))
        got_q, got_s = triton_fp8.quantize_rows(x.to(dtype))
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_fp8_linear_against_its_emulation_and_bf16():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    fp8 = FP8Linear.from_linear(linear)
    assert fp8.qweight.dtype == FP8 and fp8.weight_scale.shape == (1, 96)
    x = torch.randn(3, 7, 256).to(torch.bfloat16)
    got = fp8(x)
    assert got.shape == (3, 7, 96) and got.dtype == torch.bfloat16
    emulated = fp8_matmul_reference(x, fp8.qweight, fp8.weight_scale) + linear.bias
    assert (got.float() - emulated.float()).abs().max() <= 2e-2 * emulated.abs().max()
    # against the bf16 layer: FP8's 3 mantissa bits on both sides, a few percent per output
    want = linear(x).float()
    assert (got.float() - want).norm() / want.norm() < 0.05


def test_quantize_linears_keeps_the_lm_head_and_odd_shapes():
    model = nn.Module()
    model.a = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    model.odd = nn.Linear(64, 30, bias=False).to(torch.bfloat16)  # N % 16 != 0
    model.lm_head = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    assert fp8_linear.quantize_linears(model, skip=("lm_head",)) == 1
    assert isinstance(model.a, FP8Linear)
    assert type(model.odd) is nn.Linear and type(model.lm_head) is nn.Linear


def test_engine_swaps_the_decoder_linears_after_loading(monkeypatch, tmp_path):
    """The worker's fp8 path on the CPU (resolve_quantization refuses it there; here it is
    forced), on a tiny dummy llama (torch's CPU _scaled_mm is slow): every decoder linear
    becomes FP8 after the weights load, the untied LM head stays bf16, the weight bytes
    shrink accordingly, and the model generates."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(worker_module, "resolve_quantization", lambda *a: "fp8")
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype="bfloat16", device="cpu",
              quantization="fp8", kv_cache_memory=16 << 20, max_num_batched_tokens=256)
    model = llm.engine.worker.model
    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 4 * 2
    assert not isinstance(model.lm_head, FP8Linear)
    fp8_bytes = sum(m.qweight.numel() + 4 * m.out_features for m in model.modules()
                    if isinstance(m, FP8Linear))
    bf16_bytes = 2 * sum(p.numel() for p in model.parameters())  # embedding, head, norms
    assert llm.engine.worker.weight_bytes == fp8_bytes + bf16_bytes
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 300, 42, 9] * 4, [100, 200, 300]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # every norm and activation in front of an FP8 linear hands on quantized rows (the
    # prompt step has 23 rows, past the small-batch kernel's 16); the same tokens without
    fused = [m for m in model.modules() if getattr(m, "fp8_out", False)]
    assert len(fused) == 3 * 2
    for m in fused:
        m.fp8_out = False
    unfused = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in unfused] == [o.outputs[0].token_ids for o in outs]


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_norm_quantization_matches_norm_then_quantize(with_residual):
    """The RMSNorm kernel that hands an FP8 linear its rows quantized (Triton, interpreted)
    against the plain kernel followed by the quantization: the same scales and values, to
    one E4M3 step; the residual stream as the plain kernel's."""
    from pagedllm.kernels import triton_ops

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(20, 96, generator=g) * 3).to(torch.bfloat16)
    x[7] = 0.0  # an all-zero row gets the tiny scale, not a division by zero
    residual = torch.randn(20, 96, generator=g).to(torch.bfloat16) if with_residual else None
    weight = torch.rand(96, generator=g).to(torch.bfloat16) + 0.5
    q, scale, residual_out = triton_ops.triton_rms_norm_fp8(x, weight, 1e-6, residual)
    plain = triton_ops.triton_rms_norm(x, weight, 1e-6, residual)
    normed = plain[0] if with_residual else plain
    want_q, want_scale = quantize_rows(normed)
    assert q.dtype == FP8 and q.shape == (20, 96) and scale.shape == (20, 1)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    step = want_scale * 2.0 ** -9 + normed.float().abs() * 2.0 ** -3  # one E4M3 step
    assert ((dequantized(q, scale) - dequantized(want_q, want_scale)).abs() <= step).all()
    assert ((dequantized(q, scale) - normed.float()).abs() <= step).all()
    if with_residual:
        torch.testing.assert_close(residual_out, plain[1], rtol=0, atol=0)
    else:
        assert residual_out is None


@pytest.mark.parametrize("row_block", [16384, 1024])
def test_fused_silu_quantization_matches_silu_then_quantize(monkeypatch, row_block):
    """SiLU-and-mul handing on FP8 rows (a row in one block, or wider than its block: two
    passes) against the plain kernel followed by the quantization."""
    from pagedllm.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "FP8_ROW_BLOCK", row_block)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(18, 2 * 5000, generator=g) * 4).to(torch.bfloat16)
    q, scale = triton_ops.triton_silu_and_mul_fp8(x)
    plain = triton_ops.triton_silu_and_mul(x)
    want_q, want_scale = quantize_rows(plain)
    assert q.dtype == FP8 and q.shape == (18, 5000)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    step = want_scale * 2.0 ** -9 + plain.float().abs() * 2.0 ** -3
    assert ((dequantized(q, scale) - dequantized(want_q, want_scale)).abs() <= step).all()


def test_fp8_linear_takes_rows_quantized_before_it():
    """FP8Rows into an FP8Linear: what the linear computes from the same activations."""
    torch.manual_seed(0)
    fp8 = FP8Linear.from_linear(nn.Linear(64, 48, bias=True).to(torch.bfloat16))
    x = torch.randn(2, 20, 64).to(torch.bfloat16)
    got = fp8(fp8_linear.FP8Rows.quantize(x))
    assert got.shape == (2, 20, 48)
    torch.testing.assert_close(got, fp8(x), rtol=1e-2, atol=1e-2)
