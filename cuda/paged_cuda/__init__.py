"""Python side of the CUDA backend (cuda/csrc holds the kernels; docs/cuda.md describes both).

`backend.CudaBackend` ("cuda", GPU) and `host_backend.CudaHostBackend` ("cuda-host", the same
sources run on the CPU by the emulator in cuda/host) share one adapter and planner: launch.py
(the launches), planner.py (the one planner), settings.py (the choices the environment can
force), params.py (the params structs of pk_ops.h); tune_verdict.py is the rule that picks the
settings' defaults from a GPU timing run. Importing this package imports nothing heavy (no CuPy,
no extension).
"""
