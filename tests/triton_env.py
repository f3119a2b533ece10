"""What every Triton test file needs first: Triton importable and the triton backend available
(else the importing test module is skipped), and the device its tensors live on.

Without a CUDA device the backend runs in Triton's interpreter on CPU tensors; tests/conftest.py
sets TRITON_INTERPRET=1 for that before Triton is first imported.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import paged_kernels as pk  # noqa: E402

if "triton" not in pk.available_backends():
    pytest.skip(f"triton backend unavailable: {pk.unavailable_backends().get('triton')}",
                allow_module_level=True)

from triton_impl import runtime  # noqa: E402

DEVICE = "cpu" if runtime.interpreting() else "cuda"
