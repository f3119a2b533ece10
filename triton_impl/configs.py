"""Launch configurations of the attention kernels, from a small table (no autotuning).

A configuration is looked up by `(mode, head_size, block_size, dtype)`. The head size is padded to
the next power of two >= 16 (what the kernels compute on). The block size does not change the tile
shape, since the kernels gather the keys of a tile token by token through the block table and a tile
may span several blocks or part of one; it is part of the key so that a measured best entry for one
block size can be recorded in `_OVERRIDES` without touching the others.

No autotuning: the interpreter must not autotune, and a fixed table keeps results reproducible
(autotuning picks timing-dependent tile shapes, which changes rounding from run to run).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal, Optional

import torch

Mode = Literal["decode", "varlen"]
MODES = ("decode", "varlen")


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and launch parameters of one kernel.

    `tile_n`: keys per inner-loop iteration. `block_m`: query rows (query tokens x heads of the
    GQA group) per program of the varlen kernel; the decode kernel uses one row per query head.
    """

    tile_n: int
    block_m: int
    num_warps: int
    num_stages: int


def padded_head_size(head_size: int) -> int:
    """The power of two >= max(head_size, 16) that the kernels compute on (tl.dot needs >= 16)."""
    return max(16, 1 << (head_size - 1).bit_length())


# (mode, padded head size, bytes per element) -> config. Chosen by compiling for sm_90 with
# Triton 3.6 (no GPU at hand) and reading register use and shared memory: no entry spills
# registers; K/V tiles of the pipeline stages stay under about 100 KB of shared memory. float32
# runs exact (non-TF32) products on CUDA cores with operands in registers, hence its smaller tiles
# and 8 warps. To be refined by measurement on the GPU (bench/test_bench_triton.py).
_TABLE: dict[tuple[str, int, int], LaunchConfig] = {
    ("decode", 16, 2): LaunchConfig(64, 16, 4, 3),
    ("decode", 32, 2): LaunchConfig(64, 16, 4, 3),
    ("decode", 64, 2): LaunchConfig(64, 16, 4, 3),
    ("decode", 128, 2): LaunchConfig(64, 16, 4, 3),
    ("decode", 256, 2): LaunchConfig(32, 16, 4, 3),
    ("decode", 16, 4): LaunchConfig(64, 16, 4, 2),
    ("decode", 32, 4): LaunchConfig(64, 16, 4, 2),
    ("decode", 64, 4): LaunchConfig(64, 16, 4, 2),
    ("decode", 128, 4): LaunchConfig(16, 16, 8, 2),
    ("decode", 256, 4): LaunchConfig(16, 16, 4, 2),
    ("varlen", 16, 2): LaunchConfig(64, 64, 4, 2),
    ("varlen", 32, 2): LaunchConfig(64, 64, 4, 2),
    ("varlen", 64, 2): LaunchConfig(64, 64, 4, 2),
    ("varlen", 128, 2): LaunchConfig(64, 64, 4, 2),
    ("varlen", 256, 2): LaunchConfig(32, 64, 8, 2),
    ("varlen", 16, 4): LaunchConfig(32, 32, 8, 2),
    ("varlen", 32, 4): LaunchConfig(32, 32, 8, 2),
    ("varlen", 64, 4): LaunchConfig(32, 32, 8, 2),
    ("varlen", 128, 4): LaunchConfig(16, 32, 8, 2),
    ("varlen", 256, 4): LaunchConfig(16, 32, 8, 1),
}

# Exact (mode, head_size, block_size, dtype) entries that beat the table, once measured on a GPU;
# change through `set_override` (which clears the lookup cache).
_OVERRIDES: dict[tuple[str, int, int, torch.dtype], LaunchConfig] = {}


def set_override(mode: Mode, head_size: int, block_size: int, dtype: torch.dtype,
                 config: Optional[LaunchConfig]) -> None:
    """Records `config` as the measured best for exactly this key (None removes the record)."""
    key = (mode, head_size, block_size, dtype)
    if config is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = config
    launch_config.cache_clear()


@functools.lru_cache(maxsize=256)
def launch_config(mode: Mode, head_size: int, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: Optional[torch.dtype] = None) -> LaunchConfig:
    """The configuration for a kernel launch; ValueError for a mode or head size outside the table.
    `kv_cache_dtype`: the cache's dtype when it differs from the query's `dtype` (8-bit): a
    float32 launch over one runs a single stage (two spill on sm_90: 216 bytes in the varlen
    kernel at head size 128, 3120 in the decode kernel at 256; tests/test_triton_compile.py).
    Cached: it runs on the host before every launch."""
    config = _lookup(mode, head_size, block_size, dtype)
    if dtype == torch.float32 and kv_cache_dtype not in (None, dtype):
        config = dataclasses.replace(config, num_stages=1)
    return config


def _lookup(mode: Mode, head_size: int, block_size: int, dtype: torch.dtype) -> LaunchConfig:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    exact = _OVERRIDES.get((mode, head_size, block_size, dtype))
    if exact is not None:
        return exact
    key = (mode, padded_head_size(head_size), dtype.itemsize)
    if key not in _TABLE:
        raise ValueError(f"head_size: expected at most 256 with dtype float16/bfloat16/float32, "
                         f"got head_size={head_size} with {dtype}")
    return _TABLE[key]
