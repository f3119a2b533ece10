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


def test_every_header_a_build_includes_is_package_data():
    """Each header that an installed C++ source includes with quotes (its own folder's, or a
    shared one such as paged_kernels/csrc/amx_tiles.h) lies in a package setuptools finds and
    matches the package-data patterns, so builds from an install find it."""
    from setuptools import find_namespace_packages

    from paged_kernels.cpp_build import local_headers

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    assert find.get("namespaces") is True
    packages = set(find_namespace_packages(where=str(ROOT), include=find["include"]))
    patterns = config["tool"]["setuptools"]["package-data"]["*"]
    sources = [p for pat in ("cpu_impl/csrc/*.cpp", "engine/csrc/*.cpp") for p in ROOT.glob(pat)]
    headers = {h for source in sources for h in local_headers(source)}
    assert ROOT / "paged_kernels" / "csrc" / "amx_tiles.h" in headers
    for header in headers:
        package = ".".join(header.parent.relative_to(ROOT).parts)
        assert package in packages, f"{header} is in {package}, not a package setuptools finds"
        assert any(fnmatch.fnmatch(header.name, pat) for pat in patterns), header
