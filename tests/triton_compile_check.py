"""Run by tests/test_triton_compile.py in a process without TRITON_INTERPRET: the Triton
launches of pagedllm's kernel wrappers go through Triton's front end (Python -> TTIR) for a
Hopper target instead of running, at exactly the arguments and constexprs each wrapper
passes (pagedllm/benchmarks/triton_launches.py). No GPU is needed: the wrappers get CPU
tensors.

Prints one line per launch; exit status 1 when any does not compile, 2 when this Triton's
compiler API is not the one used here."""
from __future__ import annotations

import inspect
import itertools
import os
import sys
from collections.abc import Callable
from unittest.mock import patch

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET=1"

import torch  # noqa: E402
import triton  # noqa: E402

try:
    from triton._C.libtriton import ir
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError
    from triton.runtime.jit import JITFunction
except ImportError as e:  # a Triton whose internals moved: nothing to check against
    print(f"this Triton's compiler API differs: {e}")
    sys.exit(2)

MAKE_IR = ["self", "target", "options", "codegen_fns", "module_map", "context"]
if list(inspect.signature(ASTSource.make_ir).parameters) != MAKE_IR:
    print(f"this Triton's compiler API differs: ASTSource.make_ir"
          f"{inspect.signature(ASTSource.make_ir)}")
    sys.exit(2)

from pagedllm.benchmarks.triton_launches import (  # noqa: E402
    TARGET, compiling_launches, launch_attention,
)
from pagedllm.kernels import (  # noqa: E402
    triton_attention, triton_bitmask, triton_cache, triton_fp8, triton_gemv, triton_lora,
    triton_ops, triton_pdl, triton_sampling, triton_threshold, triton_top_p,
)


def to_ttir(fn: JITFunction, source: ASTSource, options: dict) -> None:
    """The front end's TTIR of one launch (a `compile` for compiling_launches)."""
    backend = triton.compiler.make_backend(TARGET)
    options = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source.make_ir(TARGET, options, backend.get_codegen_implementation(options),
                   backend.get_module_map(), context)


def attention(q: str, cache: str, fp16_dots: bool, window: bool, alibi: bool, splits: int | None,
              decode: bool) -> None:
    triton_attention.FP8_KV_FP16_DOTS = fp16_dots
    launch_attention(DTYPES[q], DTYPES[cache], decode=decode, sliding_window=64 if window else None,
                     alibi=alibi, num_splits=splits)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8": torch.float8_e4m3fn}


