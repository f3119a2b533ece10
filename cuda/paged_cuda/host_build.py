"""Builds host-execution modules: CUDA kernel sources compiled as host C++ over cuda/host/.

`host_module()` builds (once per source hash) and imports `_pk_cuda_host`: every `cuda/csrc/*.cu`
(CK's launchers and kernels) and `cuda/csrc/bindings.cpp`, compiled by g++ with
`-x c++ -DPK_HOST_EMULATION` over the emulator headers in `cuda/host/`, plus the emulator's
scheduler (`cuda/host/pk_host_runtime.cpp`). `build_module()` is the general form (the emulator's
own tests build their kernels with it).

The build goes to `$PAGED_KERNELS_CACHE/host/<name>-<hash>` (default cache
`~/.cache/paged_kernels`), where the hash covers every source and header it can read, the flags,
the compiler's version and the Python ABI; an unchanged hash reuses the built module. The compiler
(`$CXX`, default g++) and the build lock (an `flock` per build directory, released however a build
dies) are those of every C++ build of the project (`paged_kernels.cpp_build`). Objects are compiled
with ninja when it is installed (else with parallel g++ calls). `extern __shared__` arrays have no
definition in host C++; after compiling, the build finds the ones the objects reference (`nm`) and
defines each as a thread-local buffer of the largest dynamic shared memory a block may have (see
cuda/host/pk_host_sched.h), in a generated `pk_host_dynsmem.cpp`.

Set `PK_HOST_INSTANTIATIONS` to pass `-DPK_HOST_INSTANTIATIONS=<value>` to the compiler (a
reduced template set: the launchers then compile head sizes 64 and 128 only), and
`PK_HOST_CXXFLAGS` to add compiler flags (e.g. `-g -O0` to debug a kernel, or
`-DPK_HOST_USE_UCONTEXT` for the portable fiber switch); both are part of the cache key.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

from paged_kernels import cpp_build

CUDA_DIR = Path(__file__).resolve().parent.parent
CSRC_DIR = CUDA_DIR / "csrc"
HOST_DIR = CUDA_DIR / "host"
RUNTIME_SOURCE = HOST_DIR / "pk_host_runtime.cpp"
HOST_MODULE_NAME = "_pk_cuda_host"

#: Bytes of each `extern __shared__` buffer: the largest dynamic shared memory of a block (sm_90).
DYNAMIC_SMEM_BYTES = 227 * 1024

CXX_FLAGS = (
    "-std=c++17", "-O2", "-fPIC", "-pthread", "-fno-strict-aliasing", "-fvisibility=hidden",
    "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function", "-Wno-unused-variable",
    # The thread-local `extern __shared__` arrays are constant-initialised: without this flag
    # g++ calls a (weak, absent) TLS init function on every access from another file.
    "-fno-extern-tls-init",
    "-DPK_HOST_EMULATION",
)

_EXTERN_SHARED = re.compile(r"extern\s+__shared__\b[^;]*?\b(\w+)\s*\[\s*\]\s*;")
#: Local statics of the C++ library and pybind11 (never __shared__, some not thread-local).
_LIBRARY_STATICS = ("_ZZNSt", "_ZZNKSt", "_ZZSt", "_ZZN8pybind11", "_ZZNK8pybind11")
_STATIC_SHARED = re.compile(r"__shared__\b[^;{}]*?\b(\w+)\s*(?:\[[^\]]*\]\s*)*;")
_loaded: dict[str, ModuleType] = {}
_announced: set[str] = set()


class HostBuildError(cpp_build.BuildFailed):
    """The host build could not run or failed; the message has the compiler's output."""


def cache_root() -> Path:
    """`$PAGED_KERNELS_CACHE/host`, default `~/.cache/paged_kernels/host`."""
    base = os.environ.get("PAGED_KERNELS_CACHE") or os.path.join("~", ".cache", "paged_kernels")
    return Path(base).expanduser() / "host"


