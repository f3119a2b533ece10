"""Compiles the engine's quantized matmul (`engine/csrc/quant_matmul.cpp`) at first use, as a plain
shared library (no torch headers: a build takes seconds), through the build helper the `cpu`
attention backend shares (`paged_kernels.cpp_build`), and wraps it for tensors (`QuantKernel`).

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

__all__ = ["SOURCE", "BuildFailed", "QuantKernel", "compile_flags", "load_quant"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_matmul.cpp"
#: /proc/cpuinfo flag -> compiler flag, for the kernel's AVX-512 path.
_SIMD = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
         "fma": "-mfma", "f16c": "-mf16c"}
#: On top of _SIMD: the bfloat16 dot-product path for bf16 activations (Zen 4, Sapphire Rapids).
_BF16 = {"avx512_bf16": "-mavx512bf16"}
#: The kernel's codes for the block formats.
_QTYPES = {"Q4_1": 0, "Q8_0": 1}
_kernels: dict[tuple[str, ...], "QuantKernel"] = {}


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
    if cflags is None:
        cflags = compile_flags(cpu_flags())
    key = tuple(cflags)
    if key not in _kernels:
        _kernels[key] = QuantKernel(load_library(SOURCE, "engine_quant", cflags,
                                                 "engine quantized matmul"))
    return _kernels[key]
