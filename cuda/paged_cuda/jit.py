"""The run-time path: the kernel sources compiled with NVRTC through CuPy, launched from Python.

Used when no built `_pk_cuda` extension is found on a machine with a GPU. `JitModule` has the
same three methods as the extension (`paged_attention`, `write_kv`, `copy_blocks`, taking packed
params and a stream), so launch.py drives both alike. It reads the plan from the packed params
(exactly the fields the C++ launchers dispatch on), compiles each template instantiation it
needs once per (GPU architecture, instantiation), and launches it with `cuLaunchKernel`, passing
the params struct by value.

Compiled modules are cached on disk by CuPy under `$PAGED_KERNELS_CACHE/cuda-jit/sm<arch>`
(default `~/.cache/paged_kernels`); the source text CuPy hashes embeds a digest of every header
in cuda/csrc, so an edited header never reuses a stale binary. The first compilation in a
process logs "compiling CUDA kernels ..." once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

from cuda.paged_cuda.launch import attention_launches
from cuda.paged_cuda.params import CSRC_DIR, CTYPES, DTYPE_CODES, unpack

log = logging.getLogger("paged_kernels.cuda")

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_COPY_UNITS = {16: "uint4", 8: "uint2", 4: "uint32_t", 2: "uint16_t"}
_CTYPE_OF_CODE = {code: CTYPES[dtype] for dtype, code in DTYPE_CODES.items()}
_lock = threading.Lock()
_announced = False


def cache_dir(arch: str) -> Path:
    """Where compiled modules for `arch` (e.g. "90") are cached."""
    base = os.environ.get("PAGED_KERNELS_CACHE") or os.path.join("~", ".cache", "paged_kernels")
    return Path(base).expanduser() / "cuda-jit" / f"sm{arch}"


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC_DIR.glob("*.cuh")) + [CSRC_DIR / "pk_ops.h"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


class _Driver:
    """The two CUDA driver calls CuPy does not expose with a by-value struct argument."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [
            ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        self.lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]

    def launch(self, func: int, grid: tuple[int, int, int], threads: int, smem: int,
               stream: int, packed: bytes) -> None:
        buf = ctypes.create_string_buffer(packed, len(packed))
        args = (ctypes.c_void_p * 1)(ctypes.cast(buf, ctypes.c_void_p))
        status = self.lib.cuLaunchKernel(ctypes.c_void_p(func), *grid, threads, 1, 1, smem,
                                         ctypes.c_void_p(stream), args, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {status}")

    def allow_smem(self, func: int, smem: int) -> None:
        status = self.lib.cuFuncSetAttribute(
            ctypes.c_void_p(func), _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        if status != 0:
            raise RuntimeError(f"cuFuncSetAttribute(max dynamic smem {smem}) failed: {status}")


class JitModule:
    """Extension-like launcher over NVRTC-compiled kernels (see the module docstring)."""

    def __init__(self) -> None:
        import cupy  # ImportError -> the backend is unavailable (loader.py)

        self._cupy = cupy
        self._driver = _Driver()
        self._functions: dict[tuple[str, str], Any] = {}
        self._digest = _sources_digest()

    def _function(self, header: str, name: str) -> Any:
        arch = self._cupy.cuda.Device().compute_capability  # e.g. "90"
        key = (arch, name)
        fn = self._functions.get(key)
        if fn is None:
            with _lock:
                fn = self._functions.get(key) or self._compile(arch, header, name)
                self._functions[key] = fn
        return fn

    def _compile(self, arch: str, header: str, name: str) -> Any:
        global _announced
        if not _announced:
            log.warning("paged_kernels: compiling CUDA kernels with NVRTC for sm_%s (first use; "
                        "cached in %s)", arch, cache_dir(arch))
            _announced = True
        source = (f"// paged_kernels sources {self._digest}\n"
                  f'#include "{header}"\n')
        options = ("-std=c++17", f"-I{CSRC_DIR}")  # CuPy adds -arch for the device
        old = os.environ.get("CUPY_CACHE_DIR")
        cache_dir(arch).mkdir(parents=True, exist_ok=True)
        os.environ["CUPY_CACHE_DIR"] = str(cache_dir(arch))
        try:
            module = self._cupy.RawModule(code=source, options=options,
                                          name_expressions=[name])
            fn = module.get_function(name)
        finally:
            if old is None:
                os.environ.pop("CUPY_CACHE_DIR", None)
            else:
                os.environ["CUPY_CACHE_DIR"] = old
        return fn

    def _run(self, header: str, name: str, grid: tuple[int, int, int], threads: int, smem: int,
             stream: int, packed: bytes) -> None:
        fn = self._function(header, name)
        ptr = getattr(fn, "kernel", fn).ptr  # RawKernel.kernel is the cupy.cuda.Function
        if smem > 48 * 1024:
            self._driver.allow_smem(ptr, smem)
        self._driver.launch(ptr, grid, threads, smem, stream, packed)

    def paged_attention(self, params: bytes, stream: int) -> None:
        """Launches the kernels the plan inside `params` names (as pk_launch.cuh would)."""
        for name, grid, threads, smem in attention_launches(unpack("attn", params)):
            header = "pk_decode.cuh" if name.startswith("pk_decode") else "pk_varlen.cuh"
            self._run(header, name, grid, threads, smem, stream, params)

    def write_kv(self, params: bytes, stream: int) -> None:
        v = unpack("write_kv", params)
        name = (f"pk_write_kv_quant_kernel<{_CTYPE_OF_CODE[v['dtype']]}>" if v["kv_dtype"]
                else f"pk_write_kv_kernel<{_COPY_UNITS[v['unit_bytes']]}>")
        self._run("pk_cache.cuh", name,
                  (v["grid_x"], v["grid_y"], 1), v["threads"], 0, stream, params)

    def copy_blocks(self, params: bytes, stream: int) -> None:
        v = unpack("copy", params)
        self._run("pk_cache.cuh", f"pk_copy_blocks_kernel<{_COPY_UNITS[v['unit_bytes']]}>",
                  (v["grid_x"], v["grid_y"], 1), v["threads"], 0, stream, params)

