"""The one place the block-table ABI is checked (see docs/abi.md).

Every argument check of the public API lives here, and each path runs the same functions:
- `paged_attention`: `check_attention_args` is `check_layer_tensors` (query and caches),
  `check_metadata` (block tables, lengths, query layout), `check_decode_tokens`, `check_scalars`,
  `check_alibi_slopes` and `check_out`; it returns an `AttentionProblem`. `plan()` runs the
  metadata checks once (with `check_plan_layout` and `check_plan_tokens` for what only a plan
  has); each `AttentionPlan.run` runs `PlannedLayer.check_run`, which runs the layer checks.
- `write_kv`: `check_write_kv_args` is `check_kv_tensors`, `check_slot_mapping` and
  `check_kv_scales`; a plan checks the slots and scales once and runs
  `PlannedLayer.check_write` (`check_kv_tensors`) per layer.
- The scales of an 8-bit cache (`k_scale`, `v_scale`) go through `check_kv_scales` on every
  path (one-shot and plan), which normalises them to float32 `[num_kv_heads]` tensors.
- `copy_blocks`, `swap_blocks`, `merge_attn_states` and the custom operators' `lse` have theirs.
These run on the host without synchronising with the device. The content checks
(`check_metadata_contents`, `check_slot_contents`, `check_block_ids`, and
`check_scale_contents` for scale tensors off the CPU) read values, so they synchronise; they run
always in the reference backend and on request for the fast ones.

Backends receive only arguments that passed these checks, and declare what they support with a
`Support`; `Support.check` raises `NotImplementedError` for anything outside it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from paged_kernels.kv_quant import QUANTIZED_CACHE_DTYPES

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Names of the optional features a problem may use; backends declare the subset they support.
FEATURES = ("varlen", "sliding_window", "soft_cap", "alibi", "lse", "strided")

CHECK_ENV = "PAGED_KERNELS_CHECK"

_STRIDED = frozenset({"strided"})


def _fail(kind: type, arg: str, expected: str, given: object) -> None:
    raise kind(f"{arg}: expected {expected}, got {given}")


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return "(" + ", ".join(str(d) for d in dtypes) + ")"


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def _require_tensor(arg: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, arg, "a torch.Tensor", type(t).__name__)
    return t  # type: ignore[return-value]


def _require_dtype(arg: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        _fail(TypeError, arg, f"dtype {names}", _describe(t))


def _require_ndim(arg: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        _fail(ValueError, arg, f"a {ndim}-D tensor {layout}", _describe(t))


def _require_device(arg: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        _fail(ValueError, arg, f"a tensor on {device} (the query's device)", _describe(t))


def require_int_tensor(
    arg: str, t: object, dtype: torch.dtype, shape: tuple[Optional[int], ...], device: torch.device
) -> torch.Tensor:
    """Checks an index tensor: exact integer dtype, rank, sizes (None = any) and device."""
    t = _require_tensor(arg, t)
    if t.dtype != dtype:
        _fail(TypeError, arg, f"dtype {dtype}", _describe(t))
    dims = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        _fail(ValueError, arg, f"shape {dims}", _describe(t))
    _require_device(arg, t, device)
    return t


@dataclass(frozen=True)
class AttentionProblem:
    """A checked `paged_attention` call. Tensors are the caller's own (no copies).

    Invariants established by `check_attention_args`:
    - `query` is `[num_tokens, num_heads, head_size]` with a contiguous last dimension.
    - `key_cache`/`value_cache` are `[num_blocks, num_kv_heads, block_size, head_size]`, the last
      dimension contiguous, other strides arbitrary; on `query`'s device; both of `query`'s dtype
      (a float cache) or both of one 8-bit dtype of `QUANTIZED_CACHE_DTYPES`.
    - `block_tables` int32 `[num_seqs, max_blocks_per_seq]`, `seq_lens` int32 `[num_seqs]`,
      `cu_seqlens_q` int32 `[num_seqs + 1]` or None (decode: `num_tokens == num_seqs`).
    - `out` has `query`'s shape and dtype; `lse` is float32 `[num_tokens, num_heads]` or None.
    - `alibi_slopes` is float32 `[num_heads]` or None. `scale` is resolved to a float.
    - `k_scale`/`v_scale`: for an 8-bit cache, contiguous float32 `[num_kv_heads]` tensors on the
      cache's device (a per-tensor scale broadcast); None for a float cache. Entry `h` scales KV
      head `h`: the cache holds `q` and attention reads `float32(q) * scale[h]`.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor]
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    scale: float
    sliding_window: Optional[int] = None
    soft_cap: Optional[float] = None
    alibi_slopes: Optional[torch.Tensor] = None
    features: frozenset[str] = field(default_factory=frozenset)
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def head_size(self) -> int:
        return self.query.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[1]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[2]

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_decode(self) -> bool:
        """True when every sequence has exactly one query token (`cu_seqlens_q` is None)."""
        return self.cu_seqlens_q is None

    def query_start_loc(self) -> torch.Tensor:
        """`cu_seqlens_q`, or `arange(num_seqs + 1)` for decode."""
        if self.cu_seqlens_q is not None:
            return self.cu_seqlens_q
        return torch.arange(self.num_seqs + 1, dtype=torch.int32, device=self.query.device)


