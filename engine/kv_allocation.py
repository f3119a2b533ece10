"""KV allocation policies: how many slots a request takes at admission.

"paged" takes blocks as tokens arrive (PagedAttention). The other policies are the contiguous-
reservation baselines of the vLLM paper (Kwon et al., SOSP 2023, section 6.1: Orca (Max),
Orca (Pow2) and Orca (Oracle)): at admission a request reserves slots for its whole life, and
keeps them until it finishes or is preempted.

- "reserve-max": `max_model_len` slots, whatever the request.
- "reserve-pow2": the next power of two of prompt + output length (at least the prompt).
- "reserve-oracle": exactly prompt + output length (it knows the future).

Every reservation is capped at `max_model_len`. The KV cache manager gives a reservation's blocks
at admission (`KVCacheManager.admit(..., reserve_tokens=...)`); the scheduler admits a request
only when the whole reservation fits.
"""

from __future__ import annotations

from typing import Optional

from engine.config import KV_ALLOCATIONS


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def reserved_tokens(policy: str, prompt_len: int, max_output_tokens: int,
                    max_model_len: int) -> Optional[int]:
    """The slots a request of `prompt_len` prompt tokens and at most `max_output_tokens` output
    tokens reserves at admission under `policy` (one of `KV_ALLOCATIONS`); None for "paged"
    (no reservation). ValueError for an unknown policy or a bad count."""
    if policy not in KV_ALLOCATIONS:
        raise ValueError(f"kv_allocation: expected one of {KV_ALLOCATIONS}, got {policy!r}")
    _check_count("prompt_len", prompt_len, 1)
    _check_count("max_output_tokens", max_output_tokens, 0)
    _check_count("max_model_len", max_model_len, 1)
    if policy == "paged":
        return None
    if policy == "reserve-max":
        return max_model_len
    total = prompt_len + max_output_tokens
    if policy == "reserve-pow2":
        total = 1 << (total - 1).bit_length()
    return min(total, max_model_len)


def resolved_max_tokens(max_tokens: Optional[int], prompt_len: int, max_model_len: int) -> int:
    """The most output tokens a request can produce: its `max_tokens` (None: no limit) within
    the room `max_model_len` leaves after the prompt (the engine stops a sequence at either)."""
    room = max(0, max_model_len - prompt_len)
    return room if max_tokens is None else min(max_tokens, room)
