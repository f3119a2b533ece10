"""The one place the block-table ABI is checked (see docs/abi.md).

`check_attention_args` turns the public arguments of `paged_attention` into an `AttentionProblem`
after checking shapes, dtypes, devices and strides on the host (no device synchronisation).
`check_attention_contents` checks the values that are read (block ids, lengths); it synchronises,
so it runs always in the reference backend and on request for the fast ones.

Backends receive only `AttentionProblem`s that passed these checks, and declare what they support
with a `Support`; `Support.check` raises `NotImplementedError` for anything outside it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Names of the optional features a problem may use; backends declare the subset they support.
FEATURES = ("varlen", "sliding_window", "soft_cap", "alibi", "lse", "strided")

CHECK_ENV = "PAGED_KERNELS_CHECK"


def _fail(kind: type, arg: str, expected: str, given: object) -> None:
    raise kind(f"{arg}: expected {expected}, got {given}")


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
      dimension contiguous, other strides arbitrary; same dtype and device as `query`.
    - `block_tables` int32 `[num_seqs, max_blocks_per_seq]`, `seq_lens` int32 `[num_seqs]`,
      `cu_seqlens_q` int32 `[num_seqs + 1]` or None (decode: `num_tokens == num_seqs`).
    - `out` has `query`'s shape and dtype; `lse` is float32 `[num_tokens, num_heads]` or None.
    - `alibi_slopes` is float32 `[num_heads]` or None. `scale` is resolved to a float.
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
    `max_head_size`/`max_block_size`; `reasons` explains each limit for the support table."""

    dtypes: frozenset[torch.dtype]
    device_types: frozenset[str]
    features: frozenset[str]
    head_sizes: Optional[frozenset[int]] = None
    max_head_size: Optional[int] = None
    block_sizes: Optional[frozenset[int]] = None
    max_block_size: Optional[int] = None
    reasons: tuple[tuple[str, str], ...] = ()

    def unsupported(
        self, dtype: torch.dtype, head_size: int, block_size: int, features: frozenset[str],
        device_type: str,
    ) -> Optional[str]:
        """Returns why this configuration is unsupported, or None when it is supported."""
        if device_type not in self.device_types:
            return f"device type {device_type!r} (supports {sorted(self.device_types)})"
        if dtype not in self.dtypes:
            return f"dtype {dtype} (supports {sorted(str(d) for d in self.dtypes)})"
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

    def check(self, backend: str, problem: AttentionProblem) -> None:
        """Raises NotImplementedError naming `backend` and the first unsupported property."""
        why = self.unsupported(problem.query.dtype, problem.head_size, problem.block_size,
                               problem.features, problem.query.device.type)
        if why is not None:
            raise NotImplementedError(f"backend {backend!r} does not support {why}")


def _check_cache(arg: str, cache: object, query: torch.Tensor) -> torch.Tensor:
    cache = _require_tensor(arg, cache)
    _require_ndim(arg, cache, 4, "[num_blocks, num_kv_heads, block_size, head_size]")
    if cache.dtype != query.dtype:
        _fail(TypeError, arg, f"dtype {query.dtype} (the query's dtype)", _describe(cache))
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


def _check_out(out: Optional[torch.Tensor], query: torch.Tensor) -> torch.Tensor:
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


def _check_scalars(
    head_size: int, scale: Optional[float], sliding_window: Optional[int],
    soft_cap: Optional[float],
) -> float:
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


def check_attention_args(
    query: object, key_cache: object, value_cache: object, block_tables: object,
    seq_lens: object, *, cu_seqlens_q: object = None, scale: Optional[float] = None,
    sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
    alibi_slopes: object = None, out: Optional[torch.Tensor] = None, return_lse: bool = False,
) -> AttentionProblem:
    """Checks every argument of `paged_attention` on the host; returns the checked problem.

    Raises TypeError (wrong type or dtype) or ValueError (wrong shape, device, stride or value),
    with a message naming the argument, what was expected and what was given.
    """
    q = _check_query(query)
    num_tokens, num_heads, head_size = q.shape
    k = _check_cache("key_cache", key_cache, q)
    v = _check_cache("value_cache", value_cache, q)
    if v.shape != k.shape:
        _fail(ValueError, "value_cache", f"the key_cache's shape {tuple(k.shape)}", _describe(v))
    num_kv_heads = k.shape[1]
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        _fail(ValueError, "key_cache", f"num_kv_heads dividing num_heads={num_heads}",
              f"num_kv_heads={num_kv_heads}")
    bt = require_int_tensor("block_tables", block_tables, torch.int32, (None, None), q.device)
    num_seqs = bt.shape[0]
    sl = require_int_tensor("seq_lens", seq_lens, torch.int32, (num_seqs,), q.device)
    features = set()
    cu = None
    if cu_seqlens_q is not None:
        cu = require_int_tensor("cu_seqlens_q", cu_seqlens_q, torch.int32, (num_seqs + 1,),
                                q.device)
        features.add("varlen")
    elif num_tokens != num_seqs:
        _fail(ValueError, "query", f"num_tokens == num_seqs={num_seqs} when cu_seqlens_q is None "
              "(decode)", f"num_tokens={num_tokens}")
    resolved_scale = _check_scalars(head_size, scale, sliding_window, soft_cap)
    slopes = check_alibi_slopes(alibi_slopes, num_heads, q.device)
    if slopes is not None:
        features.add("alibi")
    o = _check_out(out, q)
    lse = None
    if return_lse:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
        features.add("lse")
    if sliding_window is not None:
        features.add("sliding_window")
    if soft_cap is not None:
        features.add("soft_cap")
    if not (k.is_contiguous() and v.is_contiguous()):
        features.add("strided")
    return AttentionProblem(q, k, v, bt, sl, cu, o, lse, resolved_scale, sliding_window,
                            soft_cap, slopes, frozenset(features))


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
