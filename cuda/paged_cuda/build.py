"""Ahead-of-time build of `_pk_cuda` with nvcc (+ ninja), and the ptxas register/spill report.

    python -m cuda.paged_cuda.build --out DIR [--archs 80,90] [--reduced]

compiles every `cuda/csrc/*.cu` with nvcc (one job per file, in parallel through ninja when it
is installed) and `bindings.cpp` with the host C++ compiler against pybind11 (no torch headers,
so the module does not depend on torch's C++ ABI), links `DIR/_pk_cuda<EXT_SUFFIX>` with the
static CUDA runtime, and prints the `-Xptxas -v` report (registers, spills per kernel). Point
the backend at it with `PAGED_KERNELS_CUDA_EXT_DIR=DIR`. setup.py calls `build_extension` when
`PAGED_KERNELS_BUILD_CUDA=1`.

`compile_cubins` is the compile check's entry (tests/test_cuda_build.py): each `.cu` to a cubin
per architecture, reports parsed by `parse_ptxas`.

This module imports neither torch nor the rest of the package (setup.py loads it by path).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
EXT_NAME = "_pk_cuda"
ARCHS_ENV = "PAGED_KERNELS_CUDA_ARCHS"
DEFAULT_ARCHS = ("80", "90")
NVCC_FLAGS = ("-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Xptxas", "-v",
              "--expt-relaxed-constexpr")
#: Kernels whose spills fail the compile check (the bandwidth-bound hot paths).
HOT_KERNELS = ("pk_decode_kernel", "pk_decode_mma_kernel", "pk_varlen_mma_async_kernel",
               "pk_varlen_simt_kernel")


class BuildError(RuntimeError):
    """nvcc/ninja/the host compiler is missing or failed; the message has its output."""


def find_nvcc() -> str | None:
    """`$CUDA_HOME/bin/nvcc` (or CUDA_PATH), else nvcc on PATH, else None."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def archs_from_env() -> tuple[str, ...]:
    """Architectures to build: `$PAGED_KERNELS_CUDA_ARCHS` ("80,90" or "80;90"), else 80, 90."""
    raw = os.environ.get(ARCHS_ENV, "")
    archs = tuple(a.strip().replace("sm_", "") for a in re.split(r"[,; ]", raw) if a.strip())
    return archs or DEFAULT_ARCHS


def sources() -> list[Path]:
    """The nvcc translation units (launchers + kernels)."""
    return sorted(CSRC_DIR.glob("*.cu"))


def gencode_flags(archs: Sequence[str]) -> list[str]:
    """SASS for every arch, plus PTX of the newest one (for later GPUs)."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    newest = max(archs, key=int)
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


# ---------------------------------------------------------------------------------------------
# ptxas report

@dataclass(frozen=True)
class KernelReport:
    """One `ptxas -v` entry."""

    name: str      # demangled when c++filt is available
    arch: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    @property
    def hot(self) -> bool:
        return any(k in self.name for k in HOT_KERNELS)


def _demangle(names: Sequence[str]) -> list[str]:
    filt = shutil.which("c++filt")
    if not filt or not names:
        return list(names)
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True,
                         check=False).stdout.splitlines()
    return out if len(out) == len(names) else list(names)


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> list[KernelReport]:
    """Kernel entries of a `-Xptxas -v` log (functions that are not entries are ignored)."""
    found: list[tuple[str, str, int, int, int, int]] = []
    name = arch = None
    spill: tuple[int, int, int] | None = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            name, arch, spill = m.group(1), m.group(2), None
            continue
        m = _SPILL.search(line)
        if m and name:
            spill = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            continue
        m = _REGS.search(line)
        if m and name and spill is not None:
            found.append((name, arch or "", int(m.group(1)), *spill))
            name = None
    names = _demangle([f[0] for f in found])
    return [KernelReport(n, f[1], f[2], f[3], f[4], f[5]) for n, f in zip(names, found)]


def format_report(reports: Sequence[KernelReport]) -> str:
    """A table: arch, registers, stack, spill stores/loads, kernel."""
    lines = [f"{'arch':7} {'regs':>4} {'stack':>5} {'spill st/ld':>11}  kernel"]
    for r in sorted(reports, key=lambda r: (r.arch, r.name)):
        flag = "  <-- SPILLS" if r.spills else ""
        lines.append(f"{r.arch:7} {r.registers:4d} {r.stack_bytes:5d} "
                     f"{r.spill_stores:5d}/{r.spill_loads:<5d}  {r.name}{flag}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Compile check: cubins only

def _run(cmd: Sequence[str], what: str) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n{out[-8000:]}")
    return out


def compile_cubins(out_dir: Path, archs: Sequence[str] = DEFAULT_ARCHS, *,
                   reduced_archs: Collection[str] = (), jobs: int = 2) -> list[KernelReport]:
    """Compiles every `.cu` to a cubin for each arch (in parallel) and returns ptxas's report.
    The archs in `reduced_archs` get head sizes 64 and 128 only (PK_REDUCED_HEAD_SIZES), the
    others every head size."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out_dir.mkdir(parents=True, exist_ok=True)
    # the full builds first, so that the pool ends on short ones
    tasks = [(src, a) for a in sorted(archs, key=lambda a: a in reduced_archs)
             for src in sources()]

    def one(task: tuple[Path, str]) -> str:
        src, arch = task
        cubin = out_dir / f"{src.stem}.sm{arch}.cubin"
        extra = ["-DPK_REDUCED_HEAD_SIZES"] if arch in reduced_archs else []
        return _run([nvcc, *NVCC_FLAGS, *extra, f"-arch=sm_{arch}", "-cubin", str(src), "-o",
                     str(cubin)], f"nvcc {src.name} sm_{arch}")

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        logs = list(pool.map(one, tasks))
    return parse_ptxas("\n".join(logs))


