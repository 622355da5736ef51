"""GGUF quantized weights on the CPU (quant.c): dequantize, gather embedding rows, and the
small-batch matmul straight from the packed blocks. fp32 activations and outputs.

A packed weight is a uint8 tensor of its rows' blocks back to back, exactly as in the file
(gguf.quants defines the layouts); `gguf.quants.dequantize` is the oracle.
"""
from __future__ import annotations

import ctypes
import functools

import gguf
import torch

from pagedllm.kernels.cpu.build import load_library

QuantType = gguf.GGMLQuantizationType
# The block formats quant.c computes with.
SUPPORTED_TYPES = frozenset({QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1, QuantType.Q4_K,
                             QuantType.Q6_K})

# Or'ed into a kernel's qtype (kernels.h): 8-bit activations (llama.cpp's Q8_0 blocks of 32,
# integer dot products) for these weight types, at most INT8_MAX_ROWS rows; other calls
# keep fp32 activations.
INT8_ACTIVATIONS = 0x100
INT8_TYPES = frozenset({QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0})
INT8_MAX_ROWS = 64

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "gguf_dequantize_f32": ([_ptr, _ptr] + [_i64] * 4, None),
    "gguf_blas_matmul_f32": ([_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr,
                              _i64, _i64], _i64),
    "gguf_get_rows_f32": ([_ptr, _ptr, _i64, _i64, _ptr, _i64, _i64], None),
    "gguf_matmul_f32": ([_ptr, _i64, _ptr, _i64, _i64, _ptr] + [_i64] * 4, None),
    "gguf_quantize_q8_f32": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64], None),
    "gguf_x8_supported": ([_i64], _i64),
    "gguf_x8_repack": ([_ptr, _ptr, _i64, _i64, _i64], None),
    "gguf_x8_row_matmul": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64], None),
    "gguf_q8_quantize_row": ([_ptr, _ptr, _ptr, _i64, _i64], None),
    "gguf_x8_matmul": ([_ptr, _i64, _ptr, _i64, _i64, _ptr] + [_i64] * 4, None),
}


def library() -> ctypes.CDLL | None:
    """The kernels' library (tests swap in another build of quant.c)."""
    return load_library()


@functools.cache
def _bind(lib: ctypes.CDLL, name: str):
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = _SIGNATURES[name]
    return fn


def _kernel(name: str):
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built (no C compiler, or "
                           "PAGEDLLM_CPU_KERNELS=0): GGUF weights cannot stay packed")
    return _bind(lib, name)


def available() -> bool:
    return library() is not None


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one packed row of k values."""
    block, size = gguf.GGML_QUANT_SIZES[QuantType(qtype)]
    if k % block:
        raise ValueError(f"{QuantType(qtype).name} rows hold whole blocks of {block} values, "
                         f"got {k}")
    return k // block * size


def _check(packed: torch.Tensor, qtype: int, n: int, k: int) -> None:
    if QuantType(qtype) not in SUPPORTED_TYPES:
        raise ValueError(f"no CPU kernel for {QuantType(qtype).name} weights")
    if packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.device.type != "cpu":
        raise ValueError("packed weights must be a contiguous uint8 CPU tensor")
    if packed.numel() != n * row_bytes(qtype, k):
        raise ValueError(f"{n} rows of {k} {QuantType(qtype).name} values take "
                         f"{n * row_bytes(qtype, k)} bytes, got {packed.numel()}")


def dequantize(packed: torch.Tensor, qtype: int, n: int, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """[n, k] fp32 from n packed rows: what gguf.quants.dequantize gives, bit for bit; into
    `out` (a contiguous fp32 [n, k] tensor) when given."""
    _check(packed, qtype, n, k)
    if out is None:
        out = torch.empty(n, k)
    elif out.shape != (n, k) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 [{n}, {k}] tensor")
    _kernel("gguf_dequantize_f32")(out.data_ptr(), packed.data_ptr(), int(qtype), n, k,
                                   torch.get_num_threads())
    return out


def get_rows(packed: torch.Tensor, qtype: int, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """[*ids.shape, k] fp32: the rows `ids` of a packed [n, k] table (an embedding lookup)."""
    _check(packed, qtype, n, k)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"token id out of range for an embedding of {n} rows")
    out = torch.empty(flat.numel(), k)
    _kernel("gguf_get_rows_f32")(out.data_ptr(), packed.data_ptr(), int(qtype), k,
                                 flat.data_ptr(), flat.numel(), torch.get_num_threads())
    return out.reshape(*ids.shape, k)


def matmul_unchecked(out: torch.Tensor, x: torch.Tensor, weight_ptr: int, qtype: int, n: int,
                     col: int = 0) -> None:
    """The per-call path of a layer whose packed weight was checked once (see matmul):
    out[:, col:col + n] = x . W^T for x [rows, k] fp32 with contiguous rows."""
    _kernel("gguf_matmul_f32")(out.data_ptr() + 4 * col, out.stride(0), x.data_ptr(),
                               x.stride(0), x.shape[0], weight_ptr, qtype, n, x.shape[1],
                               torch.get_num_threads())


def x8_matmul_unchecked(out: torch.Tensor, x: torch.Tensor, repacked_ptr: int, qtype: int,
                        n: int, col: int = 0) -> None:
    """x8_matmul into out[:, col:col + n], for x [rows <= INT8_MAX_ROWS, k] fp32 with
    contiguous rows and a repack_x8 copy checked once by its caller."""
    _kernel("gguf_x8_matmul")(out.data_ptr() + 4 * col, out.stride(0), x.data_ptr(),
                              x.stride(0), x.shape[0], repacked_ptr, int(qtype), n, x.shape[1],
                              torch.get_num_threads())


def kernel_qtype(qtype: int, int8_activations: bool) -> int:
    """The qtype a matmul call passes: with the int8 flag where the type has that path."""
    return int(qtype) | INT8_ACTIVATIONS if int8_activations and qtype in INT8_TYPES \
        else int(qtype)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 path's activations: (q int8 [rows, k], d fp32 [rows, k / 32], s = d * sum(q)
    per block), as quant.c computes them (AVX2 builds only)."""
    rows, k = x.shape
    if x.dtype != torch.float32 or x.stride(-1) != 1 or k % 32:
        raise ValueError("quantize_q8 takes fp32 rows of whole blocks of 32, contiguous")
    q = torch.empty(rows, k, dtype=torch.int8)
    d, s = torch.empty(rows, k // 32), torch.empty(rows, k // 32)
    _kernel("gguf_quantize_q8_f32")(q.data_ptr(), d.data_ptr(), s.data_ptr(), x.data_ptr(),
                                    x.stride(0), rows, k)
    return q, d, s


def matmul(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int,
           out: torch.Tensor | None = None, int8_activations: bool = False) -> torch.Tensor:
    """x [rows, k] fp32 times the packed [n, k] weight, transposed: [rows, n]. `out` may be
    a column slice of a wider [rows, *] tensor. int8_activations: llama.cpp's 8-bit
    activations where they apply (kernel_qtype), else fp32."""
    rows, k = x.shape
    _check(packed, qtype, n, k)
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError("the packed matmul takes fp32 activations with contiguous rows")
    if out is None:
        out = torch.empty(rows, n)
    elif out.shape != (rows, n) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp32 [{rows}, {n}] with contiguous rows")
    _kernel("gguf_matmul_f32")(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), rows,
                               packed.data_ptr(), kernel_qtype(qtype, int8_activations), n, k,
                               torch.get_num_threads())
    return out