@dataclass(frozen=True)
class Support:
    """What one backend supports. `None` for `head_sizes`/`block_sizes` means any size within
    `max_head_size`/`max_block_size`; `reasons` explains each limit for the support table.
    `kv_cache_dtypes` lists the 8-bit cache dtypes (`QUANTIZED_CACHE_DTYPES`) supported besides
    the float caches of the query's dtype, which every backend supports."""

    dtypes: frozenset[torch.dtype]
    device_types: frozenset[str]
    features: frozenset[str]
    head_sizes: Optional[frozenset[int]] = None
    max_head_size: Optional[int] = None
    block_sizes: Optional[frozenset[int]] = None
    max_block_size: Optional[int] = None
    reasons: tuple[tuple[str, str], ...] = ()
    kv_cache_dtypes: frozenset[torch.dtype] = frozenset()

    def unsupported(
        self, dtype: torch.dtype, head_size: int, block_size: int, features: frozenset[str],
        device_type: str, kv_cache_dtype: Optional[torch.dtype] = None,
    ) -> Optional[str]:
        """Returns why this configuration is unsupported, or None when it is supported.
        `kv_cache_dtype` None means a cache of the query's `dtype`."""
        if device_type not in self.device_types:
            return f"device type {device_type!r} (supports {sorted(self.device_types)})"
        if dtype not in self.dtypes:
            return f"dtype {dtype} (supports {sorted(str(d) for d in self.dtypes)})"
        why = self.unsupported_kv_cache(kv_cache_dtype, dtype)
        if why is not None:
            return why
        if self.head_sizes is not None and head_size not in self.head_sizes:
            return f"head_size {head_size} (supports {sorted(self.head_sizes)})"
        if self.max_head_size is not None and head_size > self.max_head_size:
            return f"head_size {head_size} (supports up to {self.max_head_size})"
        if self.block_sizes is not None and block_size not in self.block_sizes:
            return f"block_size {block_size} (supports {sorted(self.block_sizes)})"
        if self.max_block_size is not None and block_size > self.max_block_size:
            return f"block_size {block_size} (supports up to {self.max_block_size})"
        missing = sorted(features - self.features)
        if missing:
            return f"feature(s) {', '.join(missing)}"
        return None

    def unsupported_kv_cache(self, kv_cache_dtype: Optional[torch.dtype],
                             dtype: torch.dtype) -> Optional[str]:
        """Why a cache of `kv_cache_dtype` (None: `dtype`, the K/V rows' and query's dtype) is
        unsupported, or None."""
        if kv_cache_dtype is None or kv_cache_dtype == dtype \
                or kv_cache_dtype in self.kv_cache_dtypes:
            return None
        listed = sorted(str(d) for d in self.kv_cache_dtypes) or "none"
        return f"KV cache dtype {kv_cache_dtype} (8-bit cache dtypes supported: {listed})"

    def check(self, backend: str, problem: AttentionProblem) -> None:
        """Raises NotImplementedError naming `backend` and the first unsupported property."""
        self.check_config(backend, problem.query.dtype, problem.head_size, problem.block_size,
                          problem.features, problem.query.device.type,
                          problem.key_cache.dtype)

    def check_config(self, backend: str, dtype: torch.dtype, head_size: int, block_size: int,
                     features: frozenset[str], device_type: str,
                     kv_cache_dtype: Optional[torch.dtype] = None) -> None:
        """`check` for a configuration given by its properties (what a plan knows)."""
        why = self.unsupported(dtype, head_size, block_size, features, device_type,
                               kv_cache_dtype)
        if why is not None:
            raise NotImplementedError(f"backend {backend!r} does not support {why}")

    def check_kv_cache(self, backend: str, kv_cache_dtype: torch.dtype,
                       dtype: torch.dtype) -> None:
        """`write_kv`'s check: NotImplementedError naming `backend` and the cache dtype when
        an 8-bit `kv_cache_dtype` is not listed in `kv_cache_dtypes`."""
        why = self.unsupported_kv_cache(kv_cache_dtype, dtype)
        if why is not None:
            raise NotImplementedError(f"backend {backend!r} does not support {why}")


# --- paged_attention: one layer's tensors ------------------------------------------------------

