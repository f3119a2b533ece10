"""Compiling one C++ file at first use: as a torch extension (`load`: the `cpu` attention
backend, `cpu_impl/build.py`; the engine's layer ops) or as a plain shared library for ctypes
(`load_library`: no torch headers, so a build takes seconds instead of ~30 s; the engine's
quantized matmul, `engine/native_build.py`).

A build goes to torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`) under a name keyed on the source's hash and the compile flags, so a
machine with other CPU features, or an edited source, gets its own build. Callers choose SIMD
flags from `cpu_flags()` themselves and never use `-march=native`, so a cached build also runs
on every CPU that has the features its name was keyed on.
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
from typing import Any

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
    with _exclusive(build_dir.parent / f".{name}.flock"):
        _drop_stale_baton(build_dir)
        try:
            module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags,
                                        extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # the compiler's output is in the message
            raise BuildFailed(f"building {source} failed: {exc}") from exc
    _modules[key] = module
    return module


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Holds an exclusive `flock` on `path` (created if missing) for the block. The kernel
    releases it when its process dies, however it dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _drop_stale_baton(build_dir: Path) -> None:
    """Removes torch's build lock (`build_dir/lock`, a file whose mere existence makes every
    later load of the extension wait for ever) when it is stale. Called under `_exclusive`, which
    every build of ours holds, so a `lock` found then was left by a process killed mid-build
    (seen: a test run cut by its timeout hung the next run's first load of the extension)."""
    baton = build_dir / "lock"
    if baton.exists():
        print(f"paged_kernels: removing {baton}, left by a build that was killed",
              file=sys.stderr, flush=True)
        baton.unlink(missing_ok=True)


def load_library(source: Path, prefix: str, cflags: list[str], what: str) -> ctypes.CDLL:
    """The shared library compiled from the single C++ file `source` (which must not include
    torch headers) with `cflags` plus `-shared -fPIC -fopenmp`, by `$CXX` (default `c++`), for
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
    compiler = os.environ.get("CXX", "c++")
    print(f"{what}: compiling {source.name} ({' '.join(cflags)}), once per machine",
          file=sys.stderr, flush=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    command = [compiler, *cflags, "-shared", "-fPIC", "-fopenmp", str(source), "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BuildFailed(f"building {source} failed: cannot run {compiler!r}: {exc}") from exc
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BuildFailed(f"building {source} failed ({' '.join(command)}):\n{done.stderr}")
    os.replace(partial, path)
