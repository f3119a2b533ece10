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
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from bench.quant_accuracy import transformers_model

    return transformers_model()


@pytest.fixture(scope="session")
def hf_greedy_continuations(hf_default_model):
    """`fn(prompts, max_new_tokens)`: transformers' greedy continuation (the token ids after the
    prompt) of each prompt's token ids; `max_new_tokens` is one int or one per prompt."""
    from bench.quant_accuracy import transformers_greedy

    def continuations(prompts, max_new_tokens):
        counts = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
                  else list(max_new_tokens))
        return transformers_greedy(hf_default_model, prompts, counts)

    return continuations


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures(...)`): on a shared
    2-core machine two OpenMP threads spin-wait each other several times slower whenever other
    processes are busy. Restored after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="run the full conformance matrix (every axis crossed with every other)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exhaustive: part of the full conformance matrix only")