def _check_cache(arg: str, cache: object, query: torch.Tensor) -> torch.Tensor:
    cache = _require_tensor(arg, cache)
    _require_ndim(arg, cache, 4, "[num_blocks, num_kv_heads, block_size, head_size]")
    if cache.dtype != query.dtype and cache.dtype not in QUANTIZED_CACHE_DTYPES:
        _fail(TypeError, arg, f"dtype {query.dtype} (the query's dtype) or an 8-bit cache dtype "
              f"{_names(QUANTIZED_CACHE_DTYPES)}", _describe(cache))
    _require_device(arg, cache, query.device)
    if cache.shape[3] != query.shape[2]:
        _fail(ValueError, arg, f"head_size {query.shape[2]} (the query's) in dim 3",
              _describe(cache))
    if cache.stride(3) != 1:
        _fail(ValueError, arg, "a contiguous last dimension (stride 1)",
              f"strides {tuple(cache.stride())}")
    return cache


def _check_query(query: object) -> torch.Tensor:
    query = _require_tensor("query", query)
    _require_ndim("query", query, 3, "[num_tokens, num_heads, head_size]")
    _require_dtype("query", query, FLOAT_DTYPES)
    if query.stride(2) != 1:
        _fail(ValueError, "query", "a contiguous last dimension (stride 1)",
              f"strides {tuple(query.stride())}")
    return query


def check_layer_tensors(query: object, key_cache: object, value_cache: object
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks `paged_attention`'s `query` (`[num_tokens, num_heads, head_size]`, float, last
    dimension contiguous) and caches (`[num_blocks, num_kv_heads, block_size, head_size]`, the
    query's dtype or both of one 8-bit dtype, the query's device and head size, last dimension
    contiguous, equal shapes, `num_kv_heads` dividing `num_heads`); returns `(query, key_cache,
    value_cache)`."""
    q = _check_query(query)
    k = _check_cache("key_cache", key_cache, q)
    v = _check_cache("value_cache", value_cache, q)
    _check_same_cache_dtype(k, v)
    if v.shape != k.shape:
        _fail(ValueError, "value_cache", f"the key_cache's shape {tuple(k.shape)}", _describe(v))
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        _fail(ValueError, "key_cache", f"num_kv_heads dividing num_heads={num_heads}",
              f"num_kv_heads={num_kv_heads}")
    return q, k, v


def _check_same_cache_dtype(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """K and V caches share one storage dtype (an 8-bit key cache with a float value cache, or
    two 8-bit types, is refused)."""
    if value_cache.dtype != key_cache.dtype:
        _fail(ValueError, "value_cache", f"dtype {key_cache.dtype} (the key_cache's)",
              _describe(value_cache))


# --- the scales of an 8-bit cache ---------------------------------------------------------------

def _scale_tensor(arg: str, scale: object, num_kv_heads: int,
                  device: torch.device) -> torch.Tensor:
    """One scale argument as a float32 `[num_kv_heads]` tensor on `device` (host checks only)."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        as_f32 = float(torch.tensor(float(scale), dtype=torch.float32))  # what the kernels read
        if not math.isfinite(as_f32) or as_f32 <= 0:
            _fail(ValueError, arg, "a finite scale > 0 (as a float32)", repr(scale))
        return torch.full((num_kv_heads,), as_f32, dtype=torch.float32, device=device)
    if not isinstance(scale, torch.Tensor):
        _fail(TypeError, arg, "a float or a float32 tensor", type(scale).__name__)
    t: torch.Tensor = scale  # type: ignore[assignment]
    if t.dtype != torch.float32 or t.dim() > 1 or t.numel() not in (1, num_kv_heads) \
            or t.device != device:
        _fail(ValueError, arg, f"a float, or a float32 tensor of shape (1,) (per tensor) or "
              f"({num_kv_heads},) (per KV head) on {device} (the cache's device)", _describe(t))
    if t.numel() != num_kv_heads or t.dim() == 0:
        return t.reshape(1).expand(num_kv_heads).contiguous()
    return t.contiguous()


