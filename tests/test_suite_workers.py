"""How the suite spreads over worker processes (tests/conftest.py): the worker count, the order
in which files go out, and the lock that runs `exclusive` tests alone."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest


def _config(source):
    return SimpleNamespace(args_source=source)


def test_workers_for_the_whole_suite_only(monkeypatch):
    monkeypatch.delenv(conftest.WORKERS_ENV, raising=False)
    monkeypatch.setattr(conftest.os, "cpu_count", lambda: 16)
    whole = _config(pytest.Config.ArgsSource.TESTPATHS)
    named = _config(pytest.Config.ArgsSource.ARGS)
    assert conftest.pytest_xdist_auto_num_workers(whole) == conftest.MAX_WORKERS
    assert conftest.pytest_xdist_auto_num_workers(named) == 0
    monkeypatch.setattr(conftest.os, "cpu_count", lambda: 2)
    assert conftest.pytest_xdist_auto_num_workers(whole) == 2
    monkeypatch.setenv(conftest.WORKERS_ENV, "3")
    assert conftest.pytest_xdist_auto_num_workers(named) == 3
    monkeypatch.setenv(conftest.WORKERS_ENV, "-1")
    with pytest.raises(pytest.UsageError, match=conftest.WORKERS_ENV):
        conftest.pytest_xdist_auto_num_workers(whole)


def test_slow_files_go_out_first_in_their_order(monkeypatch):
    names = ["test_a.py", conftest.SLOW_FILES[1], "test_b.py", conftest.SLOW_FILES[0]]
    items = [SimpleNamespace(path=Path("tests") / n, name=f"{n}:{i}")
             for i, n in enumerate(names)]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.path.name for i in items] == [conftest.SLOW_FILES[0], conftest.SLOW_FILES[1],
                                            "test_a.py", "test_b.py"]
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    unchanged = list(reversed(items))
    conftest.pytest_collection_modifyitems(None, unchanged)  # one process: the order is kept
    assert unchanged == list(reversed(items))


def test_an_exclusive_test_waits_for_running_ones_and_blocks_new_ones(tmp_path):
    """Shared holders run together; the exclusive one starts when they have ended, and a shared
    one that asks while it waits starts only after it."""
    log: list[str] = []

    def hold(name: str, exclusive: bool, seconds: float) -> None:
        with conftest._machine_share(str(tmp_path), exclusive):
            log.append(f"{name}+")
            time.sleep(seconds)
            log.append(f"{name}-")

    threads = [threading.Thread(target=hold, args=("a", False, 1.0))]
    threads[0].start()
    while not log:  # a holds the lock
        time.sleep(0.01)
    threads.append(threading.Thread(target=hold, args=("x", True, 0.2)))
    threads[1].start()
    time.sleep(0.3)  # x waits for a, holding the gate
    threads.append(threading.Thread(target=hold, args=("b", False, 0.0)))
    threads[2].start()
    for t in threads:
        t.join(10)
    assert log == ["a+", "a-", "x+", "x-", "b+", "b-"]
