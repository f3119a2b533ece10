"""The conformance matrix: which configurations every backend is checked on.

One definition, read by the conformance suite (tests/test_conformance.py), which runs it, and by
tools/support_matrix.py, which counts what each backend's declared `Support` runs of it
(docs/support-matrix.md).

A `Config` is one point of dtype x head size x block size x GQA ratio x batch composition x
features x KV cache dtype (with, for an 8-bit cache, the scale form). `fast_matrix()` varies one
axis at a time around a core point (the CI selection); `exhaustive_matrix()` crosses every axis
(behind `pytest --exhaustive`). Batch compositions are expressed relative to the block size, so
edge lengths (1, block_size, block_size + 1, many blocks) land on block boundaries whatever the
block size.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256, 40)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
#: (num_heads, num_kv_heads): GQA ratios 1, 2, 3, 4, 8 and MQA.
HEAD_LAYOUTS = ((4, 4), (8, 4), (6, 2), (8, 2), (8, 1), (16, 2))
FEATURE_SETS: tuple[tuple[str, ...], ...] = (
    (), ("sliding_window",), ("soft_cap",), ("alibi",), ("lse",), ("strided",),
    ("shared_prefix",), ("sliding_window", "soft_cap", "alibi", "lse", "strided"),
)
BATCHES = ("decode", "prefill", "chunked", "mixed")
#: 8-bit cache dtypes (paged_kernels.kv_quant); None in a Config is a cache of the query's dtype.
KV_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
#: How an 8-bit cache's scales are given: one float per tensor, or a tensor per KV head.
SCALE_FORMS = ("per_tensor", "per_head")


@dataclass(frozen=True)
class Config:
    """One point of the matrix."""

    dtype: torch.dtype = torch.float16
    head_size: int = 64
    block_size: int = 16
    heads: tuple[int, int] = (8, 2)
    batch: str = "mixed"
    features: tuple[str, ...] = field(default=())
    kv_cache_dtype: Optional[torch.dtype] = None
    scale_form: str = "per_head"

    @property
    def id(self) -> str:
        feats = "+".join(self.features) or "plain"
        name = (f"{str(self.dtype).replace('torch.', '')}-d{self.head_size}-b{self.block_size}-"
                f"h{self.heads[0]}kv{self.heads[1]}-{self.batch}-{feats}")
        if self.kv_cache_dtype is not None:
            name += f"-kv_{str(self.kv_cache_dtype).replace('torch.', '')}-{self.scale_form}"
        return name

    def api_features(self) -> frozenset[str]:
        """The ABI feature names (paged_kernels.abi.FEATURES) this config exercises."""
        names = {f for f in self.features if f != "shared_prefix"}
        if self.batch != "decode":
            names.add("varlen")
        return frozenset(names)


def batch_lengths(batch: str, block_size: int) -> tuple[list[int], Optional[list[int]]]:
    """(seq_lens, q_lens) of a batch composition; q_lens None means decode."""
    b = block_size
    if batch == "decode":
        return [1, b, b + 1, 3 * b + 5, 70], None
    if batch == "prefill":
        return [b + 1, 1, 2 * b + 3], [b + 1, 1, 2 * b + 3]
    if batch == "chunked":  # a chunk of new tokens on top of a cached prefix
        return [2 * b + 9, b + 2], [9, 2]
    if batch == "mixed":  # a full prefill, a chunked prefill, two decodes, a 3-token verify
        return [b + 3, 2 * b + 7, 1, b + 1, 40], [b + 3, 5, 1, 1, 3]
    raise ValueError(f"batch: expected one of {BATCHES}, got {batch!r}")


#: The shape the benchmarks' targets are stated at (bf16, head size 128, 32 query heads over 8 KV
#: heads, block size 16), as a decode batch: its GQA group fills the 16 rows of the tensor-core
#: decode kernels twice over, which no other point of the fast matrix does.
HEADLINE_DECODE = Config(torch.bfloat16, 128, 16, (32, 8), "decode")


def fast_matrix() -> list[Config]:
    """One axis at a time around the core point (CI)."""
    core = Config()
    configs = [replace(core, dtype=d, batch=b) for d in DTYPES for b in BATCHES]
    configs += [replace(core, dtype=torch.bfloat16, head_size=h) for h in HEAD_SIZES if h != 64]
    configs += [replace(core, block_size=b) for b in BLOCK_SIZES if b != 16]
    configs += [replace(core, heads=h) for h in HEAD_LAYOUTS if h != core.heads]
    configs += [replace(core, dtype=torch.float32, features=f) for f in FEATURE_SETS if f]
    # every feature at once on the 16-bit (tensor-core) paths: decode, and a mixed batch (varlen)
    configs += [replace(core, dtype=torch.bfloat16, batch=b, features=FEATURE_SETS[-1])
                for b in ("decode", "mixed")]
    configs += [HEADLINE_DECODE]
    # the 8-bit cache axis: each dtype with each scale form (a decode and a mixed batch), one
    # float32-query point, and every feature at once (strided caches included)
    configs += [replace(core, kv_cache_dtype=kv, scale_form=form, batch=batch)
                for kv in KV_CACHE_DTYPES
                for form, batch in zip(SCALE_FORMS, ("decode", "mixed"))]
    configs += [replace(core, dtype=torch.float32, batch="chunked", kv_cache_dtype=torch.int8),
                replace(core, dtype=torch.bfloat16, batch="mixed", features=FEATURE_SETS[-1],
                        kv_cache_dtype=torch.float8_e4m3fn)]
    return configs


def exhaustive_matrix() -> Iterator[Config]:
    """Every axis crossed with every other; the 8-bit cache dtypes (per-head scales) with no
    feature and with every feature at once."""
    for d, h, b, hl, bt, f in itertools.product(DTYPES, HEAD_SIZES, BLOCK_SIZES, HEAD_LAYOUTS,
                                                BATCHES, FEATURE_SETS):
        yield Config(d, h, b, hl, bt, f)
    for d, h, b, hl, bt, f, kv in itertools.product(DTYPES, HEAD_SIZES, BLOCK_SIZES,
                                                    HEAD_LAYOUTS, BATCHES,
                                                    (FEATURE_SETS[0], FEATURE_SETS[-1]),
                                                    KV_CACHE_DTYPES):
        yield Config(d, h, b, hl, bt, f, kv)


def tolerance(dtype: torch.dtype) -> float:
    """Relative (norm) error allowed against the float64 oracle (docs/abi.md), by query dtype.
    The same for an 8-bit cache: the oracle reads the dequantised cache, exact inputs, so only
    the computation's rounding remains."""
    return 1e-5 if dtype == torch.float32 else 1e-2