def check_kv_scales(k_scale: object, v_scale: object, cache_dtype: torch.dtype,
                    num_kv_heads: int, device: torch.device
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """`k_scale`/`v_scale` for a cache of `cache_dtype`: required with an 8-bit cache (a
    float > 0 and finite, or a float32 tensor `[1]` or `[num_kv_heads]` on `device`), refused
    with a float cache (TypeError). Returns them as contiguous float32 `[num_kv_heads]` tensors
    (a tensor `[num_kv_heads]` is the caller's own, not a copy), or `(None, None)`. Host checks
    only: the values of tensors are `check_scale_contents`'."""
    scales = (("k_scale", k_scale), ("v_scale", v_scale))
    if cache_dtype not in QUANTIZED_CACHE_DTYPES:
        for arg, scale in scales:
            if scale is not None:
                _fail(TypeError, arg, f"None with a {cache_dtype} cache (scales are for the 8-bit "
                      f"caches {_names(QUANTIZED_CACHE_DTYPES)})", _describe_value(scale))
        return None, None
    for arg, scale in scales:
        if scale is None:
            _fail(TypeError, arg, f"a scale (float or float32 tensor) with a {cache_dtype} cache",
                  None)
    k = _scale_tensor("k_scale", k_scale, num_kv_heads, device)
    v = _scale_tensor("v_scale", v_scale, num_kv_heads, device)
    return k, v


def _describe_value(value: object) -> str:
    return _describe(value) if isinstance(value, torch.Tensor) else repr(value)


def check_scale_contents(k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
    """The content check of normalised scales (synchronises off the CPU): every entry finite
    and > 0. Runs always for CPU tensors, else with the other content checks."""
    for arg, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            continue
        values = t.tolist()  # one read of a few floats: cheaper than tensor ops on the CPU
        if not all(0.0 < v < math.inf for v in values):  # NaN compares False
            _fail(ValueError, arg, "finite scales > 0", values)


def check_scales_now(k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                     contents: bool) -> None:
    """`check_scale_contents` when `contents` (content checks requested) or when the scales
    are on the CPU, where reading them costs no device synchronisation."""
    if k_scale is not None and (contents or k_scale.device.type == "cpu"):
        check_scale_contents(k_scale, v_scale)


def check_out(out: object, query: torch.Tensor) -> torch.Tensor:
    """`out` checked against a checked `query` (same shape, dtype and device, last dimension
    contiguous), or a new contiguous tensor like `query` when `out` is None."""
    if out is None:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    out = _require_tensor("out", out)
    if out.shape != query.shape or out.dtype != query.dtype:
        _fail(ValueError, "out", f"a {query.dtype} tensor of shape {tuple(query.shape)}",
              _describe(out))
    _require_device("out", out, query.device)
    if out.stride(2) != 1:
        _fail(ValueError, "out", "a contiguous last dimension", f"strides {tuple(out.stride())}")
    return out


def check_lse(lse: Optional[torch.Tensor], query: torch.Tensor) -> None:
    """A caller-given `lse` (custom operators): None, or float32 `[num_tokens, num_heads]` on
    the query's device."""
    if lse is None:
        return
    shape = tuple(query.shape[:2])
    if lse.dtype != torch.float32 or tuple(lse.shape) != shape or lse.device != query.device:
        _fail(ValueError, "lse", f"a float32 tensor of shape {shape} on {query.device}",
              _describe(lse))


# --- paged_attention: one step's metadata ------------------------------------------------------

def check_metadata(block_tables: object, seq_lens: object, cu_seqlens_q: object,
                   device: Optional[torch.device] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Checks `block_tables` (int32 `[num_seqs, max_blocks_per_seq]`), `seq_lens` (int32
    `[num_seqs]`) and `cu_seqlens_q` (None, or int32 `[num_seqs + 1]`), all on `device`
    (default: `block_tables`' device); returns them."""
    if device is None:
        device = _require_tensor("block_tables", block_tables).device
    bt = require_int_tensor("block_tables", block_tables, torch.int32, (None, None), device)
    num_seqs = bt.shape[0]
    sl = require_int_tensor("seq_lens", seq_lens, torch.int32, (num_seqs,), device)
    cu = None
    if cu_seqlens_q is not None:
        cu = require_int_tensor("cu_seqlens_q", cu_seqlens_q, torch.int32, (num_seqs + 1,),
                                device)
    return bt, sl, cu


def check_decode_tokens(num_tokens: int, num_seqs: int, decode: bool) -> None:
    """A decode step (`cu_seqlens_q` None) has one query token per sequence."""
    if decode and num_tokens != num_seqs:
        _fail(ValueError, "query", f"num_tokens == num_seqs={num_seqs} when cu_seqlens_q is None "
              "(decode)", f"num_tokens={num_tokens}")


def check_alibi_slopes(alibi_slopes: Optional[torch.Tensor], num_heads: int,
                       device: torch.device) -> Optional[torch.Tensor]:
    """`alibi_slopes` (None, or a float32 tensor `[num_heads]` on `device`), checked."""
    if alibi_slopes is None:
        return None
    slopes = _require_tensor("alibi_slopes", alibi_slopes)
    if slopes.dtype != torch.float32 or tuple(slopes.shape) != (num_heads,):
        _fail(ValueError, "alibi_slopes", f"a float32 tensor of shape ({num_heads},)",
              _describe(slopes))
    _require_device("alibi_slopes", slopes, device)
    return slopes


def check_scalars(
    head_size: int, scale: Optional[float], sliding_window: Optional[int],
    soft_cap: Optional[float],
) -> float:
    """Checks `scale` (finite, > 0), `sliding_window` (None or an int >= 1) and `soft_cap`
    (None, or finite and > 0); returns `scale`, defaulting to `1 / sqrt(head_size)`."""
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        _fail(ValueError, "scale", "a finite float > 0", repr(scale))
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        _fail(ValueError, "sliding_window", "None or an int >= 1", repr(sliding_window))
    if soft_cap is not None and (
        not isinstance(soft_cap, (int, float)) or not math.isfinite(soft_cap) or soft_cap <= 0
    ):
        _fail(ValueError, "soft_cap", "None or a finite float > 0", repr(soft_cap))
    return float(scale)


def requested_features(cu_seqlens_q: Optional[torch.Tensor], sliding_window: Optional[int],
                       soft_cap: Optional[float], alibi_slopes: Optional[torch.Tensor],
                       return_lse: bool) -> frozenset[str]:
    """The FEATURES a call asks for by its arguments ("strided" depends on each layer's caches)."""
    used = (("varlen", cu_seqlens_q is not None), ("sliding_window", sliding_window is not None),
            ("soft_cap", soft_cap is not None), ("alibi", alibi_slopes is not None),
            ("lse", bool(return_lse)))
    return frozenset(name for name, on in used if on)


def strided_features(features: frozenset[str], key_cache: torch.Tensor,
                     value_cache: torch.Tensor) -> frozenset[str]:
    """`features`, plus "strided" when a cache is not contiguous."""
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        return features
    return features | _STRIDED


def check_attention_args(
    query: object, key_cache: object, value_cache: object, block_tables: object,
    seq_lens: object, *, cu_seqlens_q: object = None, scale: Optional[float] = None,
    sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
    alibi_slopes: object = None, out: Optional[torch.Tensor] = None, return_lse: bool = False,
    k_scale: object = None, v_scale: object = None,
) -> AttentionProblem:
    """Checks every argument of `paged_attention` on the host; returns the checked problem
    (the values of scale tensors are left to `check_scales_now`).

    Raises TypeError (wrong type or dtype) or ValueError (wrong shape, device, stride or value),
    with a message naming the argument, what was expected and what was given.
    """
    q, k, v = check_layer_tensors(query, key_cache, value_cache)
    num_tokens, num_heads, head_size = q.shape
    bt, sl, cu = check_metadata(block_tables, seq_lens, cu_seqlens_q, q.device)
    check_decode_tokens(num_tokens, bt.shape[0], cu is None)
    resolved_scale = check_scalars(head_size, scale, sliding_window, soft_cap)
    slopes = check_alibi_slopes(alibi_slopes, num_heads, q.device)
    ks, vs = check_kv_scales(k_scale, v_scale, k.dtype, k.shape[1], k.device)
    o = check_out(out, q)
    lse = None
    if return_lse:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    features = requested_features(cu, sliding_window, soft_cap, slopes, return_lse)
    return AttentionProblem(q, k, v, bt, sl, cu, o, lse, resolved_scale, sliding_window,
                            soft_cap, slopes, strided_features(features, k, v), ks, vs)


# --- plan(): what only a plan has --------------------------------------------------------------

def _require_positive_int(arg: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(ValueError, arg, "an int >= 1", repr(value))
    return value  # type: ignore[return-value]


def check_plan_layout(num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                      num_blocks: int, dtype: torch.dtype,
                      kv_cache_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The sizes a plan is made for: ints >= 1, `num_kv_heads` dividing `num_heads`, a float
    dtype, a cache dtype that is None (`dtype`), `dtype` or 8-bit; returns the cache dtype."""
    for arg, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                       ("head_size", head_size), ("block_size", block_size),
                       ("num_blocks", num_blocks)):
        _require_positive_int(arg, value)
    if num_heads % num_kv_heads:
        _fail(ValueError, "num_kv_heads", f"a divisor of num_heads={num_heads}", num_kv_heads)
    if dtype not in FLOAT_DTYPES:
        _fail(TypeError, "dtype", " or ".join(str(d) for d in FLOAT_DTYPES), dtype)
    if kv_cache_dtype is None:
        return dtype
    if kv_cache_dtype != dtype and kv_cache_dtype not in QUANTIZED_CACHE_DTYPES:
        _fail(TypeError, "kv_cache_dtype", f"None, {dtype} (the dtype) or an 8-bit cache dtype "
              f"{_names(QUANTIZED_CACHE_DTYPES)}", kv_cache_dtype)
    return kv_cache_dtype


def _resolve_num_tokens(num_tokens: Optional[int], num_seqs: int,
                        cu_seqlens_q: Optional[torch.Tensor],
                        slot_mapping: Optional[torch.Tensor]) -> int:
    if num_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            _fail(ValueError, "num_tokens", "None or an int >= 0", repr(num_tokens))
    elif cu_seqlens_q is None:
        num_tokens = num_seqs
    elif slot_mapping is not None:
        num_tokens = slot_mapping.shape[0]
    else:
        num_tokens = int(cu_seqlens_q[-1])
    if cu_seqlens_q is None and num_tokens != num_seqs:
        _fail(ValueError, "num_tokens", f"num_seqs={num_seqs} when cu_seqlens_q is None "
              "(decode)", num_tokens)
    return num_tokens


def check_plan_tokens(num_tokens: Optional[int], num_seqs: int,
                      cu_seqlens_q: Optional[torch.Tensor], slot_mapping: object,
                      device: torch.device) -> tuple[int, Optional[torch.Tensor]]:
    """A plan's `num_tokens` (None, or an int >= 0 that is `num_seqs` in decode) and
    `slot_mapping` (None, or `check_slot_mapping`'s int64 `[num_tokens]`); returns both, the
    number resolved: as given, else num_seqs (decode), the slot_mapping's length, or
    `cu_seqlens_q[-1]` (one read of the tensor)."""
    slots = None
    if slot_mapping is not None:
        slots = require_int_tensor("slot_mapping", slot_mapping, torch.int64, (None,), device)
    tokens = _resolve_num_tokens(num_tokens, num_seqs, cu_seqlens_q, slots)
    if slots is not None:
        check_slot_mapping(slots, tokens, device)
    return tokens, slots


def _matches(t: object, shape: torch.Size, dtype: torch.dtype, device: torch.device,
             contiguous_dim: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype
            and t.device == device and t.stride(contiguous_dim) == 1)


def _check_planned(arg: str, t: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                   device: torch.device, contiguous_dim: Optional[int] = None) -> None:
    if t.dtype != dtype:
        _fail(TypeError, arg, f"dtype {dtype} (the plan's)", _describe(t))
    if t.shape != shape:
        _fail(ValueError, arg, f"shape {tuple(shape)} (from the plan)", _describe(t))
    _require_device(arg, t, device)
    if contiguous_dim is not None and t.stride(contiguous_dim) != 1:
        _fail(ValueError, arg, "a contiguous last dimension (stride 1)",
              f"strides {tuple(t.stride())}")


@dataclass(frozen=True)
class PlannedLayer:
    """What a plan expects of each layer's tensors: its dtype and device, queries
    `query_shape` (`[num_tokens, num_heads, head_size]`), K/V rows `kv_shape` (`[num_tokens,
    num_kv_heads, head_size]`), caches `cache_shape` of `cache_dtype` (None: `dtype`), and
    whether it is a decode step.

    A layer's tensors that equal these by attribute comparison pass the one-shot call's checks
    (the plan's sizes were checked by `check_plan_layout`), so `check_run`/`check_write` accept
    them at once; any others go through the one-shot call's own checks, which raise its errors,
    then through a comparison with the plan that names what differs."""

    dtype: torch.dtype
    device: torch.device
    query_shape: torch.Size
    kv_shape: torch.Size
    cache_shape: torch.Size
    decode: bool
    cache_dtype: Optional[torch.dtype] = None

    @property
    def storage_dtype(self) -> torch.dtype:
        """The caches' dtype: `cache_dtype`, or `dtype` for a float cache."""
        return self.dtype if self.cache_dtype is None else self.cache_dtype

    def check_run(self, query: object, key_cache: object, value_cache: object,
                  out: object) -> torch.Tensor:
        """`AttentionPlan.run`'s checks; returns `out` (allocated when None)."""
        cache = self.storage_dtype
        if not (_matches(query, self.query_shape, self.dtype, self.device, 2)
                and _matches(key_cache, self.cache_shape, cache, self.device, 3)
                and _matches(value_cache, self.cache_shape, cache, self.device, 3)
                and (out is None or _matches(out, self.query_shape, self.dtype, self.device, 2))):
            q, k, _ = check_layer_tensors(query, key_cache, value_cache)
            # in decode the plan's num_tokens is num_seqs (check_plan_tokens)
            check_decode_tokens(q.shape[0], self.query_shape[0], self.decode)
            out = check_out(out, q)
            _check_planned("query", q, self.query_shape, self.dtype, self.device)
            _check_planned("key_cache", k, self.cache_shape, cache, self.device)
        if out is None:
            return torch.empty_like(query, memory_format=torch.contiguous_format)
        return out  # type: ignore[return-value]

    def check_write(self, key: object, value: object, key_cache: object,
                    value_cache: object) -> None:
        """`AttentionPlan.write_kv`'s checks (K/V rows with a contiguous last dimension)."""
        cache = self.storage_dtype
        if not (_matches(key, self.kv_shape, self.dtype, self.device, 2)
                and _matches(value, self.kv_shape, self.dtype, self.device, 2)
                and _matches(key_cache, self.cache_shape, cache, self.device, 3)
                and _matches(value_cache, self.cache_shape, cache, self.device, 3)):
            key, value, k, _ = check_kv_tensors(key, value, key_cache, value_cache)
            for arg, t in (("key", key), ("value", value)):
                _check_planned(arg, t, self.kv_shape, self.dtype, self.device, contiguous_dim=2)
            _check_planned("key_cache", k, self.cache_shape, cache, self.device)


def require_planned_slots(slot_mapping: Optional[torch.Tensor]) -> torch.Tensor:
    """The plan's `slot_mapping`, which `AttentionPlan.write_kv` needs."""
    if slot_mapping is None:
        _fail(ValueError, "slot_mapping", "an int64 tensor given to plan() before "
              "AttentionPlan.write_kv is called", None)
    return slot_mapping  # type: ignore[return-value]


# --- write_kv and the block operations ---------------------------------------------------------

def _check_kv_rows(arg: str, t: object, cache: torch.Tensor) -> torch.Tensor:
    t = _require_tensor(arg, t)
    expected = (cache.shape[1], cache.shape[3])
    dtypes = FLOAT_DTYPES if cache.dtype in QUANTIZED_CACHE_DTYPES else (cache.dtype,)
    if t.dim() != 3 or tuple(t.shape[1:]) != expected or t.dtype not in dtypes:
        kind = "float" if len(dtypes) > 1 else str(cache.dtype)
        _fail(ValueError, arg, f"a {kind} tensor [num_tokens, {expected[0]}, "
              f"{expected[1]}] matching the cache", _describe(t))
    if t.device != cache.device:
        _fail(ValueError, arg, f"a tensor on {cache.device} (the cache's device)", _describe(t))
    return t


def check_cache_pair(key_cache: object, value_cache: object
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's caches for the cache operations: float or 8-bit 4-D `[num_blocks,
    num_kv_heads, block_size, head_size]`, equal shapes, dtypes and devices, last dimension
    contiguous."""
    k = _require_tensor("key_cache", key_cache)
    v = _require_tensor("value_cache", value_cache)
    if k.dim() != 4 or k.dtype not in FLOAT_DTYPES + QUANTIZED_CACHE_DTYPES:
        _fail(ValueError, "key_cache", "a float or 8-bit 4-D tensor [num_blocks, num_kv_heads, "
              "block_size, head_size]", _describe(k))
    _check_same_cache_dtype(k, v)
    if v.shape != k.shape or v.device != k.device:
        _fail(ValueError, "value_cache", f"the key_cache's shape, dtype and device "
              f"({_describe(k)})", _describe(v))
    for arg, t in (("key_cache", k), ("value_cache", v)):
        if t.stride(3) != 1:
            _fail(ValueError, arg, "a contiguous last dimension", f"strides {tuple(t.stride())}")
    return k, v


def check_kv_tensors(key: object, value: object, key_cache: object, value_cache: object
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`write_kv`'s tensors: `check_cache_pair`, and `key`/`value` `[num_tokens, num_kv_heads,
    head_size]` on the caches' device, of equal shapes and dtypes: the caches' dtype for a float
    cache, any float dtype for an 8-bit cache; returns `(key, value, key_cache, value_cache)`."""
    k_cache, v_cache = check_cache_pair(key_cache, value_cache)
    key = _check_kv_rows("key", key, k_cache)
    value = _check_kv_rows("value", value, k_cache)
    if value.shape != key.shape or value.dtype != key.dtype:
        _fail(ValueError, "value", f"the key's shape {tuple(key.shape)} and dtype {key.dtype}",
              _describe(value))
    return key, value, k_cache, v_cache


def check_slot_mapping(slot_mapping: object, num_tokens: int,
                       device: torch.device) -> torch.Tensor:
    """`slot_mapping`: int64 `[num_tokens]` on `device`."""
    return require_int_tensor("slot_mapping", slot_mapping, torch.int64, (num_tokens,), device)


def check_write_kv_args(
    key: object, value: object, key_cache: object, value_cache: object, slot_mapping: object,
    k_scale: object = None, v_scale: object = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
           Optional[torch.Tensor]]:
    """The host-side checks of `write_kv` (shapes, dtypes, devices, strides, `check_kv_scales`);
    returns `(key, value, key_cache, value_cache, k_scale, v_scale)`, the scales normalised.
    Raises TypeError/ValueError naming the argument."""
    key, value, k_cache, v_cache = check_kv_tensors(key, value, key_cache, value_cache)
    check_slot_mapping(slot_mapping, key.shape[0], k_cache.device)
    ks, vs = check_kv_scales(k_scale, v_scale, k_cache.dtype, k_cache.shape[1], k_cache.device)
    return key, value, k_cache, v_cache, ks, vs


def check_block_mapping(block_mapping: object, device: torch.device) -> torch.Tensor:
    """`block_mapping`: int64 `[n, 2]` on `device`."""
    return require_int_tensor("block_mapping", block_mapping, torch.int64, (None, 2), device)


def check_copy_blocks_args(key_caches: Sequence[object], value_caches: Sequence[object],
                           block_mapping: object
                           ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """`copy_blocks`' arguments: one value cache per key cache (at least one), each pair through
    `check_cache_pair`, all on one device with the mapping; returns `(key_caches, value_caches,
    block_mapping)`."""
    if len(key_caches) != len(value_caches) or not key_caches:
        _fail(ValueError, "value_caches", f"{len(key_caches)} caches (one per key cache, >= 1)",
              len(value_caches))
    pairs = [check_cache_pair(k, v) for k, v in zip(key_caches, value_caches)]
    device = pairs[0][0].device
    mapping = check_block_mapping(block_mapping, device)
    for k, _ in pairs:
        if k.device != device:
            _fail(ValueError, "key_caches", f"every cache on {device}", _describe(k))
    return [k for k, _ in pairs], [v for _, v in pairs], mapping


def check_swap_blocks_args(src: object, dst: object, block_mapping: object
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swap_blocks`' arguments: caches of one dtype and per-block shape (any devices), the
    mapping on the CPU; returns `(src, dst, block_mapping)`."""
    src = _require_tensor("src", src)
    dst = _require_tensor("dst", dst)
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        _fail(ValueError, "dst", f"a {src.dtype} cache with per-block shape "
              f"{tuple(src.shape[1:])} (the src's)", _describe(dst))
    return src, dst, check_block_mapping(block_mapping, torch.device("cpu"))


def check_merge_args(out_a: object, lse_a: object, out_b: object, lse_b: object) -> None:
    """`merge_attn_states`' arguments: `out_b` of `out_a`'s shape, `lse_*` float32
    `[num_tokens, num_heads]`."""
    b, la, lb = (_require_tensor(arg, t) for arg, t in
                 (("out_b", out_b), ("lse_a", lse_a), ("lse_b", lse_b)))
    a = _require_tensor("out_a", out_a)
    if b.shape != a.shape:
        _fail(ValueError, "out_b", f"out_a's shape {tuple(a.shape)}", _describe(b))
    for arg, t in (("lse_a", la), ("lse_b", lb)):
        if t.shape != a.shape[:2] or t.dtype != torch.float32:
            _fail(ValueError, arg, f"a float32 tensor of shape {tuple(a.shape[:2])}",
                  _describe(t))


# --- content checks (read values: synchronise) -------------------------------------------------

def content_checks_requested(check: Optional[bool]) -> bool:
    """`check` if given, else whether the PAGED_KERNELS_CHECK environment variable is set."""
    if check is not None:
        return check
    return os.environ.get(CHECK_ENV, "") not in ("", "0", "false", "False")


def check_attention_contents(p: AttentionProblem) -> None:
    """`check_metadata_contents` for a checked `paged_attention` problem."""
    check_metadata_contents(p.block_tables, p.seq_lens, p.cu_seqlens_q, p.num_tokens,
                            p.block_size, p.num_blocks)


def check_metadata_contents(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
    num_tokens: int, block_size: int, num_blocks: int,
) -> None:
    """Checks the values that will be read; synchronises with the device.

    - `0 <= seq_lens[s] <= max_blocks_per_seq * block_size`;
    - `cu_seqlens_q[0] == 0`, non-decreasing, `cu_seqlens_q[-1] == num_tokens`,
      and each `q_len <= seq_len`;
    - every block id in the first `ceil(seq_len / block_size)` entries is in `[0, num_blocks)`.
    """
    lens = seq_lens.long().cpu()
    capacity = block_tables.shape[1] * block_size
    if bool((lens < 0).any()) or bool((lens > capacity).any()):
        _fail(ValueError, "seq_lens", f"values in [0, {capacity}] (max_blocks_per_seq * "
              "block_size)", f"min {int(lens.min())}, max {int(lens.max())}")
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.long().cpu()
        q_lens = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != num_tokens or bool((q_lens < 0).any()):
            _fail(ValueError, "cu_seqlens_q", f"non-decreasing from 0 to num_tokens="
                  f"{num_tokens}", cu.tolist())
        if bool((q_lens > lens).any()):
            s = int(torch.nonzero(q_lens > lens)[0])
            _fail(ValueError, "cu_seqlens_q", "q_len <= seq_len for every sequence",
                  f"q_len {int(q_lens[s])} > seq_len {int(lens[s])} for sequence {s}")
    elif bool((lens < 1).any()):
        _fail(ValueError, "seq_lens", "values >= 1 for decode (each query is in the cache)",
              lens.tolist())
    used = torch.arange(block_tables.shape[1]) < ((lens + block_size - 1)
                                                  // block_size)[:, None]
    ids = block_tables.long().cpu()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        _fail(ValueError, "block_tables", f"block ids in [0, {num_blocks}) in the entries "
              "that are read", f"min {int(ids.min())}, max {int(ids.max())}")


def check_slot_contents(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """The content check of `write_kv` (synchronises): every non-negative slot is below
    `num_slots = num_blocks * block_size`."""
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        _fail(ValueError, "slot_mapping", f"slots < num_blocks * block_size = {num_slots} "
              "(or negative to skip)", f"max {int(slot_mapping.max())}")


def check_block_ids(which: str, ids: torch.Tensor, num_blocks: int) -> None:
    """The content check of a `block_mapping` (synchronises): `which` ids ("src/dst", "source",
    "destination") are in `[0, num_blocks)`."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        _fail(ValueError, "block_mapping", f"{which} block ids in [0, {num_blocks})",
              f"min {int(ids.min())}, max {int(ids.max())}")
