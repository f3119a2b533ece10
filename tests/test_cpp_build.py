"""The first-use C++ build's cache key (paged_kernels/cpp_build.py): a library is rebuilt when its
source, a local header it includes (directly or through another header), or its flags change."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_kernels.cpp_build import (
    BASE_FLAGS,
    ISA,
    compile_flags,
    extension_name,
    local_headers,
    simd_flags,
)


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


def test_flags_come_from_the_first_tier_the_cpu_has_completely():
    """One table (ISA) maps each feature to its /proc/cpuinfo names and compiler flags; a tier's
    flags come in the tier's order, and a CPU missing any name of a tier gets the next tier."""
    tiers = ("avx512 + vnni", "avx2 + fma")
    avx512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma"})
    assert simd_flags(tiers, avx512) == ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
    assert simd_flags(tiers, avx512 - {"avx512bw"}) == ["-mavx2", "-mfma"]
    assert simd_flags(tiers, frozenset({"avx2"})) == []
    assert compile_flags(tiers, frozenset()) == list(BASE_FLAGS)
    assert compile_flags(tiers, avx512)[:len(BASE_FLAGS)] == list(BASE_FLAGS)
    assert all(not flag.startswith("-march") for _, flags in ISA.values() for flag in flags)
    with pytest.raises(ValueError, match="sse9"):
        simd_flags(("avx2 + sse9",), avx512)


def test_every_builds_flags_come_from_the_table():
    """The cpu backend, the engine's layer ops and its two matmul libraries choose their SIMD flags
    through the one table: on a CPU with every feature each gets exactly its widest tier."""
    from cpu_impl import build
    from engine import native_build
    from engine.model import layer_ops
    everything = frozenset(name for names, _ in ISA.values() for name in names)
    for tiers in (build.TIERS, native_build.TIERS, native_build.INT8_TIERS, layer_ops.TIERS):
        widest = [f.strip() for f in tiers[0].split("+")]
        assert simd_flags(tiers, everything) == [x for f in widest for x in ISA[f][1]]
    assert build.compile_flags(everything) == compile_flags(build.TIERS, everything)
    assert "-mavx512vl" in layer_ops.compile_flags(everything)
    assert "-mrecip" not in layer_ops.compile_flags(frozenset())


def test_engine_kernels_share_the_scalar_header():
    csrc = Path(__file__).resolve().parent.parent / "engine" / "csrc"
    for name in ("quant_matmul.cpp", "int8_matmul.cpp"):
        assert [p.name for p in local_headers(csrc / name)] == ["gguf_scalars.h"]


def test_amx_kernels_share_one_tile_header():
    """The two AMX users (the cpu backend's attention, the engine's tiled matmul) take the
    permission request and the tile configuration record from paged_kernels/csrc/amx_tiles.h,
    which each build key covers; neither defines its own."""
    root = Path(__file__).resolve().parent.parent
    shared = root / "paged_kernels" / "csrc" / "amx_tiles.h"
    for source in (root / "cpu_impl" / "csrc" / "paged_attention.cpp",
                   root / "engine" / "csrc" / "tiled_matmul.cpp"):
        headers = local_headers(source)
        assert shared in headers
        for path in [source, *headers]:
            if path != shared:
                text = path.read_text()
                assert "arch_prctl" not in text and "struct alignas(64) TileConfig" not in text


@pytest.mark.exclusive  # plants the stale file in the shared build cache: no other load may drop it
def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path: Path):
    """torch waits for ever while its build lock file exists; a build killed mid-way leaves
    one. `load` holds its own flock (released when a process dies) and, under it, removes the
    stale file: a fresh process loads the extension at once."""
    import subprocess
    import sys

    from torch.utils import cpp_extension

    from cpu_impl import build

    build.load()  # built (or found) once
    name = build.extension_name(build.compile_flags())
    baton = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    baton.touch()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", "from cpu_impl import build; build.load()"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "left by a build that was killed" in proc.stderr
    assert not baton.exists()