# ---------------------------------------------------------------------------------------------
# The extension

def _pybind11_include() -> str:
    try:
        import pybind11
    except ImportError as exc:
        raise BuildError("pybind11 is required to build _pk_cuda (pip install pybind11; with pip "
                         "install, use --no-build-isolation)") from exc
    return pybind11.get_include()


def _host_compile_cmd(cxx: str, obj: Path) -> list[str]:
    return [cxx, "-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden",
            f"-DPK_MODULE_NAME={EXT_NAME}", f"-I{CSRC_DIR}", f"-I{_pybind11_include()}",
            f"-I{sysconfig.get_paths()['include']}", "-c", str(CSRC_DIR / "bindings.cpp"),
            "-o", str(obj)]


def _ninja_escape(s: str) -> str:
    return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _write_ninja(build_dir: Path, nvcc: str, nvcc_flags: Sequence[str], host_cmd: Sequence[str],
                 objs: Sequence[Path], output: Path) -> None:
    e = _ninja_escape
    lines = [
        "rule nvcc",
        (f"  command = {e(nvcc)} {' '.join(map(e, nvcc_flags))} -c $in -o $out > $out.log 2>&1"
         " || (cat $out.log; exit 1)"),
        "  description = nvcc $in",
        "rule host",
        "  command = " + " ".join(map(e, host_cmd)),
        "  description = c++ bindings.cpp",
        "rule link",
        f"  command = {e(nvcc)} -shared -Xcompiler -fPIC $in -o $out",
        "  description = link $out",
    ]
    # Every object depends on every header (implicit inputs), so an edited header rebuilds them.
    headers = " ".join(e(str(h)) for h in sorted([*CSRC_DIR.glob("*.cuh"), *CSRC_DIR.glob("*.h")]))
    for src, obj in zip(sources(), objs):
        lines.append(f"build {e(str(obj))}: nvcc {e(str(src))} | {headers}")
    bind_obj = build_dir / "bindings.o"
    lines.append(f"build {e(str(bind_obj))}: host {e(str(CSRC_DIR / 'bindings.cpp'))} | {headers}")
    lines.append(f"build {e(str(output))}: link " + " ".join(e(str(o)) for o in [*objs, bind_obj]))
    (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")


def build_extension(out_dir: Path, archs: Sequence[str] | None = None, *,
                    reduced: bool = False, jobs: int | None = None) -> tuple[Path, str]:
    """Builds `out_dir/_pk_cuda<EXT_SUFFIX>`; returns (path, ptxas report text)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    archs = tuple(archs or archs_from_env())
    out_dir = Path(out_dir).resolve()
    build_dir = out_dir / "build-pk-cuda"
    build_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / f"{EXT_NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    flags = [*NVCC_FLAGS, *gencode_flags(archs), f"-I{CSRC_DIR}"]
    if reduced:
        flags.append("-DPK_REDUCED_HEAD_SIZES")
    objs = [build_dir / f"{s.stem}.o" for s in sources()]
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"
    host_cmd = _host_compile_cmd(cxx, build_dir / "bindings.o")
    ninja = shutil.which("ninja")
    if ninja:
        _write_ninja(build_dir, nvcc, flags, host_cmd, objs, output)
        cmd = [ninja, "-C", str(build_dir)] + ([f"-j{jobs}"] if jobs else [])
        _run(cmd, "ninja")
    else:
        def one(so: tuple[Path, Path]) -> None:
            log = _run([nvcc, *flags, "-c", str(so[0]), "-o", str(so[1])], f"nvcc {so[0].name}")
            Path(str(so[1]) + ".log").write_text(log)

        with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
            list(pool.map(one, zip(sources(), objs)))
        _run(host_cmd, "c++ bindings.cpp")
        _run([nvcc, "-shared", "-Xcompiler", "-fPIC", *map(str, objs),
              str(build_dir / "bindings.o"), "-o", str(output)], "link")
    logs = "\n".join(Path(str(o) + ".log").read_text() for o in objs
                     if Path(str(o) + ".log").exists())
    return output, format_report(parse_ptxas(logs))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the _pk_cuda extension with nvcc.")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--archs", default=None,
                        help=f"comma-separated SM versions (default ${ARCHS_ENV} or 80,90)")
    parser.add_argument("--reduced", action="store_true", help="head sizes 64 and 128 only")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs")
    args = parser.parse_args(argv)
    archs = tuple(a.strip() for a in args.archs.split(",")) if args.archs else None
    try:
        path, report = build_extension(args.out, archs, reduced=args.reduced, jobs=args.jobs)
    except BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(report)
    print(f"built {path}\nuse it with: export PAGED_KERNELS_CUDA_EXT_DIR={path.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
