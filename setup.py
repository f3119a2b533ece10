"""Optional ahead-of-time build of the CUDA extension `_pk_cuda` (metadata lives in pyproject.toml).

A plain `pip install -e .` builds nothing here. With nvcc available and
`PAGED_KERNELS_BUILD_CUDA=1`, `_pk_cuda` is compiled by nvcc (+ ninja) for sm_80 and sm_90
(`PAGED_KERNELS_CUDA_ARCHS=80,90,...` overrides) and bound with pybind11, without torch headers:

    PAGED_KERNELS_BUILD_CUDA=1 pip install --no-build-isolation -e .

(`--no-build-isolation` so the build sees pybind11 and ninja from the environment.) Without an
extension, the "cuda" backend compiles the same sources at run time with NVRTC through CuPy.
See docs/cuda.md.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _cuda_build_module():
    """cuda/paged_cuda/build.py, loaded by path (it imports neither torch nor the package)."""
    spec = importlib.util.spec_from_file_location("pk_cuda_build",
                                                  HERE / "cuda" / "paged_cuda" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildCudaExtension(build_ext):
    """Builds `_pk_cuda` with nvcc through cuda/paged_cuda/build.py instead of setuptools'."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name != "_pk_cuda":
            super().build_extension(ext)
            return
        build = _cuda_build_module()
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent
        path, report = build.build_extension(out_dir)
        print(report)
        target = Path(self.get_ext_fullpath(ext.name))
        if path.resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            path.replace(target)


def _ext_modules() -> list[Extension]:
    if os.environ.get("PAGED_KERNELS_BUILD_CUDA") != "1":
        return []
    if _cuda_build_module().find_nvcc() is None:
        raise RuntimeError("PAGED_KERNELS_BUILD_CUDA=1 but nvcc was not found (set CUDA_HOME)")
    return [Extension("_pk_cuda", sources=[])]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": BuildCudaExtension})
