"""Test-session setup shared by every test file.

On a machine without a CUDA device, Triton can only run through its interpreter, which must be
chosen before Triton is first imported: set TRITON_INTERPRET=1 here, at collection time.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def hf_default_model():
    """Hugging Face transformers' model loaded from the engine's default GGUF file, in float32:
    the engine's independent oracle. Loaded once per test session."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import torch
    from engine.model.loader import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model.eval()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="run the full conformance matrix (every axis crossed with every other)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exhaustive: part of the full conformance matrix only")
