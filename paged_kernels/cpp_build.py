"""The one build helper for the C++ code compiled at first use: the flags for this CPU, the build
cache, the build lock, and two loaders: `load` (a torch extension: the `cpu` attention backend,
`cpu_impl/build.py`; the engine's layer ops, `engine/model/layer_ops.py`) and `load_library` (a
plain shared library for ctypes, no torch headers, so a build takes seconds instead of ~30 s: the
engine's quantized matmuls, `engine/native_build.py`). The CUDA host build
(`cuda/paged_cuda/host_build.py`) takes its compiler and its lock from here.

Flags: a caller names the ISA tiers its source can use, widest first, as features of `ISA` joined
by "+" (e.g. `("avx512 + fma", "avx2 + fma")`); `compile_flags` returns `BASE_FLAGS` plus the
compiler flags of the first tier whose every feature /proc/cpuinfo lists (none: the portable
build). Never `-march=native`, so a cached build also runs on every CPU with the features its name
was keyed on.

A build goes to torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`) under a name keyed on the source's hash, its local headers' and the
compile flags, so a machine with other CPU features, or an edited source, gets its own build.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence

#: ISA feature -> (/proc/cpuinfo flags that must all be listed, compiler flags that enable it).
ISA: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("avx2",), ("-mavx2",)),
    "fma": (("fma",), ("-mfma",)),
    "f16c": (("f16c",), ("-mf16c",)),
    "avx512": (("avx512f", "avx512bw", "avx512vl"), ("-mavx512f", "-mavx512bw", "-mavx512vl")),
    "avx512dq": (("avx512dq",), ("-mavx512dq",)),
    "bf16": (("avx512_bf16",), ("-mavx512bf16",)),
    "vnni": (("avx512_vnni",), ("-mavx512vnni",)),
    "vbmi": (("avx512vbmi",), ("-mavx512vbmi",)),
    "amx": (("amx_tile", "amx_bf16"), ("-mamx-tile", "-mamx-bf16")),
}
#: The flags of every build: optimised, OpenMP, C++17.
BASE_FLAGS = ("-O3", "-fopenmp", "-std=c++17")

_modules: dict[tuple[str, str, tuple[str, ...]], Any] = {}


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


def simd_flags(tiers: Sequence[str], cpu: Optional[frozenset[str]] = None) -> list[str]:
    """The compiler flags of the first of `tiers` (each ISA features joined by "+", widest tier
    first) whose every feature the CPU has (`cpu`: /proc/cpuinfo flags, default this machine's),
    in the tier's order; [] when it has none of them. Raises ValueError for a feature not in ISA."""
    if cpu is None:
        cpu = cpu_flags()
    for tier in tiers:
        features = [f.strip() for f in tier.split("+")]
        unknown = [f for f in features if f not in ISA]
        if unknown:
            raise ValueError(f"tiers: expected features of {sorted(ISA)}, got {unknown} in "
                             f"{tier!r}")
        if all(flag in cpu for f in features for flag in ISA[f][0]):
            return [flag for f in features for flag in ISA[f][1]]
    return []


def compile_flags(tiers: Sequence[str], cpu: Optional[frozenset[str]] = None) -> list[str]:
    """`BASE_FLAGS` plus `simd_flags(tiers, cpu)`: the flags of a build for a CPU with feature
    flags `cpu` (default this machine's)."""
    return [*BASE_FLAGS, *simd_flags(tiers, cpu)]


def compiler() -> str:
    """The C++ compiler every build runs: `$CXX`, default `g++` (the flags are GCC's)."""
    return os.environ.get("CXX") or "g++"


def extension_name(prefix: str, source: Path, cflags: list[str]) -> str:
    """`prefix` plus a digest of the source text, of every local header it includes (`#include
    "..."`, found next to the file that includes it, followed recursively) and of the flags: the
    build cache's key, so that editing a shared header rebuilds every library that uses it."""
    digest = hashlib.sha256()
    for path in [source, *local_headers(source)]:
        digest.update(path.read_bytes())
    digest.update(" ".join(cflags).encode())
    return f"{prefix}_{digest.hexdigest()[:12]}"


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def local_headers(source: Path) -> list[Path]:
    """The existing files that `source` includes with quotes, directly or through each other,
    in the order first met (each once)."""
    found: list[Path] = []
    todo = [source]
    while todo:
        current = todo.pop(0)
        for name in _LOCAL_INCLUDE.findall(current.read_bytes()):
            path = (current.parent / name.decode()).resolve()
            if path.is_file() and path not in found and path != source.resolve():
                found.append(path)
                todo.append(path)
    return found


def load(source: Path, prefix: str, cflags: list[str], what: str) -> ModuleType:
    """The extension compiled from the single file `source` with `cflags` (plus OpenMP at link
    time), built on the first call of the process for that (source, flags) pair and cached on disk
    after. `what` names the build in the one-line notice printed before a compile. Raises
    BuildFailed with the compiler's output when the build fails."""
    key = ("extension", str(source), tuple(cflags))
    if key in _modules:
        return _modules[key]
    from torch.utils import cpp_extension

    name = extension_name(prefix, source, cflags)
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    if not any(build_dir.glob(f"{name}*.so")):
        print(f"{what}: compiling {source.name} ({' '.join(cflags)}), once per machine (~30 s)",
              file=sys.stderr, flush=True)
    with exclusive(build_dir.parent / f".{name}.flock"):
        _drop_stale_baton(build_dir)
        try:
            module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags,
                                        extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # the compiler's output is in the message
            raise BuildFailed(f"building {source} failed: {exc}") from exc
    _modules[key] = module
    return module


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Holds an exclusive `flock` on `path` (created if missing) for the block: the build lock.
    The kernel releases it when its process dies, however it dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _drop_stale_baton(build_dir: Path) -> None:
    """Removes torch's build lock (`build_dir/lock`, a file whose mere existence makes every
    later load of the extension wait for ever) when it is stale. Called under `exclusive`, which
    every build of ours holds, so a `lock` found then was left by a process killed mid-build
    (seen: a test run cut by its timeout hung the next run's first load of the extension)."""
    baton = build_dir / "lock"
    if baton.exists():
        print(f"paged_kernels: removing {baton}, left by a build that was killed",
              file=sys.stderr, flush=True)
        baton.unlink(missing_ok=True)


def load_library(source: Path, prefix: str, cflags: list[str], what: str) -> ctypes.CDLL:
    """The shared library compiled from the single C++ file `source` (which must not include
    torch headers) with `cflags` plus `-shared -fPIC -fopenmp`, by `compiler()`, for
    ctypes. Built once per machine into torch's extension cache, under a name keyed like `load`'s
    (a finished build is renamed into place, so concurrent first uses are safe), and loaded once
    per process. `what` names the build in the notice printed before a compile. Raises
    BuildFailed with the compiler's output when the build fails."""
    key = ("library", str(source), tuple(cflags))
    if key in _modules:
        return _modules[key]
    from torch.utils import cpp_extension

    name = extension_name(prefix, source, cflags)
    path = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
    if not path.exists():
        _compile_library(source, cflags, path, what)
    library = ctypes.CDLL(str(path))
    _modules[key] = library
    return library


def _compile_library(source: Path, cflags: list[str], path: Path, what: str) -> None:
    cxx = compiler()
    print(f"{what}: compiling {source.name} ({' '.join(cflags)}), once per machine",
          file=sys.stderr, flush=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    command = [cxx, *cflags, "-shared", "-fPIC", "-fopenmp", str(source), "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BuildFailed(f"building {source} failed: cannot run {cxx!r}: {exc}") from exc
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BuildFailed(f"building {source} failed ({' '.join(command)}):\n{done.stderr}")
    os.replace(partial, path)
