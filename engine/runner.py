"""The model runner: turns one scheduled step into tensors, moves blocks, runs the model.

Per step it builds, once and with vectorised numpy, the inputs every layer shares: `input_ids`
and `positions` `[num_tokens]`, and the `AttentionMetadata` (`slot_mapping`, padded
`block_tables`, `seq_lens` after this step's writes, `cu_seqlens_q`, None when every sequence has
exactly one query token). Before the forward it performs the scheduler's block moves in the only
safe order: swap out (device blocks may be reused by this step), swap in, copy-on-write copies.
It returns float32 logits only for the sequences whose step reaches their last token.

Speculative decoding: `drafts` maps a sequence id to proposed tokens that the step computes after
the sequence's scheduled tokens (slots already allocated); such a sequence is sampled and gets a
logits row for its last scheduled token and for each proposal (1 + len(draft) consecutive rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from engine.kv_cache import KVCache
from engine.model.metadata import AttentionMetadata
from engine.request import Sequence
from engine.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    """One step's model inputs and which rows of the output hidden states to sample from."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_seqs: list[Sequence]


def build_inputs(scheduled: list[tuple[Sequence, int]], block_tables: list[list[int]],
                 block_size: int, backend: str = "auto",
                 device: torch.device | str = "cpu",
                 drafts: Optional[dict[int, list[int]]] = None) -> StepInputs:
    """Builds the step's tensors for `scheduled` `(sequence, num_new_tokens)` pairs, where
    `block_tables[i]` is the block table of the i-th scheduled sequence; `drafts` as in the
    module docstring (their tokens follow the scheduled ones; `logits_indices` then lists
    every row of a drafting sequence). A pure decode step (one token per sequence, no drafts)
    takes `decode_inputs`, the same tensors from plain lists."""
    if not drafts and all(n == 1 for _, n in scheduled):
        return decode_inputs(scheduled, block_tables, block_size, backend, device)
    return varlen_inputs(scheduled, block_tables, block_size, backend, device, drafts)


def decode_inputs(scheduled: list[tuple[Sequence, int]], block_tables: list[list[int]],
                  block_size: int, backend: str = "auto",
                  device: torch.device | str = "cpu") -> StepInputs:
    """`varlen_inputs` for one new token per sequence and no drafts, without numpy: a decode
    step of a few sequences is ~10 small arrays, and their per-call cost is most of the work
    (tests/test_runner_inputs.py checks both give equal tensors)."""
    positions = [seq.num_computed_tokens for seq, _ in scheduled]
    width = max(len(t) for t in block_tables)
    to = torch.device(device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[p // block_size] * block_size + p % block_size
                                   for t, p in zip(block_tables, positions)], device=to),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                  dtype=torch.int32, device=to),
        seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=to),
        cu_seqlens_q=None,
        backend=backend,
    )
    sampled = [i for i, ((seq, _), p) in enumerate(zip(scheduled, positions))
               if p + 1 == seq.num_tokens]
    return StepInputs(
        input_ids=torch.tensor([seq.token_ids[p] for (seq, _), p in zip(scheduled, positions)],
                               dtype=torch.int64, device=to),
        positions=torch.tensor(positions, dtype=torch.int64, device=to),
        meta=meta,
        logits_indices=torch.tensor(sampled, dtype=torch.int64, device=to),
        sampled_seqs=[scheduled[i][0] for i in sampled],
    )


def varlen_inputs(scheduled: list[tuple[Sequence, int]], block_tables: list[list[int]],
                  block_size: int, backend: str = "auto",
                  device: torch.device | str = "cpu",
                  drafts: Optional[dict[int, list[int]]] = None) -> StepInputs:
    """`build_inputs` for any step (any new-token counts, drafts), vectorised with numpy."""
    num_seqs = len(scheduled)
    drafts = drafts or {}
    extra = np.fromiter((len(drafts.get(s.seq_id, ())) for s, _ in scheduled), np.int64,
                        num_seqs)
    starts = np.fromiter((s.num_computed_tokens for s, _ in scheduled), np.int64, num_seqs)
    q_lens = np.fromiter((n for _, n in scheduled), np.int64, num_seqs) + extra
    cu = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens) - cu[seq_of_token] + starts[seq_of_token]

    input_ids: list[int] = []
    for (seq, n), start in zip(scheduled, starts.tolist()):
        if n == 1:
            input_ids.append(seq.token_ids[start])
        else:
            input_ids.extend(seq.token_ids[start:start + n])
        if drafts:
            input_ids.extend(drafts.get(seq.seq_id, ()))

    max_blocks = max(len(t) for t in block_tables)
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    for i, t in enumerate(block_tables):
        tables[i, :len(t)] = t
    slots = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    seq_lens = (starts + q_lens).astype(np.int32)

    ends = starts + q_lens
    sampled = [i for i, (seq, _) in enumerate(scheduled) if ends[i] == seq.num_tokens + extra[i]]
    rows = 1 + extra[sampled]  # logits rows per sampled sequence
    first = np.repeat(cu[1:][sampled] - rows, rows)
    logits_indices = first + np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
    decode = bool((q_lens == 1).all())
    to = torch.device(device)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(to),
        block_tables=torch.from_numpy(tables).to(to),
        seq_lens=torch.from_numpy(seq_lens).to(to),
        cu_seqlens_q=None if decode else torch.from_numpy(cu.astype(np.int32)).to(to),
        backend=backend,
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=to),
        positions=torch.from_numpy(positions).to(to),
        meta=meta,
        logits_indices=torch.from_numpy(logits_indices).to(to),
        sampled_seqs=[scheduled[i][0] for i in sampled],
    )


class ModelRunner:
    """Runs scheduled steps of one model over one `KVCache`."""

    def __init__(self, model: Any, kv_cache: KVCache, backend: str = "auto",
                 device: torch.device | str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = torch.device(device)

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write copies (see the module docstring)."""
        self.kv_cache.move_blocks(out.swap_out, out.swap_in, out.block_copies)

    @torch.inference_mode()
    def forward(self, scheduled: list[tuple[Sequence, int]], block_tables: list[list[int]],
                drafts: Optional[dict[int, list[int]]] = None
                ) -> tuple[list[Sequence], Optional[torch.Tensor]]:
        """Computes the scheduled tokens' K/V (and the `drafts`' tokens', see the module
        docstring); returns the sequences to sample and their float32 logits, one row per
        sequence, `1 + len(draft)` rows for one with a draft (None when no sequence reached
        its last token)."""
        if not scheduled:
            return [], None
        inputs = build_inputs(scheduled, block_tables, self.kv_cache.block_size, self.backend,
                              self.device, drafts)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.device_caches,
                            inputs.meta, self.kv_cache.scales)
        if not inputs.sampled_seqs:
            return [], None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return inputs.sampled_seqs, logits.float()

    def execute(self, out: SchedulerOutput, block_tables: list[list[int]],
                propose: Optional[Callable[[], dict[int, list[int]]]] = None
                ) -> tuple[list[Sequence], Optional[torch.Tensor]]:
        """Moves the step's blocks, then runs `forward` on the scheduled sequences; `propose`
        (speculative decoding), called between the two, returns the step's drafts."""
        self.move_blocks(out)
        drafts = propose() if propose is not None else None
        return self.forward(out.scheduled, block_tables, drafts)
