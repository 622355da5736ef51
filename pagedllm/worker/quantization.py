"""Quantized weights, chosen at load time (`--quantization`).

    gguf  a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors stay in their blocks on the CPU
          (layers/gguf_linear.py); fp32 activations. The default for a GGUF file on the CPU
          when no --dtype is given; `--dtype float32` dequantizes instead (the oracle).
    fp8   on CUDA, every decoder linear's weight in FP8 E4M3 with one scale per output
          channel (layers/fp8_linear.py); bf16 activations. Any weights: HF, GGUF, dummy.
"""
from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from pagedllm.config import QUANTIZATIONS
from pagedllm.kernels.cpu import quant
from pagedllm.layers import fp8_linear
from pagedllm.layers.gguf_linear import GGUFEmbedding, GGUFLinear, make_segments

logger = logging.getLogger(__name__)


def resolve_quantization(requested: str | None, load_format: str,
                         devices: list[torch.device], dtype: str) -> str | None:
    """The method to use on these devices (the layers' devices), or None (plain weights); a
    clear error for a combination that cannot work."""
    on_cpu = all(d.type == "cpu" for d in devices)
    if requested is None:  # the packed GGUF kernels beat float32 on the CPU (bench cpu)
        auto = load_format == "gguf" and on_cpu and dtype == "auto" and quant.available()
        return "gguf" if auto else None
    if requested == "gguf":
        if load_format != "gguf":
            raise ValueError(f"--quantization gguf keeps a GGUF file's blocks; this model's "
                             f"weights are {load_format}")
        if not on_cpu:
            raise ValueError("--quantization gguf runs on the CPU only; for CUDA use "
                             "--quantization fp8 or none")
        if dtype not in ("auto", "float32"):
            raise ValueError(f"--quantization gguf computes in float32, not {dtype}")
        if not quant.available():
            raise ValueError("--quantization gguf needs the CPU kernels, which could not be "
                             "built (no C compiler, or PAGEDLLM_CPU_KERNELS=0)")
        return "gguf"
    if requested == "fp8":
        if any(d.type != "cuda" for d in devices):
            raise ValueError("--quantization fp8 runs on CUDA only")
        if dtype not in ("auto", "bfloat16"):
            raise ValueError(f"--quantization fp8 computes with bfloat16 activations, not {dtype}")
        return "fp8"
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {requested!r}")


def _module_and_part(hf_name: str, packed_weights: dict[str, tuple[str, int]]
                     ) -> tuple[str, int] | None:
    """'model.layers.3.self_attn.k_proj.weight' -> ('layers.3.self_attn.qkv_proj', 1)."""
    if not hf_name.endswith(".weight"):
        return None
    name = hf_name.removeprefix("model.").removesuffix(".weight")
    for hf, (ours, part) in packed_weights.items():
        if name.endswith("." + hf):
            return name[: -len(hf)] + ours, part
    return name, 0


def pack_gguf_modules(model: nn.Module, tensor_types: dict[str, tuple[int, int, int]]
                      ) -> set[str]:
    """Swap the (meta-device) model's linears and embedding for packed ones where the file
    holds their weights in supported blocks; the Hugging Face names to load packed."""
    parts: dict[str, dict[int, tuple[str, int, int, int]]] = defaultdict(dict)
    for hf_name, (qtype, rows, cols) in tensor_types.items():
        found = _module_and_part(hf_name, getattr(model, "packed_weights", {}))
        if found is not None:
            parts[found[0]][found[1]] = (hf_name, qtype, rows, cols)
    keep: set[str] = set()
    for name, by_part in parts.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue  # e.g. lm_head.weight of a model whose head is tied
        shards = [by_part.get(i) for i in range(len(by_part))]
        if None in shards or any(quant.QuantType(q) not in quant.SUPPORTED_TYPES
                                 for _, q, _, _ in shards):
            continue
        cols = shards[0][3]
        with torch.device("meta"):
            if isinstance(module, nn.Linear):
                if module.in_features != cols or sum(s[2] for s in shards) != module.out_features:
                    continue
                new = GGUFLinear(cols, module.out_features,
                                 make_segments([(q, r) for _, q, r, _ in shards], cols),
                                 bias=module.bias is not None)
            elif isinstance(module, nn.Embedding) and len(shards) == 1:
                _, qtype, rows, _ = shards[0]
                if (rows, cols) != (module.num_embeddings, module.embedding_dim):
                    continue
                new = GGUFEmbedding(rows, cols, qtype)
            else:
                continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        keep.update(s[0] for s in shards)
    return keep


def describe_gguf(model: nn.Module) -> str:
    """'210 linears + embedding packed: Q4_1 x 210, Q8_0 x 1' for the load log."""
    counts: dict[str, int] = defaultdict(int)
    linears = embeddings = 0
    for m in model.modules():
        if isinstance(m, GGUFEmbedding):
            embeddings += 1
        elif isinstance(m, GGUFLinear):
            linears += 1
        else:
            continue
        for s in m.parts:
            counts[quant.QuantType(s.qtype).name] += 1
    types = ", ".join(f"{k} x {v}" for k, v in sorted(counts.items()))
    return f"{linears} linears and {embeddings} embedding(s) kept packed ({types or 'none'})"


def quantize_fp8(model: nn.Module) -> int:
    """Replace every decoder linear (not the LM head) by its FP8 version, after loading."""
    return fp8_linear.quantize_linears(model, skip=("lm_head",))


def fuse_fp8_input_quantization(model: nn.Module) -> int:
    """After LoRA is attached (it needs the FP8 linears' inputs unquantized): the norms and
    activations in front of FP8 linears quantize their outputs (layers/fp8_linear.py)."""
    return fp8_linear.fuse_input_quantization(model) if fp8_linear.FUSE_INPUT_QUANT else 0