def compiler() -> str:
    """The path of `cpp_build.compiler()`; raises HostBuildError when it is not on PATH."""
    cxx = cpp_build.compiler()
    path = shutil.which(cxx)
    if path is None:
        raise HostBuildError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
    return path


def _pybind11_include() -> str:
    try:
        import pybind11
    except ImportError as exc:
        raise HostBuildError("pybind11 is not installed (pip install pybind11)") from exc
    return pybind11.get_include()


def _compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else cxx


def _source_hash(files: Sequence[Path], flags: Sequence[str], cxx: str) -> str:
    h = hashlib.sha256()
    for path in sorted(set(files)):
        h.update(str(path.name).encode())
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(_compiler_version(cxx).encode())
    h.update((sysconfig.get_config_var("EXT_SUFFIX") or "").encode())
    return h.hexdigest()[:16]


def _headers_of(dirs: Sequence[Path]) -> list[Path]:
    found: list[Path] = []
    for d in dirs:
        for pattern in ("*.h", "*.cuh", "*.hpp", "*.cu", "*.cpp"):
            found.extend(p for p in d.glob(pattern) if p.is_file())
    return found


def _flags(include_dirs: Sequence[Path], defines: Sequence[str]) -> list[str]:
    flags = list(CXX_FLAGS)
    flags += [f"-D{d}" for d in defines]
    inst = os.environ.get("PK_HOST_INSTANTIATIONS")
    if inst:
        flags.append(f"-DPK_HOST_INSTANTIATIONS={inst}")
    flags += os.environ.get("PK_HOST_CXXFLAGS", "").split()
    flags += [f"-I{d}" for d in include_dirs]
    flags += [f"-I{_pybind11_include()}", f"-I{sysconfig.get_paths()['include']}"]
    return flags


def _compile_cmd(cxx: str, flags: Sequence[str], src: Path, obj: Path) -> list[str]:
    lang = ["-x", "c++"] if src.suffix == ".cu" else []
    return [cxx, *flags, *lang, "-c", str(src), "-o", str(obj)]


def _run(cmd: Sequence[str], what: str) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise HostBuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _object_name(src: Path) -> str:
    return f"{src.parent.name}_{src.stem}.o"