def scenarios() -> list[tuple[str, Callable[[], None]]]:
    out = []
    # (queries, cache, dots in fp16): what an engine's attention launches
    for (q, cache, fp16_dots), window, alibi in itertools.product(
            [("bf16", "bf16", False), ("fp16", "fp16", False), ("fp32", "fp32", False),
             ("bf16", "fp8", True), ("bf16", "fp8", False), ("fp16", "fp8", True)],
            (False, True), (False, True)):
        for splits, decode in ((1, True), (4, True), (None, False)):
            name = (f"attention q {q} cache {cache} fp16 dots {fp16_dots} window {window} "
                    f"alibi {alibi} " + (f"decode splits {splits}" if decode else "prefill"))
            out.append((name, lambda a=(q, cache, fp16_dots, window, alibi, splits, decode):
                        attention(*a)))
    bf16 = torch.bfloat16
    for cache in ("bf16", "fp8"):
        def write(cache=cache):
            kv = torch.zeros(2, 4, 16, 8, 128, dtype=DTYPES[cache])
            k = torch.zeros(3, 8, 128, dtype=bf16)
            triton_cache.triton_write_kv_cache(k, k, kv, torch.zeros(3, dtype=torch.long))
            q = torch.zeros(3, 32, 128, dtype=bf16)
            triton_cache.triton_rotary_write_kv_cache(
                torch.zeros(3, dtype=torch.long), q, k, k, kv, torch.zeros(3, dtype=torch.long),
                torch.zeros(64, 128))
            norm = torch.ones(128, dtype=bf16)  # Qwen3's q and k norms folded in
            triton_cache.triton_rotary_write_kv_cache(
                torch.zeros(3, dtype=torch.long), q, k, k, kv, torch.zeros(3, dtype=torch.long),
                torch.zeros(64, 128), (norm, norm, 1e-6))
        out.append((f"cache writes, {cache} cache", write))
    for dtype in ("bf16", "fp32"):
        def ops(dtype=DTYPES[dtype]):
            x = torch.zeros(5, 4096, dtype=dtype)
            triton_ops.triton_rms_norm(x, torch.ones(4096, dtype=dtype), 1e-6)
            triton_ops.triton_rms_norm(x, torch.ones(4096, dtype=dtype), 1e-6, residual=x.clone())
            triton_ops.triton_silu_and_mul(torch.zeros(5, 2 * 4096, dtype=dtype))
            q, k = torch.zeros(5, 32, 128, dtype=dtype), torch.zeros(5, 8, 128, dtype=dtype)
            triton_ops.triton_rotary_embedding(torch.zeros(5, dtype=torch.long), q, k,
                                               torch.zeros(64, 128))
        out.append((f"norms, SiLU, rotary in {dtype}", ops))
    for weight, rows in itertools.product(("bf16", "fp8"), (1, 4)):
        out.append((f"skinny matmul, {weight} weight, {rows} rows",
                    lambda w=weight, m=rows: gemv(w, m)))
    for weight, cache in itertools.product(("bf16", "fp8"), ("bf16", "fp8")):
        out.append((f"one-row folds, {weight} weight, {cache} cache",
                    lambda w=weight, c=cache: folds(w, c)))
    for weight in ("bf16", "fp8"):  # PAGEDLLM_L2_PREFETCH=1
        out.append((f"one-row folds, {weight} weight, L2 prefetch",
                    lambda w=weight: with_attr(triton_pdl, "L2_PREFETCH", True, folds, w,
                                               "bf16")))
    for cache in ("bf16", "fp8"):
        out.append((f"attention decode splits 4, {cache} cache, L2 prefetch",
                    lambda c=cache: with_attr(triton_pdl, "L2_PREFETCH", True,
                                              launch_attention, torch.bfloat16, DTYPES[c],
                                              num_splits=4)))
    out.append(("attention decode splits 4, bf16 cache, longest context first",
                lambda: with_attr(triton_attention, "DECODE_ORDER", True, launch_attention,
                                  torch.bfloat16, torch.bfloat16, num_splits=4)))
    for cache in ("bf16", "fp8"):  # PAGEDLLM_DECODE_PREFETCH=1, PAGEDLLM_PREFILL_PREFETCH=1
        out.append((f"attention decode splits 4, {cache} cache, block ids a step ahead",
                    lambda c=cache: with_attr(triton_attention, "DECODE_PREFETCH", True,
                                              launch_attention, torch.bfloat16, DTYPES[c],
                                              num_splits=4)))
        out.append((f"attention prefill, {cache} cache, block ids a step ahead",
                    lambda c=cache: with_attr(triton_attention, "PREFILL_PREFETCH", True,
                                              launch_attention, torch.bfloat16, DTYPES[c],
                                              decode=False)))
    def fp8_rows():
        x = torch.zeros(40, 4096, dtype=bf16)
        triton_fp8.quantize_rows(x)
        triton_ops.triton_rms_norm_fp8(x, torch.ones(4096, dtype=bf16), 1e-6)
        triton_ops.triton_rms_norm_fp8(x, torch.ones(4096, dtype=bf16), 1e-6, residual=x.clone())
        triton_ops.triton_silu_and_mul_fp8(torch.zeros(40, 2 * 14336, dtype=bf16))  # 1 pass
        # PAGEDLLM_FP8_ROW_BLOCK=4096: 2 passes of 4,096 (gpu-check's sharegpt-fp8-twopass)
        with_attr(triton_ops, "FP8_ROW_BLOCK", 4096, triton_ops.triton_silu_and_mul_fp8,
                  torch.zeros(40, 2 * 14336, dtype=bf16))
    out.append(("FP8 activation rows (alone, after RMSNorm, after SiLU-and-mul)", fp8_rows))
    out.append(("sampling", sampling))
    out.append(("grammar bitmask", lambda: triton_bitmask.apply_token_bitmask_(
        torch.zeros(4, 1000), torch.zeros(2, 32, dtype=torch.int32),
        torch.tensor([0, 3]))))
    for rows in (1, 40):
        out.append((f"LoRA shrink and expand, {rows} rows", lambda t=rows: lora(t)))
    return out


