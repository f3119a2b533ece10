"""Test-session setup shared by every test file.

The whole suite (`python -m pytest`, no paths given) runs in pytest-xdist worker processes, one
test file per worker at a time (`-n auto --dist loadfile`, pyproject.toml): most tests keep one
core busy, so two workers on a 2-core machine take about half the time. The files that take
longest go out first (`SLOW_FILES`), so that no long file starts last and runs alone. A run of
named files or tests stays in one process. `PAGED_KERNELS_TEST_WORKERS=N` sets the number for
any run (0: no workers). A test marked `exclusive` (it times latencies, or plants a file in the
shared build cache) runs while no other test runs.

On a machine without a CUDA device, Triton can only run through its interpreter, which must be
chosen before Triton is first imported: set TRITON_INTERPRET=1 here, at collection time.

When the session will run the cpu backend's narrower builds (portable, AVX2), one background
process compiles them as soon as collection ends, on a core the (mostly single-threaded) tests
leave idle; a test that needs one before it is ready waits on the build's lock
(`paged_kernels.cpp_build.load`), so the result is the same, only sooner.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator, Optional

import pytest

#: The narrower builds' CPU features (tests/test_cpu_backend.py builds the same ones).
NARROWER_BUILDS = ("frozenset()", "frozenset({'avx2', 'fma', 'f16c'})")
_prebuild: Optional[subprocess.Popen] = None
#: The test files that take longest (a sequential run with `--durations=0` on a 2-core machine
#: of the CI's kind: 30-160 s each), handed to the workers first, slowest first; the rest follow in
#: collection order (`--no-loadscope-reorder`).
SLOW_FILES = ("test_cuda_build.py", "test_bench_paper.py", "test_gpu_check_smoke.py",
              "test_tp_engine.py", "test_engine_llm.py", "test_soak.py",
              "test_cuda_host_kernels.py", "test_serve_stalls.py")
#: Tests run by at most this many workers when the whole suite runs.
MAX_WORKERS = 4
WORKERS_ENV = "PAGED_KERNELS_TEST_WORKERS"
#: The workers' lock files' folder: made by the controlling process (`pytest_configure`), kept
#: in its stash, handed to each worker under this key of `workerinput`.
LOCK_DIR_KEY = "paged_kernels_lock_dir"
_LOCK_DIR = pytest.StashKey[str]()

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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: `PAGED_KERNELS_TEST_WORKERS` when set; else, for the whole suite (no paths on
    the command line), one worker per core up to `MAX_WORKERS`; else none (one process)."""
    if os.environ.get(WORKERS_ENV):
        count = int(os.environ[WORKERS_ENV])
        if count < 0:
            raise pytest.UsageError(f"{WORKERS_ENV}: expected a count >= 0, got {count}")
        return count
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return 0
    return min(MAX_WORKERS, os.cpu_count() or 1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exhaustive: part of the full conformance matrix only")
    config.addinivalue_line("markers", "exclusive: runs while no other test of the session runs "
                            "(it times latencies, or changes state that other tests' processes "
                            "share)")
    if getattr(config.option, "numprocesses", 0) and not hasattr(config, "workerinput"):
        config.stash[_LOCK_DIR] = tempfile.mkdtemp(prefix="paged-kernels-tests-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _LOCK_DIR in config.stash:
        shutil.rmtree(config.stash[_LOCK_DIR], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Hands each worker the lock files' folder."""
    node.workerinput[LOCK_DIR_KEY] = node.config.stash[_LOCK_DIR]


@contextlib.contextmanager
def _machine_share(lock_dir: str, exclusive: bool) -> Iterator[None]:
    """Holds the run lock shared (any test) or exclusive (an `exclusive` test) while a test runs.
    A gate lock taken first gives the exclusive one precedence: while it waits, no new test
    starts, so the running ones drain instead of handing the lock on to each other."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    with open(os.path.join(lock_dir, "gate"), "a") as gate, \
            open(os.path.join(lock_dir, "run"), "a") as run:
        fcntl.flock(gate, mode)
        fcntl.flock(run, mode)
        fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]):
    """In a worker, each test (with the fixtures its set-up starts and its teardown stops)
    runs under `_machine_share`."""
    lock_dir = getattr(item.config, "workerinput", {}).get(LOCK_DIR_KEY)
    if lock_dir is None:
        yield
        return
    with _machine_share(lock_dir, item.get_closest_marker("exclusive") is not None):
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker, moves the tests of `SLOW_FILES` to the front, slowest file first (every
    worker collects, and so orders, alike)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts compiling the narrower cpu builds in the background when a collected test needs
    them."""
    global _prebuild
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # one worker starts it
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
