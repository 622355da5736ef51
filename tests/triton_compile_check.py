"""Run by tests/test_triton_compile.py in a process without TRITON_INTERPRET: the attention
kernels through Triton's front end (Python -> TTIR) for a Hopper target, at the constexprs
their launches use. No GPU is needed. Prints one line per variant; exit status 1 when any
variant does not compile, 2 when this Triton's compiler API is not the one used here."""
from __future__ import annotations

import itertools
import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET=1"

import triton  # noqa: E402

try:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError
except ImportError as e:  # a Triton whose internals moved: nothing to check against
    print(f"this Triton's compiler API differs: {e}")
    sys.exit(2)

from pagedllm.kernels import triton_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200


def to_ttir(kernel, types: dict[str, str], constexprs: dict) -> None:
    """kernel's TTIR; arguments not in types or constexprs are i32 scalars."""
    signature = {name: types.get(name, "i32") for name in kernel.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    src = ASTSource(kernel, signature, constexprs=constexprs)
    backend = triton.compiler.make_backend(TARGET)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src.make_ir(TARGET, options, backend.get_codegen_implementation(options),
                backend.get_module_map(), context)


# (query and output dtype, cache dtype, dots in fp16): what triton_paged_attention launches
DTYPES = [("bf16", "bf16", False), ("fp16", "fp16", False), ("fp32", "fp32", False),
          ("bf16", "fp8e4nv", True), ("bf16", "fp8e4nv", False), ("fp16", "fp8e4nv", True)]


def main() -> int:
    failed = 0
    for (q, cache, fp16_dots), window, alibi in itertools.product(DTYPES, (False, True),
                                                                   (False, True)):
        types = {"out_ptr": f"*{q}", "q_ptr": f"*{q}", "cache_ptr": f"*{cache}",
                 "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
                 "count_ptr": "*i32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "query_start_loc_ptr": "*i32", "alibi_ptr": "*fp32", "qk_scale": "fp32"}
        common = dict(BLOCK_SIZE=16, GROUP=4, HEAD_DIM=128, USE_WINDOW=window, USE_ALIBI=alibi,
                      DOT_PRECISION="ieee" if q == "fp32" else "tf32", FP16_DOTS=fp16_dots)
        variants = [(triton_attention._paged_decode_kernel,
                     dict(GROUP_PAD=16, BLOCK_N=128, NUM_SPLITS=splits, PDL=True), splits)
                    for splits in (1, 4)]
        variants.append((triton_attention._paged_prefill_kernel,
                         dict(GROUP_PAD=4, BLOCK_Q=16, BLOCK_N=64), None))
        for kernel, launch, splits in variants:
            label = (f"{kernel.fn.__name__} q {q} cache {cache} fp16 dots {fp16_dots} window "
                     f"{window} alibi {alibi}" + (f" splits {splits}" if splits else ""))
            try:
                to_ttir(kernel, types, dict(common, **launch))
                print(f"ok      {label}")
            except CompilationError as e:
                failed += 1
                lines = str(e).strip().splitlines()
                why = next((line for line in lines if "Error(" in line), lines[-1])
                print(f"FAILED  {label}: {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
