"""Dense float64 attention on unpaged K/V: the oracle. Shares no code with any backend.

Written as directly as possible from docs/abi.md, one sequence and one head at a time.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def attention_oracle(
    query: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
    q_lens: Sequence[int], *, scale: Optional[float] = None, sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out float64 [num_tokens, num_heads, head_size], lse float64 [num_tokens, heads]).

    `keys[s]`/`values[s]` are sequence s's K/V `[seq_len, num_kv_heads, head_size]`; its
    `q_lens[s]` query tokens are the next rows of `query` and sit at its last positions.
    """
    num_tokens, num_heads, head_size = query.shape
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    out = torch.empty(num_tokens, num_heads, head_size, dtype=torch.float64)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float64)
    t = 0
    for k, v, q_len in zip(keys, values, q_lens):
        k, v = k.double().cpu(), v.double().cpu()
        seq_len, num_kv_heads = k.shape[0], k.shape[1]
        group = num_heads // num_kv_heads
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            q = query[t].double().cpu()
            for h in range(num_heads):
                kh, vh = k[lo:pos + 1, h // group], v[lo:pos + 1, h // group]
                s = (kh @ q[h]) * scale
                if soft_cap is not None:
                    s = soft_cap * torch.tanh(s / soft_cap)
                if alibi_slopes is not None:
                    k_pos = torch.arange(lo, pos + 1, dtype=torch.float64)
                    s = s + float(alibi_slopes[h]) * (k_pos - pos)
                m = s.max()
                w = torch.exp(s - m)
                lse[t, h] = m + torch.log(w.sum())
                out[t, h] = (w / w.sum()) @ vh
            t += 1
    return out, lse


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64; NaN anywhere gives inf."""
    x = x.double().cpu()
    ref = ref.double().cpu()
    if not torch.isfinite(x).all():
        return math.inf
    norm = torch.linalg.vector_norm
    return float(norm(x - ref) / norm(ref).clamp_min(1e-300))
