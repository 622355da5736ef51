"""Triton launches compiled for an H100 / H200 on any machine, GPU or not.

`compiling_launches(compile)` replaces JITFunction.run for its block: each launch a kernel
wrapper makes (with CPU tensors) becomes `compile(kernel, source, options)` instead, the
source built from exactly the arguments and constexprs the wrapper passed, and the CUDA-only
launch choices (PDL, the SM count) are taken as on an H100. `intercepted_launches` hands
each launch's arguments to a callback instead, and `variant_key` names the compiled variant
the JIT would pick for them (scripts/jit_variants.py). tests/triton_compile_check.py
runs every kernel's launches through the compiler's front end this way;
scripts/kernel_resources.py compiles the decode kernel to a cubin and reads its registers.

Import it in a process without TRITON_INTERPRET=1 (else the kernels are the interpreter's
and nothing compiles). It uses Triton's compiler internals (ASTSource), not a public API.
"""
from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from unittest.mock import patch

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from pagedllm.kernels import triton_attention, triton_gemv, triton_pdl
from pagedllm.kernels.metadata import PagedAttentionInputMetadata

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
H100_SMS = 132
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8", torch.int8: "i8",
         torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages")  # launch keywords that are compile options

Compile = Callable[[JITFunction, ASTSource, dict], None]


def arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def launch_source(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[ASTSource, dict]:
    """(the source of fn at this launch's arguments and constexprs, its compile options)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, (p, value) in enumerate(_launch_values(fn, args, kwargs)):
        if value is inspect.Parameter.empty:
            raise TypeError(f"{fn.fn.__name__}: no value for {p.name}")
        if p.is_constexpr or value is None:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        signature[p.name] = arg_type(value)
        if _divisible_by_16(p, value):
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    return ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), options


def _launch_values(fn: JITFunction, args: tuple, kwargs: dict) -> list[tuple[object, object]]:
    """Each of fn's parameters with the value this launch gives it (else its default)."""
    given = dict(zip((p.name for p in fn.params), args))
    given.update((k, v) for k, v in kwargs.items() if k not in OPTIONS)
    return [(p, given.get(p.name, p.default)) for p in fn.params]


def _divisible_by_16(param, value) -> bool:
    """Whether the JIT would specialize this argument as divisible by 16 (a pointer 16-byte
    aligned, an integer a multiple of 16), unless the kernel opts the parameter out
    (do_not_specialize, do_not_specialize_on_alignment). The compiler proves vector widths
    from these hints: without them a kernel compiles to narrower loads, other registers and
    spills than the GPU's launch of it."""
    if param.do_not_specialize or param.do_not_specialize_on_alignment:
        return False
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


@contextmanager
def intercepted_launches(on_launch: Callable[[JITFunction, tuple, dict], None]) -> Iterator[None]:
    """Inside, a Triton launch calls on_launch(kernel, args, kwargs) instead of running, and
    the CUDA-only launch choices (PDL, the SM count) are taken as on an H100."""

    def run(self: JITFunction, *args, grid, warmup, **kwargs):
        on_launch(self, args, kwargs)

    saved = (JITFunction.run, triton_pdl.enabled, triton_attention._num_sms, triton_gemv._num_sms)
    JITFunction.run = run
    triton_pdl.enabled = lambda device: True  # the launches of a device of sm_90
    triton_attention._num_sms = triton_gemv._num_sms = lambda device: H100_SMS
    try:
        yield
    finally:
        (JITFunction.run, triton_pdl.enabled, triton_attention._num_sms,
         triton_gemv._num_sms) = saved


@contextmanager
def compiling_launches(compile: Compile) -> Iterator[list[str]]:
    """Inside, Triton launches compile instead of running; yields the launched kernels'
    names, in order."""
    launched: list[str] = []

    def on_launch(fn: JITFunction, args: tuple, kwargs: dict) -> None:
        compile(fn, *launch_source(fn, args, kwargs))
        launched.append(fn.fn.__name__)

    with intercepted_launches(on_launch):
        yield launched


def variant_key(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[tuple[str, object], ...]:
    """What selects the compiled variant of a launch, as the JIT specializes it: each
    constexpr's value, each integer's class (1, a multiple of 16, other) and each tensor's
    dtype and 16-byte alignment, except where the kernel opts out (do_not_specialize), and
    the compile options. (parameter name, its part of the key) pairs."""
    key: list[tuple[str, object]] = []
    for p, value in _launch_values(fn, args, kwargs):
        if p.is_constexpr or value is None:
            key.append((p.name, value))
        elif isinstance(value, torch.Tensor):
            aligned = "aligned" if _divisible_by_16(p, value) else ""
            key.append((p.name, (TYPES[value.dtype], aligned)))
        elif isinstance(value, int) and not isinstance(value, bool) and not p.do_not_specialize:
            key.append((p.name, 1 if value == 1 else 16 if _divisible_by_16(p, value) else "other"))
    key += sorted((k, v) for k, v in kwargs.items() if k in OPTIONS)
    return tuple(key)


def launch_attention(query_dtype: torch.dtype, cache_dtype: torch.dtype, *, decode: bool = True,
                     sliding_window: int | None = None, alibi: bool = False,
                     num_splits: int | None = None) -> None:
    """triton_paged_attention at Llama-3-8B's attention shape (32 query / 8 KV heads,
    head_dim 128, blocks of 16 tokens) over sequences of 70, 300 and 9 keys: one query token
    each (decode), or a decode, a 40-token chunk after cached context and a 9-token prompt."""
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    seq_lens = [70, 300, 9]
    query_lens = [1, 1, 1] if decode else [1, 40, 9]
    tables = [list(range(0, 5)), list(range(5, 24)), [24]]
    positions = [p for s, q in zip(seq_lens, query_lens) for p in range(s - q, s)]
    slots = [t[p // block] * block + p % block
             for t, s, q in zip(tables, seq_lens, query_lens) for p in range(s - q, s)]
    meta = PagedAttentionInputMetadata.build(positions, slots, query_lens, seq_lens, tables)
    query = torch.zeros(sum(query_lens), heads, head_dim, dtype=query_dtype)
    kv_cache = torch.zeros(2, 25, block, kv_heads, head_dim, dtype=cache_dtype)
    triton_attention.triton_paged_attention(query, kv_cache, meta, head_dim ** -0.5,
                                            sliding_window, torch.ones(heads) if alibi else None,
                                            num_splits=num_splits)


def compile_attention_kernel(cache_dtype: torch.dtype, decode: bool = True,
                             **constants) -> dict:
    """The decode (or prefill) attention kernel compiled for sm_90 as launch_attention
    launches it (bf16 queries; decode in 4 splits) over a cache of `cache_dtype`: its `asm`
    (ttir ... ptx, cubin), and under "shared" the bytes of shared memory a program takes.
    `constants`: triton_attention's launch constants to launch with instead of the engine's
    (DECODE_BLOCK_N=64, PREFILL_PREFETCH=True, ...)."""
    name = "_paged_decode_kernel" if decode else "_paged_prefill_kernel"
    compiled = []

    def compile(fn: JITFunction, source: ASTSource, options: dict) -> None:
        if fn.fn.__name__ == name:
            kernel = triton.compile(source, target=TARGET, options=options)
            compiled.append({**kernel.asm, "shared": kernel.metadata.shared})

    chosen = patch.multiple(triton_attention, **constants) if constants else nullcontext()
    with chosen, compiling_launches(compile):
        launch_attention(torch.bfloat16, cache_dtype, decode=decode,
                         num_splits=4 if decode else None)
    return compiled[0]


def compile_decode_kernel(cache_dtype: torch.dtype, block_n: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None,
                          prefetch: bool | None = None) -> dict:
    """compile_attention_kernel's decode kernel; `block_n` / `num_warps` / `num_stages` /
    `prefetch`: launch choices other than the engine's (PAGEDLLM_DECODE_BLOCK_N,
    _NUM_WARPS, _NUM_STAGES, _PREFETCH)."""
    chosen = dict(DECODE_BLOCK_N=block_n, DECODE_NUM_WARPS=num_warps,
                  DECODE_NUM_STAGES=num_stages, DECODE_PREFETCH=prefetch)
    return compile_attention_kernel(cache_dtype, **{k: v for k, v in chosen.items()
                                                    if v is not None})


def kv_buffers(ttgir: str) -> list[int]:
    """The shared-memory buffers the pipeliner gives each [keys, head_dim] tile the kernel
    copies in (K, then V): the leading size of each mutable 3-D local_alloc in its TTGIR."""
    return [int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+x",
                                       ttgir)]
