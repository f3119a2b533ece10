"""N-gram proposals (prompt lookup decoding, vLLM's "ngram" method).

For each sequence, the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
are looked up in its earlier tokens (prompt and output); at the latest earlier occurrence of the
longest n that occurs, the tokens that followed it are proposed, up to k. No model runs and no
state is kept, so `move_blocks` and `forget` do nothing. One lookup is O(len * (max - min + 1))
with numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.spec_decode.proposer import Proposal

if TYPE_CHECKING:
    from engine.request import Sequence
    from engine.scheduler import SchedulerOutput


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length n in [min_n, max_n] that occurs earlier; [] when none does."""
    size = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        # windows starting at 0 .. size - n - 1: every occurrence that ends before the suffix
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Proposes continuations copied from earlier in the sequence (see the module docstring)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"min_n, max_n: expected 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list["Sequence"], num_tokens: list[int],
                block_tables: list[list[int]]) -> list[Proposal]:
        """Up to `num_tokens[i]` tokens for `seqs[i]` by lookup; the block tables are unused."""
        return [Proposal(ngram_lookup(np.asarray(s.token_ids, np.int64), k, self.min_n,
                                      self.max_n))
                for s, k in zip(seqs, num_tokens)]

    def move_blocks(self, out: "SchedulerOutput") -> None:
        """Nothing to move: n-gram lookup keeps no KV cache."""

    def forget(self, seq_id: int) -> None:
        """Nothing to forget: n-gram lookup keeps no per-sequence state."""
