"""Plan once per step, run once per layer: the checked metadata of one batch, reused by every layer.

A model runs the same attention metadata (block tables, lengths, query layout, slots) through
every layer of one step; only the query, the new K/V rows and the layer's caches change. `plan`
checks that metadata once, with the checks `paged_attention` and `write_kv` run on it (content
checks included when requested), and resolves the backend; `AttentionPlan.run` and
`AttentionPlan.write_kv` then run the one-shot calls' checks of the layer's tensors (shape,
dtype, device and strides, by attribute comparisons: no content scan, no device
synchronisation), compare them with the plan, and call the backend with exactly the arguments
the one-shot calls would pass, so the results are the same bit for bit. Every check is a
function of `paged_kernels.abi`, so a plan and a one-shot call given the same arguments raise
the same error.

The plan keeps references to the metadata tensors: change their contents and the plan computes
with the new values, unchecked. Make a new plan per step (it costs about what one one-shot call
costs).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from paged_kernels.abi import (
    AttentionProblem,
    PlannedLayer,
    check_alibi_slopes,
    check_kv_scales,
    check_metadata,
    check_metadata_contents,
    check_plan_layout,
    check_plan_tokens,
    check_scalars,
    check_scales_now,
    check_slot_contents,
    content_checks_requested,
    require_planned_slots,
    requested_features,
    strided_features,
)
from paged_kernels.backends import Backend, NativeEntryPoints, call_write_kv, resolve_backend
from paged_kernels.kv_quant import is_quantized

#: A scale argument: a float, or a float32 tensor `[1]` or `[num_kv_heads]`.
ScaleArg = Union[float, torch.Tensor, None]

__all__ = ["AttentionPlan", "plan"]


class AttentionPlan:
    """One step's checked attention metadata and backend; see the module docstring.

    Built by `plan`. `run` is `paged_attention` and `write_kv` is `write_kv` for this step's
    metadata, with the per-layer tensors as the only arguments; `layer` says what those must
    be. Attributes are read-only by convention.
    """

    __slots__ = ("backend", "num_tokens", "layer", "block_tables", "seq_lens", "cu_seqlens_q",
                 "slot_mapping", "scale", "sliding_window", "soft_cap", "alibi_slopes",
                 "return_lse", "features", "k_scale", "v_scale", "_strided_ok",
                 "_check_contents")

    def __init__(self, backend: Backend, layer: PlannedLayer, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                 slot_mapping: Optional[torch.Tensor], scale: float,
                 sliding_window: Optional[int], soft_cap: Optional[float],
                 alibi_slopes: Optional[torch.Tensor], return_lse: bool,
                 features: frozenset[str], k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None, check_contents: bool = False) -> None:
        self.backend = backend
        self.num_tokens = layer.query_shape[0]
        self.layer = layer
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
        self.k_scale = k_scale
        self.v_scale = v_scale
        self._strided_ok = "strided" in backend.support.features
        self._check_contents = check_contents

    # ------------------------------------------------------------------ per layer
    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            out: Optional[torch.Tensor] = None, *, k_scale: ScaleArg = None,
            v_scale: ScaleArg = None,
            ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`paged_attention(query, key_cache, value_cache, <the plan's metadata>, out=out)`.

        An 8-bit cache's scales are this layer's `k_scale`/`v_scale` when given (both), else the
        plan's (`_scales`).

        `query` must be `[num_tokens, num_heads, head_size]` in the plan's dtype and device with
        a contiguous last dimension; the caches `[num_blocks, num_kv_heads, block_size,
        head_size]` likewise (other strides honoured when the backend supports "strided").
        Returns `out`, or `(out, lse)` when the plan was made with `return_lse=True`. Raises
        what `paged_attention` raises for the same tensors (TypeError/ValueError naming the
        argument), else TypeError/ValueError for tensors that differ from the plan, and
        NotImplementedError for strided caches on a backend that does not support them."""
        out = self.layer.check_run(query, key_cache, value_cache, out)
        k_scale, v_scale = self._scales(k_scale, v_scale)
        features = self._features(key_cache, value_cache)
        lse = None
        if self.return_lse:
            lse = torch.empty(self.num_tokens, self.layer.query_shape[1], dtype=torch.float32,
                              device=self.layer.device)
        if self.num_tokens:
            self.backend.paged_attention(AttentionProblem(
                query, key_cache, value_cache, self.block_tables, self.seq_lens,
                self.cu_seqlens_q, out, lse, self.scale, self.sliding_window, self.soft_cap,
                self.alibi_slopes, features, k_scale, v_scale))
        if lse is not None:
            return out, lse
        return out

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, *, k_scale: ScaleArg = None,
                 v_scale: ScaleArg = None) -> None:
        """`write_kv(key, value, key_cache, value_cache, <the plan's slot_mapping>)`, with this
        layer's scales when given, else the plan's (`_scales`).

        `key`/`value` must be `[num_tokens, num_kv_heads, head_size]` in the plan's dtype and
        device (any strides with a contiguous last dimension). Raises what `write_kv` raises for
        the same tensors, else for tensors that differ from the plan; ValueError when the plan
        was made without `slot_mapping`."""
        slot_mapping = require_planned_slots(self.slot_mapping)
        self.layer.check_write(key, value, key_cache, value_cache)
        k_scale, v_scale = self._scales(k_scale, v_scale)
        self._features(key_cache, value_cache)
        if self.num_tokens:
            call_write_kv(self.backend, key, value, key_cache, value_cache, slot_mapping,
                          k_scale, v_scale)

    def native_entry_points(self) -> Optional[NativeEntryPoints]:
        """The plan's backend's kernels as C++ function pointers (`NativeEntryPoints`), or
        None when it has none. A native caller that runs them for this plan's layers passes
        the plan's metadata and what `run`/`write_kv` pass, and checks each layer's tensors as
        `layer.check_run`/`layer.check_write` do (docs/abi.md, "Native entry points")."""
        return self.backend.native_entry_points()

    def _scales(self, k_scale: ScaleArg, v_scale: ScaleArg
                ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """One layer's scales: the plan's when the layer gives none, else the layer's own (both
        at once), through the one-shot calls' `check_kv_scales` (a float32 `[num_kv_heads]`
        tensor passes unchanged, with no copy). An 8-bit cache with no scale from the plan or
        the layer raises what the one-shot call raises."""
        layer = self.layer
        if k_scale is None and v_scale is None and (
                self.k_scale is not None or not is_quantized(layer.storage_dtype)):
            return self.k_scale, self.v_scale
        ks, vs = check_kv_scales(k_scale, v_scale, layer.storage_dtype, layer.kv_shape[1],
                                 layer.device)
        check_scales_now(ks, vs, self._check_contents)
        return ks, vs

    def _features(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> frozenset[str]:
        """The plan's features for one layer's caches; NotImplementedError for strided caches
        on a backend without "strided"."""
        features = strided_features(self.features, key_cache, value_cache)
        if features is not self.features and not self._strided_ok:
            layer = self.layer
            self.backend.support.check_config(self.backend.name, layer.dtype,
                                              layer.cache_shape[3], layer.cache_shape[2],
                                              features, layer.device.type,
                                              layer.storage_dtype)
        return features


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
    kv_cache_dtype: Optional[torch.dtype] = None,
    k_scale: Union[float, torch.Tensor, None] = None,
    v_scale: Union[float, torch.Tensor, None] = None,
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
    needed only by `AttentionPlan.write_kv`. `kv_cache_dtype` is the caches' dtype (None:
    `dtype`); an 8-bit one takes `k_scale`/`v_scale` (as `paged_attention` does) here, as the
    default of every layer, or per layer in `run`/`write_kv` (a model's scales are per layer).
    They are normalised once to float32 `[num_kv_heads]` tensors; a tensor given as
    `[num_kv_heads]` is used as is, so updating it in place (CUDA graphs) is seen by the plan.

    Raises what `paged_attention` raises for the same metadata: TypeError/ValueError naming the
    argument, NotImplementedError when the backend does not support the request, RuntimeError
    when it cannot run here. Content checks (block ids, lengths, slots) run here, once, when the
    backend always checks contents or `check=True` / PAGED_KERNELS_CHECK=1.
    """
    cache_dtype = check_plan_layout(num_heads, num_kv_heads, head_size, block_size, num_blocks,
                                    dtype, kv_cache_dtype)
    bt, sl, cu = check_metadata(block_tables, seq_lens, cu_seqlens_q)
    device = bt.device
    tokens, slots = check_plan_tokens(num_tokens, bt.shape[0], cu, slot_mapping, device)
    resolved_scale = check_scalars(head_size, scale, sliding_window, soft_cap)
    slopes = check_alibi_slopes(alibi_slopes, num_heads, device)
    ks = vs = None  # an 8-bit cache's scales may come with each layer instead
    if k_scale is not None or v_scale is not None or not is_quantized(cache_dtype):
        ks, vs = check_kv_scales(k_scale, v_scale, cache_dtype, num_kv_heads, device)
    features = requested_features(cu, sliding_window, soft_cap, slopes, return_lse)
    impl = resolve_backend(backend, device)
    impl.support.check_config(impl.name, dtype, head_size, block_size, features, device.type,
                              cache_dtype)
    contents = impl.always_check_contents or content_checks_requested(check)
    check_scales_now(ks, vs, contents)
    if contents:
        check_metadata_contents(bt, sl, cu, tokens, block_size, num_blocks)
        if slots is not None:
            check_slot_contents(slots, num_blocks * block_size)
    layer = PlannedLayer(dtype, device, torch.Size((tokens, num_heads, head_size)),
                         torch.Size((tokens, num_kv_heads, head_size)),
                         torch.Size((num_blocks, num_kv_heads, block_size, head_size)), cu is None,
                         None if cache_dtype == dtype else cache_dtype)
    return AttentionPlan(impl, layer, bt, sl, cu, slots, resolved_scale, sliding_window,
                         soft_cap, slopes, bool(return_lse), features, ks, vs, contents)
