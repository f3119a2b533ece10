"""Compiles `csrc/paged_attention.cpp` at first use with `torch.utils.cpp_extension.load`.

The build goes to torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`) under a name keyed on the source's hash and the SIMD flags, so a
machine with other CPU features, or an edited source, gets its own build. Flags: `-O3`, OpenMP,
and `-mavx2 -mfma -mf16c` only when /proc/cpuinfo lists all three (never `-march=native`, so the
cached build also runs on the CPUs that key names).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
_SIMD = ("avx2", "fma", "f16c")

_modules: dict[tuple[str, ...], ModuleType] = {}


class BuildFailed(RuntimeError):
    """The compiler or OpenMP is missing, or the compile failed; the message has its output."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The feature flags of this machine's CPU (empty when /proc/cpuinfo is unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def compile_flags(flags: frozenset[str]) -> list[str]:
    """C++ flags for a CPU with feature `flags`: SIMD only when every one of _SIMD is present."""
    base = ["-O3", "-fopenmp", "-std=c++17"]
    if all(f in flags for f in _SIMD):
        base += ["-mavx2", "-mfma", "-mf16c"]
    return base


def extension_name(cflags: list[str]) -> str:
    """A name unique to the source text and the flags (the build cache's key)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(cflags).encode()).hexdigest()[:12]
    return f"pk_cpu_{digest}"


def load(cflags: list[str] | None = None) -> ModuleType:
    """The compiled module for `cflags` (default: `compile_flags` of this CPU), built on the first
    call of the process for those flags and cached on disk after. Tests pass the portable flags
    (`compile_flags(frozenset())`) to check the non-SIMD code path too."""
    if cflags is None:
        cflags = compile_flags(cpu_flags())
    key = tuple(cflags)
    if key in _modules:
        return _modules[key]
    from torch.utils import cpp_extension

    name = extension_name(cflags)
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    if not any(build_dir.glob(f"{name}*.so")):
        print(f"paged_kernels cpu backend: compiling {SOURCE.name} ({' '.join(cflags)}), "
              "once per machine (~30 s)", file=sys.stderr, flush=True)
    try:
        module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=cflags,
                                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # the compiler's output is in the message
        raise BuildFailed(f"building {SOURCE} failed: {exc}") from exc
    _modules[key] = module
    return module
