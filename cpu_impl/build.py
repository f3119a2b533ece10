"""Compiles `csrc/paged_attention.cpp` at first use (through `paged_kernels.cpp_build`, which the
engine's quantized matmul shares).

The build goes to torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`) under a name keyed on the source's hash and the SIMD flags, so a
machine with other CPU features, or an edited source, gets its own build. Flags: `-O3`, OpenMP,
`-mavx2 -mfma -mf16c` only when /proc/cpuinfo lists all three, and the AVX-512 F/BW/DQ/VL/BF16
flags only when it lists those too (never `-march=native`, so the cached build also runs on the
CPUs that key names).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from paged_kernels import cpp_build
from paged_kernels.cpp_build import BuildFailed, cpu_flags

__all__ = ["SOURCE", "BuildFailed", "cpu_flags", "compile_flags", "extension_name", "load"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
_SIMD = ("avx2", "fma", "f16c")
#: /proc/cpuinfo names of the AVX-512 subsets the AVX-512 path uses (on top of _SIMD).
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16")


def compile_flags(flags: frozenset[str]) -> list[str]:
    """C++ flags for a CPU with feature `flags`: AVX2 only when every one of _SIMD is present, and
    AVX-512 (with avx512_bf16's vdpbf16ps) only when, in addition, every one of _AVX512 is."""
    base = ["-O3", "-fopenmp", "-std=c++17"]
    if all(f in flags for f in _SIMD):
        base += ["-mavx2", "-mfma", "-mf16c"]
        if all(f in flags for f in _AVX512):
            base += ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16"]
    return base


def extension_name(cflags: list[str]) -> str:
    """A name unique to the source text and the flags (the build cache's key)."""
    return cpp_build.extension_name("pk_cpu", SOURCE, cflags)


def load(cflags: list[str] | None = None) -> ModuleType:
    """The compiled module for `cflags` (default: `compile_flags` of this CPU), built on the first
    call of the process for those flags and cached on disk after. Tests pass the portable flags
    (`compile_flags(frozenset())`) to check the non-SIMD code path too."""
    if cflags is None:
        cflags = compile_flags(cpu_flags())
    return cpp_build.load(SOURCE, "pk_cpu", cflags, "paged_kernels cpu backend")
