"""The installed package holds every importable part of the repository (pyproject.toml).

A top-level package left out of `[tool.setuptools.packages.find]` still imports from a checkout
(the working directory is on sys.path) but not from an install, which is how the `cpu` backend
went missing for `python -m engine.serve` run outside the repository.
"""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Repository tools that are run from a checkout, never installed.
NOT_INSTALLED = {"tests", "bench"}


def test_every_top_level_package_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - NOT_INSTALLED
    missing = sorted(p for p in packages if not any(fnmatch.fnmatch(p, pat) for pat in include))
    assert not missing, f"pyproject.toml's packages.find include misses {missing}"
