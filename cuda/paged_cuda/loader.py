"""Finds the launchers for the "cuda" backend: the ahead-of-time extension, else the JIT path.

Order: (1) `_pk_cuda` importable from sys.path (installed by `PAGED_KERNELS_BUILD_CUDA=1 pip
install .`); (2) a `_pk_cuda*.so` in `$PAGED_KERNELS_CUDA_EXT_DIR` (what
`python -m cuda.paged_cuda.build --out DIR` writes); (3) `jit.JitModule` (NVRTC through CuPy).
A found extension's params layout is checked against cuda/csrc/pk_ops.h.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

from cuda.paged_cuda import params

EXT_NAME = "_pk_cuda"
EXT_DIR_ENV = "PAGED_KERNELS_CUDA_EXT_DIR"


def _from_dir(directory: str) -> ModuleType | None:
    for path in sorted(Path(directory).glob(f"{EXT_NAME}*.so")):
        spec = importlib.util.spec_from_file_location(EXT_NAME, path)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def aot_extension() -> ModuleType | None:
    """The built extension, or None when there is none (import errors other than "not found"
    propagate: a broken build should be seen, not skipped)."""
    directory = os.environ.get(EXT_DIR_ENV)
    module = _from_dir(directory) if directory else None
    if module is None:
        try:
            module = importlib.import_module(EXT_NAME)
        except ModuleNotFoundError:
            return None
    params.check_layout(module)
    return module


def load_launchers() -> tuple[object, str]:
    """(launchers, how) where how is "aot" or "jit"; ImportError when neither is available."""
    module = aot_extension()
    if module is not None:
        return module, "aot"
    from cuda.paged_cuda.jit import JitModule
    try:
        return JitModule(), "jit"
    except ImportError as exc:
        raise ImportError(f"no built {EXT_NAME} extension (set {EXT_DIR_ENV} or build with "
                          f"PAGED_KERNELS_BUILD_CUDA=1) and CuPy is not installed for the NVRTC "
                          f"path: {exc}") from exc
