"""The first-use C++ build's cache key (paged_kernels/cpp_build.py): a library is rebuilt when its
source, a local header it includes (directly or through another header), or its flags change."""

from __future__ import annotations

from pathlib import Path

from paged_kernels.cpp_build import extension_name, local_headers


def test_build_key_covers_local_headers(tmp_path: Path):
    source = tmp_path / "k.cpp"
    (tmp_path / "sub").mkdir()
    source.write_text('#include <vector>\n#include "a.h"\n  #  include "sub/b.h"\nint f();\n')
    (tmp_path / "a.h").write_text('#pragma once\n#include "c.h"\n#include "missing.h"\n')
    (tmp_path / "sub" / "b.h").write_text("#pragma once\n")
    (tmp_path / "c.h").write_text('#include "a.h"\n')  # a cycle is followed once
    assert [p.name for p in local_headers(source)] == ["a.h", "b.h", "c.h"]
    key = extension_name("x", source, ["-O3"])
    assert extension_name("x", source, ["-O3"]) == key
    assert extension_name("x", source, ["-O2"]) != key
    (tmp_path / "c.h").write_text('#include "a.h"\n// edited\n')
    assert extension_name("x", source, ["-O3"]) != key


def test_engine_kernels_share_the_scalar_header():
    csrc = Path(__file__).resolve().parent.parent / "engine" / "csrc"
    for name in ("quant_matmul.cpp", "int8_matmul.cpp"):
        assert [p.name for p in local_headers(csrc / name)] == ["gguf_scalars.h"]


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path: Path):
    """torch waits for ever while its build lock file exists; a build killed mid-way leaves
    one. `load` holds its own flock (released when a process dies) and, under it, removes the
    stale file: a fresh process loads the extension at once."""
    import subprocess
    import sys

    from torch.utils import cpp_extension

    from cpu_impl import build

    build.load()  # built (or found) once
    name = build.extension_name(build.compile_flags(build.cpu_flags()))
    baton = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    baton.touch()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", "from cpu_impl import build; build.load()"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "left by a build that was killed" in proc.stderr
    assert not baton.exists()