def with_attr(module, name: str, value, fn: Callable, *args, **kwargs) -> None:
    """fn(*args, **kwargs) with module.name set to value (a launch choice read at launch)."""
    with patch.object(module, name, value):
        fn(*args, **kwargs)


def lora(num_tokens: int) -> None:
    """Two adapter slots of rank 16 on a [q | k | v] projection (three parts)."""
    bf16 = torch.bfloat16
    x, out = torch.zeros(num_tokens, 4096, dtype=bf16), torch.zeros(num_tokens, 6144, dtype=bf16)
    perm, starts = torch.arange(num_tokens), torch.tensor([0, num_tokens, num_tokens])
    y = triton_lora.lora_shrink(x, torch.zeros(2, 3 * 16, 4096, dtype=bf16), perm, starts, 3)
    triton_lora.lora_expand(out, y, torch.zeros(2, 6144, 16, dtype=bf16), perm, starts,
                            [4096, 5120, 6144])


def weight_of(kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kind == "fp8":
        return torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(n)
    return torch.zeros(n, k, dtype=torch.bfloat16), None


def gemv(kind: str, rows: int) -> None:
    w, scale = weight_of(kind, 6144, 4096)
    triton_gemv.skinny_matmul(torch.zeros(rows, 4096, dtype=torch.bfloat16), w, scale)


def folds(kind: str, cache: str) -> None:
    bf16 = torch.bfloat16
    x = torch.zeros(1, 4096, dtype=bf16)
    heads, kv_heads, head_dim = 32, 8, 128
    w, scale = weight_of(kind, (heads + 2 * kv_heads) * head_dim, 4096)
    rope = triton_gemv.RopeCache(heads, kv_heads, torch.zeros(1, dtype=torch.long),
                                 torch.zeros(1, dtype=torch.long), torch.zeros(64, head_dim),
                                 torch.zeros(2, 4, 16, kv_heads, head_dim, dtype=DTYPES[cache]))
    _, rms = triton_gemv.folded_matmul(x, *weight_of(kind, 4096, 4096),
                                       residual=torch.zeros(1, 4096, dtype=bf16),
                                       next_norm=(torch.ones(4096, dtype=bf16), 1e-6))
    triton_gemv.folded_matmul(rms, w, scale, bias=torch.zeros(w.shape[0], dtype=bf16), rope=rope)
    triton_gemv.folded_matmul(rms, *weight_of(kind, 2 * 14336, 4096), gated=True)


def sampling() -> None:
    rows, vocab = 4, 128256
    logits = torch.zeros(rows, vocab)
    inv_t, seeds = torch.ones(rows), torch.zeros(rows, dtype=torch.long)
    triton_sampling.row_argmax_logsumexp(logits)
    thresholds = triton_threshold.row_thresholds(
        logits, inv_t, torch.full((rows,), 50, dtype=torch.int32), torch.full((rows,), 0.9),
        torch.zeros(rows))
    tokens, _, _ = triton_sampling.sample_rows(logits, inv_t, seeds, thresholds=thresholds)
    triton_top_p.top_p_by_rejection(logits, inv_t, seeds, torch.full((rows,), 0.95),
                                    torch.zeros(rows, dtype=torch.long), 4)


def main() -> int:
    failed = 0
    for name, scenario in scenarios():
        try:
            with compiling_launches(to_ttir) as launched:
                scenario()
            print(f"ok      {name}: {', '.join(sorted(set(launched)))}")
        except CompilationError as e:
            failed += 1
            # CompilationError(source, node, message), raised again by each caller: the
            # innermost message names the problem
            while isinstance(e.__cause__, CompilationError):
                e = e.__cause__
            why = e.args[-1] if e.args and isinstance(e.args[-1], str) else repr(e.__cause__ or e)
            print(f"FAILED  {name}: {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
