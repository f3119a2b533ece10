"""Triton device functions shared by the decode and varlen kernels (docs/triton.md).

`attend_keys` runs the online-softmax loop of one program: a tile of query rows (query heads of one
GQA group, times query tokens in the varlen kernel) against the keys `[kv_lo, kv_hi)` of one
sequence and one KV head, read `TILE_N` tokens at a time through the block table. Every K/V row
outside `[kv_lo, kv_hi)` is neither loaded nor its block-table entry read, so unused cache slots
(NaN included) and unused block-table entries never reach the result.

8-bit caches (float8_e4m3fn, float8_e5m2, int8): K/V tiles are loaded in the cache's own type and
converted to the query's type, which holds every 8-bit value exactly; the per-KV-head scales are
applied outside the dots (the caller folds `k_scale` into the score scale and multiplies the
output by `v_scale`), so `q . (k * k_scale)` and `sum p * (v * v_scale)` are computed as today.

Scores are kept in the log2 domain (`exp2` is a single instruction on the GPU): `s2 = s * log2(e)`;
the running maximum `m` and the log-sum-exp returned by `finish` are log2-domain values too.

Interpreter workaround (Triton 3.9): the interpreter's `tl.dot` returns garbage for bfloat16
operands, so `UPCAST` (set only when TRITON_INTERPRET=1, see `runtime.interpreting`) converts both
operands to float32 first, and 8-bit K/V tiles go straight to float32 (its int8 -> bfloat16
conversion reinterprets bits). On the GPU `UPCAST` is False and the native bf16 tensor-core dot
runs.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """`a @ b` accumulated in float32. IEEE: exact fp32 products (tl.dot would use TF32).
    UPCAST: the interpreter workaround described in the module docstring."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def to_operand(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """A K or V tile as a dot operand of the query's `dtype` (a no-op for a float cache; exact
    for an 8-bit one). Under UPCAST it goes to float32 instead, which `dot` would convert to
    anyway: the interpreter converts int8 to bfloat16 by reinterpreting bits."""
    if UPCAST:
        r = x.to(tl.float32)
    else:
        r = x.to(dtype)
    return r


@triton.jit
def tanh(x):
    """tanh(x) through exp2, saturating to +-1 for large |x| (no tl.tanh in the interpreter)."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def attend_keys(
    acc, m_i, l_i,  # running state: [M, HEAD_PAD] fp32, [M] fp32 (log2 domain), [M] fp32
    q,  # [M, HEAD_PAD] query rows, padded rows/columns zero
    q_pos,  # [M] int32 position of each row's query token
    slope2,  # [M] fp32 ALiBi slope * log2(e) of each row's head (ignored unless USE_ALIBI)
    k_base, v_base,  # cache pointers already offset to this program's KV head
    bt_row,  # pointer to this sequence's block-table row
    stride_kb, stride_kt, stride_vb, stride_vt,
    kv_lo, kv_hi,  # read keys at positions [kv_lo, kv_hi) only
    scale, soft_cap, window,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    USE_ALIBI: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Folds keys `[kv_lo, kv_hi)` into `(acc, m_i, l_i)`, masking causality and the window
    per row."""
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    for start in range((kv_lo // TILE_N) * TILE_N, kv_hi, TILE_N):
        k_pos = start + tl.arange(0, TILE_N)
        load_ok = (k_pos >= kv_lo) & (k_pos < kv_hi)
        # int64: block id * block stride exceeds 2^31 elements in large caches
        block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=load_ok, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        kt = tl.load(k_base + (block * stride_kb + slot * stride_kt)[None, :] + offs_d[:, None],
                     mask=load_ok[None, :] & d_ok[:, None], other=0.0)
        s = dot(q, to_operand(kt, q.dtype, UPCAST), IEEE, UPCAST)
        if USE_SOFT_CAP:
            s = (soft_cap * LOG2E) * tanh(s * (scale / soft_cap))
        else:
            s = s * (scale * LOG2E)
        rel = k_pos[None, :] - q_pos[:, None]
        if USE_ALIBI:
            s += slope2[:, None] * rel.to(tl.float32)
        visible = load_ok[None, :] & (rel <= 0)
        if USE_WINDOW:
            visible = visible & (rel > -window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no visible key yet keeps m = -inf; shift by 0 to avoid inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (block * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :],
                    mask=load_ok[:, None] & d_ok[None, :], other=0.0)
        v = to_operand(v, q.dtype, UPCAST)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def kv_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_SCALED: tl.constexpr):
    """`(k_scale, v_scale)` of `kv_head` for an 8-bit cache (float32 `[num_kv_heads]` tensors),
    `(1.0, 1.0)` for a float cache (the pointers are then unused)."""
    if KV_SCALED:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def finish(acc, m_i, l_i):
    """Normalised output rows and their log2-domain log-sum-exp (-inf and 0 for empty rows)."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    return out, lse2
