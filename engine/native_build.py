"""Compiles the engine's quantized matmuls at first use, as plain shared libraries (no torch
headers: a build takes seconds), through the build helper the `cpu` attention backend shares
(`paged_kernels.cpp_build`), and wraps them for tensors: `QuantKernel`
(`engine/csrc/quant_matmul.cpp`, float activations) and `Int8Kernel`
(`engine/csrc/int8_matmul.cpp`, int8 activations, AVX-512 VNNI).

Flags: `-O3`, OpenMP, and the AVX-512 set the kernel's SIMD path needs (`-mavx512f -mavx512bw
-mavx512vl -mfma -mf16c`) only when /proc/cpuinfo lists every one of them, plus `-mavx512bf16`
for the bf16 dot-product path when it lists `avx512_bf16`; elsewhere the portable C++ path is
compiled (never `-march=native`, so the cached build runs on every CPU its name was keyed on).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from paged_kernels.cpp_build import BuildFailed, cpu_flags, load_library

if TYPE_CHECKING:
    from engine.model.quant import GGUFBlocks

__all__ = ["SOURCE", "INT8_SOURCE", "BuildFailed", "QuantKernel", "Int8Kernel", "compile_flags",
           "int8_compile_flags", "load_quant", "load_int8"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_matmul.cpp"
INT8_SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_matmul.cpp"
#: /proc/cpuinfo flag -> compiler flag, for the kernel's AVX-512 path.
_SIMD = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
         "fma": "-mfma", "f16c": "-mf16c"}
#: On top of _SIMD: the bfloat16 dot-product path for bf16 activations (Zen 4, Sapphire Rapids).
_BF16 = {"avx512_bf16": "-mavx512bf16"}
#: The kernel's codes for the block formats.
_QTYPES = {"Q4_1": 0, "Q8_0": 1}
#: The int8 kernel's SIMD path: VNNI dot products, bf16 output conversion, f16 scales.
_INT8_SIMD = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
              "avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16", "fma": "-mfma",
              "f16c": "-mf16c"}
#: The kernels built in this process, per (source, flags).
_kernels: dict[tuple[str, ...], object] = {}


def _load(kind: type, source: Path, prefix: str, what: str, cflags: list[str]):
    """`kind(library)` for `source` built with `cflags`, once per process and flag set."""
    key = (str(source), *cflags)
    if key not in _kernels:
        _kernels[key] = kind(load_library(source, prefix, cflags, what))
    return _kernels[key]


class QuantKernel:
    """The compiled kernel, called with tensors. `matmul` does not check its inputs:
    `engine.model.quant.quantized_linear` does, and `GGUFBlocks` holds its own invariants."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._matmul = library.quant_matmul
        self._matmul.restype = ctypes.c_int
        self._matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int]
        library.quant_simd_paths.restype = ctypes.c_char_p
        self.simd_paths: str = library.quant_simd_paths().decode()
        """The code paths compiled in: "avx512,bf16-dot", "avx512" or "portable"."""

    def matmul(self, x: torch.Tensor, blocks: "GGUFBlocks", threads: int) -> torch.Tensor:
        """`x @ W.T` for contiguous `x` `[M, blocks.cols]` (float32 or bfloat16) on `threads`
        OpenMP threads; `[M, rows]` in x's dtype. The call releases the GIL (ctypes)."""
        y = torch.empty(x.shape[0], blocks.data.shape[0], dtype=x.dtype)
        failed = self._matmul(x.data_ptr(), x.dtype == torch.bfloat16, blocks.data.data_ptr(),
                              _QTYPES[blocks.qtype], y.data_ptr(), x.shape[0],
                              blocks.data.shape[0], blocks.cols, threads)
        assert not failed, "quant_matmul refused inputs that GGUFBlocks accepted"
        return y


def compile_flags(flags: frozenset[str]) -> list[str]:
    """C++ flags for a CPU with feature `flags`: the AVX-512 path only when all of _SIMD are
    present, else the portable path."""
    base = ["-O3", "-fopenmp", "-std=c++17"]
    if all(f in flags for f in _SIMD):
        base += list(_SIMD.values())
        base += [flag for f, flag in _BF16.items() if f in flags]
    return base


def load_quant(cflags: list[str] | None = None) -> QuantKernel:
    """The quantized-matmul kernel built with `cflags` (default: this CPU's `compile_flags`),
    compiled once per machine and flag set. Tests pass `compile_flags(frozenset())` for the
    portable build. Raises BuildFailed when the compile fails."""
    return _load(QuantKernel, SOURCE, "engine_quant", "engine quantized matmul",
                 compile_flags(cpu_flags()) if cflags is None else cflags)


