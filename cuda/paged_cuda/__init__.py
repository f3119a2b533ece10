"""Python side of the CUDA backend (cuda/csrc holds the kernels; docs/cuda.md describes both).

`backend.CudaBackend` ("cuda", GPU) and `host_backend.CudaHostBackend` ("cuda-host", the same
sources run on the CPU by the emulator in cuda/host) share `ops.py`, the one adapter and planner.
Importing this package imports nothing heavy (no CuPy, no extension).
"""