def x8_repackable(qtype: int, n: int, k: int) -> bool:
    """A packed [n, k] weight of this type has quant_x8.c's 8-row layout in this build."""
    return n % 8 == 0 and k % 32 == 0 and bool(_kernel("gguf_x8_supported")(int(qtype)))


def repack_x8(packed: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """A copy of the packed [n, k] Q4_0 / Q4_1 / Q8_0 weight in quant_x8.c's layout (8 rows'
    blocks together), as many bytes: the int8 GEMVs of the fused decode and the LM head
    read it."""
    qtype = int(qtype) & ~INT8_ACTIVATIONS
    _check(packed, qtype, n, k)
    if not x8_repackable(qtype, n, k):
        raise ValueError(f"no 8-row layout for {QuantType(qtype).name} [{n}, {k}]")
    out = torch.empty_like(packed)
    _kernel("gguf_x8_repack")(out.data_ptr(), packed.data_ptr(), qtype, n, k)
    return out


def x8_row_matmul(x: torch.Tensor, repacked: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """x [k] fp32 (quantized to int8 as the one-row path does) times a repack_x8 weight,
    transposed: [n] (tests: against matmul's one-row int8 path)."""
    k = x.shape[0]
    q, dx = torch.empty(k, dtype=torch.int8), torch.empty(k // 16)
    _kernel("gguf_q8_quantize_row")(q.data_ptr(), dx.data_ptr(), x.contiguous().data_ptr(), k,
                                    int(qtype))
    out = torch.empty(n)
    _kernel("gguf_x8_row_matmul")(out.data_ptr(), q.data_ptr(), dx.data_ptr(),
                                  repacked.data_ptr(), int(qtype), 0, n // 8, k)
    return out


def x8_matmul(x: torch.Tensor, repacked: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """x [rows, k] fp32 (rows <= INT8_MAX_ROWS, quantized to int8 per row as the int8 path
    does) times a repack_x8 weight, transposed: [rows, n] (the fused decode's few-stream
    steps; tests)."""
    rows, k = x.shape
    if x.dtype != torch.float32 or x.stride(-1) != 1 or rows > INT8_MAX_ROWS:
        raise ValueError(f"x8_matmul takes fp32 rows, contiguous, at most {INT8_MAX_ROWS}")
    out = torch.empty(rows, n)
    _kernel("gguf_x8_matmul")(out.data_ptr(), n, x.data_ptr(), x.stride(0), rows,
                              repacked.data_ptr(), int(qtype), n, k, torch.get_num_threads())
    return out


@functools.cache
def sgemm_address() -> int | None:
    """The address of the BLAS sgemm torch links (MKL's Fortran `sgemm_` in libtorch_cpu),
    or None where there is none to find (another BLAS, or a torch without MKL). Looked up
    once: every prompt's every projection asks."""
    import os

    if not torch.backends.mkl.is_available():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.cast(ctypes.CDLL(path).sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def blas_matmul_unchecked(out: torch.Tensor, x: torch.Tensor, weight_ptr: int, qtype: int,
                          n: int, col: int, chunk_rows: int, sgemm: int) -> None:
    """out[:, col:col + n] = x . W^T for x [rows, k] fp32 with contiguous rows, through
    the sgemm at address `sgemm`, each thread dequantizing at most chunk_rows rows at a
    time."""
    status = _kernel("gguf_blas_matmul_f32")(
        out.data_ptr() + 4 * col, out.stride(0), x.data_ptr(), x.stride(0), x.shape[0],
        weight_ptr, qtype, n, x.shape[1], sgemm, chunk_rows, torch.get_num_threads())
    if status != 0:
        raise MemoryError("no memory for the dequantized weight rows")
