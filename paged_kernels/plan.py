"""Plan once per step, run once per layer: the checked metadata of one batch, reused by every layer.

A model runs the same attention metadata (block tables, lengths, query layout, slots) through
every layer of one step; only the query, the new K/V rows and the layer's caches change. `plan`
checks that metadata once (everything `paged_attention` and `write_kv` check, content checks
included when requested) and resolves the backend; `AttentionPlan.run` and
`AttentionPlan.write_kv` then check only what can differ between layers (shape, dtype, device
and strides of the layer's tensors, by attribute comparisons: no content scan, no device
synchronisation) and call the backend with exactly the arguments the one-shot calls would pass,
so the results are the same bit for bit.

The plan keeps references to the metadata tensors: change their contents and the plan computes
with the new values, unchecked. Make a new plan per step (it costs about what one one-shot call
costs).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from paged_kernels.abi import (
    FLOAT_DTYPES,
    AttentionProblem,
    _check_scalars,
    _describe,
    _fail,
    _require_device,
    _require_tensor,
    check_alibi_slopes,
    check_metadata_contents,
    check_slot_contents,
    content_checks_requested,
    require_int_tensor,
)
from paged_kernels.backends import Backend, resolve_backend

__all__ = ["AttentionPlan", "plan"]

_STRIDED = frozenset({"strided"})


def _require_positive_int(arg: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(ValueError, arg, "an int >= 1", repr(value))
    return value  # type: ignore[return-value]


class AttentionPlan:
    """One step's checked attention metadata and backend; see the module docstring.

    Built by `plan`. `run` is `paged_attention` and `write_kv` is `write_kv` for this step's
    metadata, with the per-layer tensors as the only arguments. Attributes are read-only by
    convention.
    """

    __slots__ = ("backend", "dtype", "device", "num_tokens", "cache_shape", "query_shape",
                 "kv_shape", "block_tables", "seq_lens", "cu_seqlens_q", "slot_mapping",
                 "scale", "sliding_window", "soft_cap", "alibi_slopes", "return_lse",
                 "features", "_strided_ok")

    def __init__(self, backend: Backend, dtype: torch.dtype, device: torch.device,
                 num_tokens: int, cache_shape: tuple[int, int, int, int], num_heads: int,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_q: Optional[torch.Tensor], slot_mapping: Optional[torch.Tensor],
                 scale: float, sliding_window: Optional[int], soft_cap: Optional[float],
                 alibi_slopes: Optional[torch.Tensor], return_lse: bool,
                 features: frozenset[str]) -> None:
        self.backend = backend
        self.dtype = dtype
        self.device = device
        self.num_tokens = num_tokens
        self.cache_shape = torch.Size(cache_shape)
        head_size = cache_shape[3]
        self.query_shape = torch.Size((num_tokens, num_heads, head_size))
        self.kv_shape = torch.Size((num_tokens, cache_shape[1], head_size))
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.cu_seqlens_q = cu_seqlens_q
        self.slot_mapping = slot_mapping
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        self.alibi_slopes = alibi_slopes
        self.return_lse = return_lse
        self.features = features
        self._strided_ok = "strided" in backend.support.features

    # ------------------------------------------------------------------ per layer
    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            out: Optional[torch.Tensor] = None
            ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`paged_attention(query, key_cache, value_cache, <the plan's metadata>, out=out)`.

        `query` must be `[num_tokens, num_heads, head_size]` in the plan's dtype and device with
        a contiguous last dimension; the caches `[num_blocks, num_kv_heads, block_size,
        head_size]` likewise (other strides honoured when the backend supports "strided").
        Returns `out`, or `(out, lse)` when the plan was made with `return_lse=True`. Raises
        TypeError/ValueError naming the argument, NotImplementedError for strided caches on a
        backend that does not support them."""
        if not self._matches(query, self.query_shape, 2):
            self._explain(query, "query", self.query_shape, 2)
        features = self._check_caches(key_cache, value_cache)
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        elif not self._matches(out, self.query_shape, 2):
            self._explain(out, "out", self.query_shape, 2)
        lse = None
        if self.return_lse:
            lse = torch.empty(self.num_tokens, self.query_shape[1], dtype=torch.float32,
                              device=self.device)
        if self.num_tokens:
            self.backend.paged_attention(AttentionProblem(
                query, key_cache, value_cache, self.block_tables, self.seq_lens,
                self.cu_seqlens_q, out, lse, self.scale, self.sliding_window, self.soft_cap,
                self.alibi_slopes, features))
        if lse is not None:
            return out, lse
        return out

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor) -> None:
        """`write_kv(key, value, key_cache, value_cache, <the plan's slot_mapping>)`.

        `key`/`value` must be `[num_tokens, num_kv_heads, head_size]` in the plan's dtype and
        device (any strides with a contiguous last dimension). ValueError when the plan was
        made without `slot_mapping`."""
        if self.slot_mapping is None:
            _fail(ValueError, "slot_mapping", "an int64 tensor given to plan() before "
                  "AttentionPlan.write_kv is called", None)
        for arg, t in (("key", key), ("value", value)):
            if not self._matches(t, self.kv_shape, 2):
                self._explain(t, arg, self.kv_shape, 2)
        self._check_caches(key_cache, value_cache)
        if self.num_tokens:
            self.backend.write_kv(key, value, key_cache, value_cache, self.slot_mapping)

    # ------------------------------------------------------------------- checks
    def _matches(self, t: object, shape: torch.Size, contiguous_dim: int) -> bool:
        return (isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == self.dtype
                and t.device == self.device and t.stride(contiguous_dim) == 1)

    def _explain(self, t: object, arg: str, shape: torch.Size, contiguous_dim: int) -> None:
        """Raises the error for a tensor that failed `_matches`."""
        t = _require_tensor(arg, t)
        if t.dtype != self.dtype:
            _fail(TypeError, arg, f"dtype {self.dtype} (the plan's)", _describe(t))
        if t.shape != shape:
            _fail(ValueError, arg, f"shape {tuple(shape)} (from the plan)", _describe(t))
        _require_device(arg, t, self.device)
        _fail(ValueError, arg, "a contiguous last dimension (stride 1)",
              f"strides {tuple(t.stride())}")

    def _check_caches(self, key_cache: torch.Tensor, value_cache: torch.Tensor
                      ) -> frozenset[str]:
        """Checks one layer's caches; returns the problem's features (plus "strided" when a
        cache is not contiguous)."""
        for arg, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if not self._matches(t, self.cache_shape, 3):
                self._explain(t, arg, self.cache_shape, 3)
        if key_cache.is_contiguous() and value_cache.is_contiguous():
            return self.features
        if not self._strided_ok:
            raise NotImplementedError(f"backend {self.backend.name!r} does not support "
                                      "feature(s) strided")
        return self.features | _STRIDED


