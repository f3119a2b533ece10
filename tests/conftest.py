"""Test-session setup shared by every test file.

On a machine without a CUDA device, Triton can only run through its interpreter, which must be
chosen before Triton is first imported: set TRITON_INTERPRET=1 here, at collection time.

When the session will run the cpu backend's narrower builds (portable, AVX2), one background
process compiles them as soon as collection ends, on a core the (mostly single-threaded) tests
leave idle; a test that needs one before it is ready waits on the build's lock
(`paged_kernels.cpp_build.load`), so the result is the same, only sooner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

import pytest

#: The narrower builds' CPU features (tests/test_cpu_backend.py builds the same ones).
NARROWER_BUILDS = ("frozenset()", "frozenset({'avx2', 'fma', 'f16c'})")
_prebuild: Optional[subprocess.Popen] = None

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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts compiling the narrower cpu builds in the background when a collected test needs
    them."""
    global _prebuild
    if not any("test_narrower_builds" in item.nodeid for item in session.items):
        return
    script = ("from cpu_impl import build\n"
              f"for cpu in ({', '.join(NARROWER_BUILDS)}):\n"
              "    build.load(build.compile_flags(cpu))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _prebuild = subprocess.Popen([sys.executable, "-c", script], cwd=root,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Waits for the background build (it is done by then unless the session was cut short,
    in which case it is stopped)."""
    if _prebuild is not None and _prebuild.poll() is None:
        _prebuild.terminate()
        _prebuild.wait(30)
