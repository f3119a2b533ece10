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
