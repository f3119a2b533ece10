"""The CUDA planner's forcible settings: the environment variables a timing run or a test sets to
force one of the planner's choices, their accepted values and their defaults.

`SETTINGS` is the one place a default changes when a GPU run's verdict says so
(`tune_verdict.py`, beside this module, names the variant; its settings are these names). The
planner (planner.py) reads every choice through the readers below, at plan time, so a variant
applies to the launches made while its variable is set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Forces the decode partition size (a multiple of 16 >= 16), for tests of the split-K path.
PARTITION_ENV = "PAGED_KERNELS_CUDA_PARTITION"
#: Forces the depth of the mma decode kernel's K/V ring (2 to 4 tiles; fewer where the planner's
#: shared-memory limit would be exceeded), for timing runs.
STAGES_ENV = "PAGED_KERNELS_CUDA_DECODE_STAGES"
#: Forces the mma decode kernel's tile: 64 keys (4 warps, the default) or 32 (2 warps, half the
#: shared memory, so twice the blocks per SM), for timing runs.
DECODE_TILE_ENV = "PAGED_KERNELS_CUDA_DECODE_TILE"
#: Warps of the 16-bit varlen kernel: 4 (64 query rows per block, the default) or 8 (128 rows:
#: each K/V tile serves twice the rows), for timing runs.
VARLEN_WARPS_ENV = "PAGED_KERNELS_CUDA_VARLEN_WARPS"
#: How the mma decode kernel's warps wait for a K/V tile: "block" (the block copies each tile
#: together and meets at __syncthreads, the default) or "warp" (each warp copies and waits for
#: its own 16 keys alone: no block barrier in the key loop), for timing runs.
DECODE_SYNC_ENV = "PAGED_KERNELS_CUDA_DECODE_SYNC"
#: "1": the mma decode kernel asks each K/V row into L2 an iteration before it copies it (about
#: one more tile in flight per block, no shared memory); "0" (the default): no prefetch.
DECODE_PREFETCH_ENV = "PAGED_KERNELS_CUDA_DECODE_PREFETCH"
#: Every environment variable the planner reads (timing runs set them per variant).
PLAN_ENVS = (PARTITION_ENV, STAGES_ENV, DECODE_TILE_ENV, DECODE_SYNC_ENV, DECODE_PREFETCH_ENV,
             VARLEN_WARPS_ENV)


@dataclass(frozen=True)
class PlanSetting:
    """A choice of the planner that the environment can force: the environment variable, its
    accepted values (as written there) and the default."""

    env: str
    values: tuple[str, ...]
    default: str


#: The planner's settings and their defaults. Measured so far (docs/cuda.md): 2 stages (3 blocks
#: per SM at head size 128) beat 3 and 4; the 32-key tile, warp synchronisation, the L2 prefetch
#: and 8 varlen warps are not yet timed.
SETTINGS: dict[str, PlanSetting] = {s.env: s for s in (
    PlanSetting(STAGES_ENV, ("2", "3", "4"), "2"),
    PlanSetting(DECODE_TILE_ENV, ("64", "32"), "64"),
    PlanSetting(DECODE_SYNC_ENV, ("block", "warp"), "block"),
    PlanSetting(DECODE_PREFETCH_ENV, ("0", "1"), "0"),
    PlanSetting(VARLEN_WARPS_ENV, ("4", "8"), "4"),
)}


def setting(name: str, env: Mapping[str, str] = os.environ) -> str:
    """Planner setting `name`: the environment's value when set (checked), else its default.
    Raises ValueError naming the variable, the accepted values and the value given."""
    s = SETTINGS[name]
    value = env.get(name) or s.default
    if value not in s.values:
        shown = [v if v.isdigit() else repr(v) for v in s.values]
        raise ValueError(f"{name}: expected {', '.join(shown[:-1])} or {shown[-1]}, got "
                         f"{value!r}")
    return value


def mma_decode_stages(env: Mapping[str, str] = os.environ) -> int:
    """Depth of the mma decode kernel's K/V ring (`$PAGED_KERNELS_CUDA_DECODE_STAGES`): 2 by
    default (measured on an H200 at head size 128: 2 stages, 3 blocks per SM, gave 83 % of copy
    bandwidth; 3 stages, 2 blocks, 66 %; 4 stages, 1 block, 39 %)."""
    return int(setting(STAGES_ENV, env))


def mma_decode_tile(env: Mapping[str, str] = os.environ) -> int:
    """Keys per tile of the mma decode kernel, 16 per warp (`$PAGED_KERNELS_CUDA_DECODE_TILE`)."""
    return int(setting(DECODE_TILE_ENV, env))


def mma_decode_warp_sync(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the mma decode kernel's warps wait for their own keys alone (pk_decode_mma.cuh,
    "Synchronisation"; `$PAGED_KERNELS_CUDA_DECODE_SYNC`)."""
    return setting(DECODE_SYNC_ENV, env) == "warp"


def mma_decode_l2_prefetch(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the mma decode kernel prefetches each K/V row into L2 an iteration ahead
    (`$PAGED_KERNELS_CUDA_DECODE_PREFETCH`)."""
    return setting(DECODE_PREFETCH_ENV, env) == "1"


def varlen_warps(env: Mapping[str, str] = os.environ) -> int:
    """Warps of the 16-bit varlen kernel (`$PAGED_KERNELS_CUDA_VARLEN_WARPS`)."""
    return int(setting(VARLEN_WARPS_ENV, env))


def forced_partition(env: Mapping[str, str] = os.environ) -> int | None:
    """The decode partition size `$PAGED_KERNELS_CUDA_PARTITION` forces, None when unset.
    Raises ValueError unless it is a multiple of 16 >= 16."""
    forced = env.get(PARTITION_ENV)
    if not forced:
        return None
    if not forced.isdigit() or int(forced) < 16 or int(forced) % 16:
        raise ValueError(f"{PARTITION_ENV}: expected a multiple of 16 >= 16, got {forced!r}")
    return int(forced)


def check_plan_env(settings: Mapping[str, str]) -> None:
    """Raises ValueError if `settings` has a PAGED_KERNELS_CUDA_* name the planner does not read
    or a value it would refuse (so a timing run fails before it times a misspelt variant)."""
    for name in settings:
        if name.startswith("PAGED_KERNELS_CUDA_") and name not in PLAN_ENVS:
            raise ValueError(f"{name}: not a setting of the CUDA planner; expected one of "
                             f"{PLAN_ENVS}")
    for name in SETTINGS:
        setting(name, settings)
    forced_partition(settings)