def _check_layout(num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                  num_blocks: int, dtype: torch.dtype) -> None:
    for arg, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                       ("head_size", head_size), ("block_size", block_size),
                       ("num_blocks", num_blocks)):
        _require_positive_int(arg, value)
    if num_heads % num_kv_heads:
        _fail(ValueError, "num_kv_heads", f"a divisor of num_heads={num_heads}", num_kv_heads)
    if dtype not in FLOAT_DTYPES:
        _fail(TypeError, "dtype", " or ".join(str(d) for d in FLOAT_DTYPES), dtype)


def _resolve_num_tokens(num_tokens: Optional[int], num_seqs: int,
                        cu_seqlens_q: Optional[torch.Tensor],
                        slot_mapping: Optional[torch.Tensor]) -> int:
    """`num_tokens` as given, else num_seqs (decode), slot_mapping's length, or
    `cu_seqlens_q[-1]` (one read of the tensor)."""
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


def plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    slot_mapping: Optional[torch.Tensor] = None,
    num_tokens: Optional[int] = None,
    scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: str = "auto",
    check: Optional[bool] = None,
) -> AttentionPlan:
    """Checks one step's attention metadata once; returns the `AttentionPlan` every layer runs.

    The metadata means what it means for `paged_attention` and `write_kv` (docs/abi.md); the
    device is `block_tables`' device. The caches the plan will see are `[num_blocks,
    num_kv_heads, block_size, head_size]` in `dtype`, queries `[num_tokens, num_heads,
    head_size]`. `num_tokens` defaults to `num_seqs` for decode (`cu_seqlens_q` None), else to
    `slot_mapping`'s length, else to `cu_seqlens_q[-1]` (which reads the tensor: pass
    `num_tokens` to avoid a device synchronisation). `slot_mapping` (int64 `[num_tokens]`) is
    needed only by `AttentionPlan.write_kv`.

    Raises what `paged_attention` raises for the same metadata: TypeError/ValueError naming the
    argument, NotImplementedError when the backend does not support the request, RuntimeError
    when it cannot run here. Content checks (block ids, lengths, slots) run here, once, when the
    backend always checks contents or `check=True` / PAGED_KERNELS_CHECK=1.
    """
    _check_layout(num_heads, num_kv_heads, head_size, block_size, num_blocks, dtype)
    bt = require_int_tensor("block_tables", block_tables, torch.int32, (None, None),
                            _require_tensor("block_tables", block_tables).device)
    device = bt.device
    num_seqs = bt.shape[0]
    sl = require_int_tensor("seq_lens", seq_lens, torch.int32, (num_seqs,), device)
    features = set()
    cu = None
    if cu_seqlens_q is not None:
        cu = require_int_tensor("cu_seqlens_q", cu_seqlens_q, torch.int32, (num_seqs + 1,),
                                device)
        features.add("varlen")
    slots = None
    if slot_mapping is not None:
        slots = require_int_tensor("slot_mapping", slot_mapping, torch.int64, (None,), device)
    tokens = _resolve_num_tokens(num_tokens, num_seqs, cu, slots)
    if slots is not None and slots.shape[0] != tokens:
        _fail(ValueError, "slot_mapping", f"shape [{tokens}] (num_tokens)", _describe(slots))
    resolved_scale = _check_scalars(head_size, scale, sliding_window, soft_cap)
    slopes = check_alibi_slopes(alibi_slopes, num_heads, device)
    if slopes is not None:
        features.add("alibi")
    for name, used in (("lse", return_lse), ("sliding_window", sliding_window is not None),
                       ("soft_cap", soft_cap is not None)):
        if used:
            features.add(name)
    impl = resolve_backend(backend, device)
    why = impl.support.unsupported(dtype, head_size, block_size, frozenset(features),
                                   device.type)
    if why is not None:
        raise NotImplementedError(f"backend {impl.name!r} does not support {why}")
    if impl.always_check_contents or content_checks_requested(check):
        check_metadata_contents(bt, sl, cu, tokens, block_size, num_blocks)
        if slots is not None:
            check_slot_contents(slots, num_blocks * block_size)
    return AttentionPlan(impl, dtype, device, tokens, (num_blocks, num_kv_heads, block_size,
                                                       head_size), num_heads, bt, sl, cu, slots,
                         resolved_scale, sliding_window, soft_cap, slopes, bool(return_lse),
                         frozenset(features))