def _write_ninja(build_dir: Path, cxx: str, flags: Sequence[str], sources: Sequence[Path],
                 output: Path) -> None:
    def esc(s: str) -> str:
        return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")

    objs = [build_dir / _object_name(s) for s in sources]
    dyn = build_dir / "pk_host_dynsmem.cpp"
    lines = [
        f"cxx = {esc(cxx)}",
        "cflags = " + " ".join(esc(f) for f in flags),
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "rule cu",
        "  command = $cxx -MMD -MF $out.d $cflags -x c++ -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "rule link",
        "  command = $cxx -shared -pthread $in -o $out",
    ]
    for src, obj in zip(sources, objs):
        rule = "cu" if src.suffix == ".cu" else "cxx"
        lines.append(f"build {esc(str(obj))}: {rule} {esc(str(src))}")
    lines.append(f"build {esc(str(build_dir / 'pk_host_dynsmem.o'))}: cxx {esc(str(dyn))}")
    lines.append("build objects: phony " + " ".join(esc(str(o)) for o in objs))
    all_objs = [*objs, build_dir / "pk_host_dynsmem.o"]
    lines.append(f"build {esc(str(output))}: link " + " ".join(esc(str(o)) for o in all_objs))
    lines.append(f"default {esc(str(output))}")
    (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")


def _nm(args: Sequence[str], objs: Sequence[Path]) -> list[list[str]]:
    """`nm -P <args>` over the objects: one list of fields per symbol line."""
    nm = shutil.which("nm")
    if nm is None:
        raise HostBuildError("nm (binutils) is needed to find the __shared__ arrays")
    proc = subprocess.run([nm, "-P", *args, *map(str, objs)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise HostBuildError(f"nm failed: {proc.stderr[-2000:]}")
    return [line.split() for line in proc.stdout.splitlines()
            if len(line.split()) >= 2 and not line.split()[0].endswith(":")]


def _shared_names(scan: Sequence[Path], pattern: re.Pattern) -> set[str]:
    names: set[str] = set()
    for path in scan:
        if path.suffix in (".cu", ".cuh", ".h", ".cpp", ".hpp"):
            names.update(pattern.findall(path.read_text(errors="replace")))
    return names


def _static_smem_symbols(scan: Sequence[Path], objs: Sequence[Path]) -> dict[str, int]:
    """Static `__shared__` arrays that other files can reach, with their sizes in bytes: the
    function-local statics of template or inline kernels (GNU unique symbols, `_ZZ...E<name>`)."""
    names = _shared_names(scan, _STATIC_SHARED) - _shared_names(scan, _EXTERN_SHARED)
    # A local static `name` of function F is `_ZZ<F>E<len>name`, maybe with `_<n>` after it.
    tails = [re.compile(rf"E{len(n)}{re.escape(n)}(?:_\d+)?$") for n in names]
    found: dict[str, int] = {}
    for fields in _nm(["--defined-only", "-S"], objs):
        sym, kind = fields[0], fields[1]
        if kind == "u" and sym.startswith("_ZZ") and len(fields) >= 4 and \
                not sym.startswith(_LIBRARY_STATICS) and any(t.search(sym) for t in tails):
            found[sym] = int(fields[3], 16)
    return found


def _dynamic_smem_symbols(scan: Sequence[Path], objs: Sequence[Path]) -> list[str]:
    """Mangled names of the `extern __shared__` arrays the objects reference."""
    names = _shared_names(scan, _EXTERN_SHARED)
    if not names:
        return []
    undefined = {fields[0] for fields in _nm(["-u"], objs)}
    if "__tls_init" in undefined:
        raise HostBuildError(
            "an `extern __shared__` array has internal linkage (its kernel is inside an unnamed "
            "namespace), so no other file can define it: the host build needs kernels with "
            f"dynamic shared memory outside unnamed namespaces (arrays: {sorted(names)})")
    wanted = []
    for sym in sorted(undefined):
        for name in names:
            # A namespace-scope array is `name` (global) or `_ZN...<len>nameE` (in a namespace).
            if sym == name or (sym.startswith("_ZN") and sym.endswith(f"{len(name)}{name}E")
                               and not sym.startswith(("_ZTH", "_ZTW"))):
                wanted.append(sym)
    return wanted


def _write_dynsmem(path: Path, symbols: Sequence[str], statics: dict[str, int]) -> None:
    """The buffers behind `extern __shared__`, and the list of both kinds of shared arrays
    the scheduler poisons at every block start (pk_host_runtime.cpp)."""
    hidden = 'extern "C" __attribute__((visibility("hidden")))'
    lines = [
        "// Generated by cuda/paged_cuda/host_build.py: the buffers behind `extern __shared__`",
        "// and the static __shared__ arrays other files can reach.",
        "#include <cstddef>",
    ]
    for i, sym in enumerate(symbols):
        lines.append(f"alignas(16) thread_local unsigned char pk_host_dyn_{i}"
                     f"[{DYNAMIC_SMEM_BYTES}] __asm__(\"{sym}\");")
    for i, sym in enumerate(statics):
        lines.append(f"extern thread_local unsigned char pk_host_static_{i}[] __asm__(\"{sym}\");")
    lines.append(f"{hidden} int pk_host_dynamic_smem_regions(void** out, int max) {{")
    lines.append("  int n = 0;")
    for i in range(len(symbols)):
        lines.append(f"  if (n < max) out[n++] = pk_host_dyn_{i};")
    lines.append("  return n;")
    lines.append("}")
    lines.append(f"{hidden} int pk_host_static_smem_regions(void** out, size_t* bytes, int max) {{")
    lines.append("  int n = 0;")
    for i, size in enumerate(statics.values()):
        lines.append(f"  if (n < max) {{ out[n] = pk_host_static_{i}; bytes[n++] = {size}; }}")
    lines.append(f"  return {len(statics)};")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _build(build_dir: Path, cxx: str, flags: Sequence[str], sources: Sequence[Path],
           scan: Sequence[Path], output: Path) -> None:
    objs = [build_dir / _object_name(s) for s in sources]
    ninja = shutil.which("ninja")
    tmp_out = build_dir / ("tmp-" + output.name)
    if ninja:
        _write_ninja(build_dir, cxx, flags, sources, tmp_out)
        _run([ninja, "-C", str(build_dir), "objects"], "compiling (ninja)")
    else:
        workers = max(1, min(len(sources), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda so: _run(_compile_cmd(cxx, flags, *so), f"compiling {so[0]}"),
                          zip(sources, objs)))
    dyn = build_dir / "pk_host_dynsmem.cpp"
    _write_dynsmem(dyn, _dynamic_smem_symbols(scan, objs), _static_smem_symbols(scan, objs))
    if ninja:
        _run([ninja, "-C", str(build_dir)], "linking (ninja)")
    else:
        dyn_obj = build_dir / "pk_host_dynsmem.o"
        _run(_compile_cmd(cxx, flags, dyn, dyn_obj), "compiling pk_host_dynsmem.cpp")
        _run([cxx, "-shared", "-pthread", *map(str, objs), str(dyn_obj), "-o", str(tmp_out)],
             "linking")
    os.replace(tmp_out, output)


def _announce(name: str, build_dir: Path) -> None:
    """Says once per module and process that a (slow) build starts."""
    if name not in _announced:
        print(f"paged_kernels: compiling {name} (CUDA sources as host C++, first use; cached in "
              f"{build_dir})", file=sys.stderr, flush=True)
        _announced.add(name)


def build_module(name: str, sources: Sequence[Path], *, include_dirs: Sequence[Path] = (),
                 defines: Sequence[str] = (), hash_dirs: Sequence[Path] = ()) -> Path:
    """Builds (or finds in the cache) the extension module `name` from `sources` with the
    emulator; returns the path of the shared object. `hash_dirs` are directories whose headers
    and sources also decide the cache key (and are scanned for `extern __shared__`).

    Raises HostBuildError when no compiler/pybind11 is available or the build fails.
    """
    cxx = compiler()
    sources = [Path(s).resolve() for s in (*sources, RUNTIME_SOURCE)]
    dirs = [HOST_DIR, *[Path(d).resolve() for d in (*include_dirs, *hash_dirs)]]
    flags = _flags([HOST_DIR, *include_dirs], defines)
    scan = sorted(set(_headers_of(dirs)) | set(sources))
    key = _source_hash(scan, flags, cxx)
    build_dir = cache_root() / f"{name}-{key}"
    output = build_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if output.exists():
        return output
    with cpp_build.exclusive(build_dir / ".lock"):  # another process may be building it
        if not output.exists():
            _announce(name, build_dir)
            _build(build_dir, cxx, flags, sources, scan, output)
    return output


def load_module(name: str, path: Path) -> ModuleType:
    """Imports the extension module `name` from `path` (once per process)."""
    if name in _loaded:
        return _loaded[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise HostBuildError(f"cannot load {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _loaded[name] = module
    return module


def host_sources() -> list[Path]:
    """The sources of `_pk_cuda_host`: CK's launchers/kernels (`*.cu`) and `bindings.cpp`."""
    cus = sorted(CSRC_DIR.glob("*.cu"))
    bindings = CSRC_DIR / "bindings.cpp"
    if not bindings.exists():
        raise HostBuildError(f"{bindings} is missing")
    return [*cus, bindings]


def host_module(defines: Optional[Sequence[str]] = None) -> ModuleType:
    """Builds if needed and imports `_pk_cuda_host` (CK's sources over the emulator)."""
    extra = list(defines or ())
    path = build_module(HOST_MODULE_NAME, host_sources(), include_dirs=[CSRC_DIR],
                        defines=[f"PK_MODULE_NAME={HOST_MODULE_NAME}", *extra],
                        hash_dirs=[CSRC_DIR])
    return load_module(HOST_MODULE_NAME, path)