class Int8Kernel:
    """The compiled int8 kernel, called with tensors (engine/model/quant_int8.py checks inputs).
    Every call releases the GIL (ctypes)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._packed_bytes = library.int8_packed_bytes
        self._packed_bytes.restype, self._packed_bytes.argtypes = i64, [c_int, i64, i64]
        self._pack = library.int8_pack
        self._pack.restype, self._pack.argtypes = c_int, [ptr, c_int, i64, i64, ptr, c_int]
        self._quantize = library.int8_quantize
        self._quantize.restype = c_int
        self._quantize.argtypes = [ptr, c_int, i64, i64, ptr, ptr, ptr, c_int]
        self._linear = library.int8_linear
        self._linear.restype = c_int
        self._linear.argtypes = [ptr, c_int, ptr, c_int, ptr, i64, i64, i64, c_int]
        library.int8_simd_paths.restype = ctypes.c_char_p
        self.simd_paths: str = library.int8_simd_paths().decode()
        """The code path compiled in: "avx512-vnni" or "portable"."""

    def pack(self, blocks: "GGUFBlocks", threads: int) -> torch.Tensor:
        """The tiled form (uint8, 64-byte aligned start) of `blocks` (int8_matmul.cpp)."""
        rows, cols = blocks.shape
        size = self._packed_bytes(_QTYPES[blocks.qtype], rows, cols)
        out = _aligned_empty(size)
        failed = self._pack(blocks.data.data_ptr(), _QTYPES[blocks.qtype], rows, cols,
                            out.data_ptr(), threads)
        assert not failed, "int8_pack refused inputs that GGUFBlocks accepted"
        return out

    def quantize(self, x: torch.Tensor, threads: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(xq, xd, xs)` of contiguous `x` `[M, K]` (float32 or bfloat16), block-major: xq
        int8 `[K/32, M, 32]`, the scales xd and the sums xd * sum(xq) float32 `[K/32, M]`."""
        rows, cols = x.shape
        xq = torch.empty(cols // 32, rows, 32, dtype=torch.int8)
        xd, xs = torch.empty(2, cols // 32, rows, dtype=torch.float32)
        failed = self._quantize(x.data_ptr(), x.dtype == torch.bfloat16, rows, cols,
                                xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), threads)
        assert not failed, "int8_quantize refused a K that is a multiple of 32"
        return xq, xd, xs

    def linear(self, x: torch.Tensor, packed: torch.Tensor, qtype: str, rows: int,
               threads: int) -> torch.Tensor:
        """`x @ W.T` for contiguous `x` `[M, K]` quantized as `quantize` does (inside the same
        C call), W the `packed` tiles of `rows` features: `[M, rows]` in x's dtype."""
        y = torch.empty(x.shape[0], rows, dtype=x.dtype)
        failed = self._linear(x.data_ptr(), x.dtype == torch.bfloat16, packed.data_ptr(),
                              _QTYPES[qtype], y.data_ptr(), x.shape[0], rows, x.shape[1],
                              threads)
        assert not failed, "int8_linear refused checked inputs"
        return y


def _aligned_empty(size: int, alignment: int = 64) -> torch.Tensor:
    """A uint8 tensor of `size` bytes whose first byte is `alignment`-aligned (a view into a
    slightly larger buffer), so every packed tile-block starts on a cache line."""
    buffer = torch.empty(size + alignment, dtype=torch.uint8)
    shift = -buffer.data_ptr() % alignment
    return buffer[shift:shift + size]


def int8_compile_flags(flags: frozenset[str]) -> list[str]:
    """C++ flags for the int8 kernel on a CPU with feature `flags`: its AVX-512 VNNI path only
    when all of `_INT8_SIMD` are present, else the portable path."""
    base = ["-O3", "-fopenmp", "-std=c++17"]
    if all(f in flags for f in _INT8_SIMD):
        base += list(_INT8_SIMD.values())
    return base


def load_int8(cflags: list[str] | None = None) -> Int8Kernel:
    """The int8 kernel built with `cflags` (default: this CPU's `int8_compile_flags`), compiled
    once per machine and flag set. Raises BuildFailed when the compile fails."""
    return _load(Int8Kernel, INT8_SOURCE, "engine_int8", "engine int8 matmul",
                 int8_compile_flags(cpu_flags()) if cflags is None else cflags)
