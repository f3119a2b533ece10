"""The Triton backend of paged-kernels (docs/triton.md).

Importing this package does not import Triton; `triton_impl.backend.TritonBackend` does, and
raises `BackendUnavailable` when Triton or a device to run it on is missing.
"""
