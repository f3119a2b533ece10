"""Compiles the engine's C++ kernels (`engine/csrc/quant_matmul.cpp`) at first use, through the
build helper the `cpu` attention backend shares (`paged_kernels.cpp_build`).

Flags: `-O3`, OpenMP, and the AVX-512 set the kernel's SIMD path needs (`-mavx512f -mavx512bw
-mavx512vl -mfma -mf16c`) only when /proc/cpuinfo lists every one of them; elsewhere the portable
C++ path is compiled (never `-march=native`, so the cached build runs on every CPU its name was
keyed on).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from paged_kernels.cpp_build import BuildFailed, cpu_flags, load

__all__ = ["SOURCE", "BuildFailed", "compile_flags", "load_quant"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_matmul.cpp"
#: /proc/cpuinfo flag -> compiler flag, for the kernel's AVX-512 path.
_SIMD = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
         "fma": "-mfma", "f16c": "-mf16c"}
#: On top of _SIMD: the bfloat16 dot-product path for bf16 activations (Zen 4, Sapphire Rapids).
_BF16 = {"avx512_bf16": "-mavx512bf16"}


def compile_flags(flags: frozenset[str]) -> list[str]:
    """C++ flags for a CPU with feature `flags`: the AVX-512 path only when all of _SIMD are
    present, else the portable path."""
    base = ["-O3", "-fopenmp", "-std=c++17"]
    if all(f in flags for f in _SIMD):
        base += list(_SIMD.values())
        base += [flag for f, flag in _BF16.items() if f in flags]
    return base


def load_quant(cflags: list[str] | None = None) -> ModuleType:
    """The quantized-matmul extension for `cflags` (default: this CPU's `compile_flags`), built
    once per machine and flag set. Tests pass `compile_flags(frozenset())` for the portable
    build. Raises BuildFailed when the compile fails."""
    if cflags is None:
        cflags = compile_flags(cpu_flags())
    return load(SOURCE, "engine_quant", cflags, "engine quantized matmul")
