"""The layers of docs/architecture.md are contracts, checked here: `lint-imports` with the
contracts of pyproject.toml (the engine uses paged_kernels' public API only; backends never import
the engine, bench or each other; the core imports no backend; no import cycles inside a package),
and `ruff check` with its rules there.

One test plants a violation of each kind in a copy of the sources and expects `lint-imports` to
name the broken contract, so the contracts cannot pass vacuously (for example by no longer
finding the packages they name).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = CONFIG["tool"]["importlinter"]["root_packages"]


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """Runs `lint-imports` on the packages importable from `cwd` (first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    script = ("import sys; from importlinter.cli import lint_imports; "
              "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))")
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    names = [c["name"] for c in CONFIG["tool"]["importlinter"]["contracts"]]
    assert f"Contracts: {len(names)} kept, 0 broken." in run.stdout, run.stdout


def test_ruff_check_passes():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def _copy_sources(dst: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    for package in PACKAGES:
        for src in (ROOT / package).rglob("*.py"):
            target = dst / src.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, target)


#: (module to plant in, the line planted, the contract that must break, what its report names)
PLANTED = [
    ("engine/llm.py", "import reference.attention",
     "the engine uses paged_kernels' public API only, never a backend",
     "engine.llm -> reference.attention"),
    ("engine/llm.py", "import paged_kernels.abi",
     "the engine uses paged_kernels' public API only, never a backend",
     "engine.llm -> paged_kernels.abi"),
    ("cpu_impl/backend.py", "import engine.config", "backends never import the engine or bench",
     "cpu_impl.backend -> engine.config"),
    ("triton_impl/backend.py", "import cpu_impl.backend", "backends never import each other",
     "triton_impl.backend -> cpu_impl.backend"),
    ("paged_kernels/attention.py", "import reference.attention",
     "the core imports no backend (the registry loads them by name, on first use)",
     "paged_kernels.attention -> reference.attention"),
    ("engine/config.py", "import engine.llm",
     "no import cycles between the modules of a package", "No cycles are allowed in engine."),
]


@pytest.mark.parametrize("module, line, contract, named", PLANTED, ids=[p[1] for p in PLANTED])
def test_planted_violation_breaks_its_contract(tmp_path, module, line, contract, named):
    _copy_sources(tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{line}  # planted\n")
    run = _lint_imports(tmp_path)
    assert run.returncode != 0, run.stdout
    assert f"{contract} BROKEN" in run.stdout, run.stdout
    report = run.stdout.split("Broken contracts", 1)[1].split(f"\n{contract}\n", 1)[1]
    assert named in report, report
