"""`engine.runner.build_inputs`: a pure decode step takes `decode_inputs` (plain lists), any other
step `varlen_inputs` (numpy); on decode steps both give equal tensors of equal dtypes, for
random block tables of different lengths and sequences that do or do not reach their last
token."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import engine.runner as runner


def _decode_step(rng: random.Random, num_seqs: int, block_size: int):
    scheduled, tables = [], []
    for i in range(num_seqs):
        computed = rng.randrange(0, 200)
        total = computed + 1 + (rng.random() < 0.3) * rng.randrange(1, 5)  # some not sampled
        seq = SimpleNamespace(seq_id=i, num_computed_tokens=computed, num_tokens=total,
                              token_ids=[rng.randrange(50000) for _ in range(total)])
        blocks = rng.sample(range(1000), (total + block_size - 1) // block_size)
        scheduled.append((seq, 1))
        tables.append(blocks)
    return scheduled, tables


def _assert_same(a: runner.StepInputs, b: runner.StepInputs) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("slot_mapping", "block_tables", "seq_lens"):
        x, y = getattr(a.meta, name), getattr(b.meta, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.meta.cu_seqlens_q is None and b.meta.cu_seqlens_q is None
    assert a.meta.backend == b.meta.backend
    assert [s.seq_id for s in a.sampled_seqs] == [s.seq_id for s in b.sampled_seqs]


@pytest.mark.parametrize("num_seqs", [1, 3, 16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_inputs_equal_the_varlen_inputs(num_seqs, block_size):
    rng = random.Random(num_seqs * 100 + block_size)
    for _ in range(5):
        scheduled, tables = _decode_step(rng, num_seqs, block_size)
        _assert_same(runner.decode_inputs(scheduled, tables, block_size, "cpu"),
                     runner.varlen_inputs(scheduled, tables, block_size, "cpu"))


def test_build_inputs_dispatch(monkeypatch):
    """Decode steps go to decode_inputs; a step with a prefill chunk or with drafts does not."""
    rng = random.Random(7)
    scheduled, tables = _decode_step(rng, 4, 16)
    called = []
    for name in ("decode_inputs", "varlen_inputs"):
        original = getattr(runner, name)
        monkeypatch.setattr(runner, name,
                            lambda *a, _n=name, _f=original: called.append(_n) or _f(*a))
    runner.build_inputs(scheduled, tables, 16)
    runner.build_inputs(scheduled, tables, 16, drafts={scheduled[0][0].seq_id: [5]})
    seq = scheduled[1][0]
    seq.num_tokens = seq.num_computed_tokens + 3
    seq.token_ids += [1, 2, 3]
    runner.build_inputs([(scheduled[0][0], 1), (seq, 3)], tables[:2], 16)
    assert called == ["decode_inputs", "varlen_inputs", "varlen_inputs"]
