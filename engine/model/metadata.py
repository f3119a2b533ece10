"""Per-step attention metadata: built once per step by the runner, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and what each sequence attends to.

    - `slot_mapping`: int64 `[num_tokens]`, token `i`'s K/V slot `block * block_size + offset`
      (negative: not written).
    - `block_tables`: int32 `[num_seqs, max_blocks]`, each sequence's blocks in order.
    - `seq_lens`: int32 `[num_seqs]`, tokens in the cache per sequence after this step's writes.
    - `cu_seqlens_q`: int32 `[num_seqs + 1]`, the query tokens of sequence `s` are
      `cu_seqlens_q[s]:cu_seqlens_q[s+1]`; None means pure decode (one token per sequence).
    - `backend`: the `paged_kernels` backend name ("auto" lets the library choose).

    The model never inspects the values; it passes them to `paged_kernels.attention`.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor] = None
    backend: str = "auto"
