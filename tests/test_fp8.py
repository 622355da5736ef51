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
    outs = llm.generate([[5, 17, 300, 42, 9] * 4, [100, 200, 300]], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
