"""Property-based cases: hypothesis draws random configurations of every axis of the ABI and the
reference backend must match the float64 oracle on each."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paged_kernels as pk
from oracle import attention_oracle, rel_error
from paged_case import make_case


@st.composite
def problems(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32, 64, 128, 256]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_size = draw(st.integers(1, 48))
    num_seqs = draw(st.integers(1, 4))
    seq_lens = draw(st.lists(st.integers(1, 3 * block_size + 5), min_size=num_seqs,
                             max_size=num_seqs))
    decode = draw(st.booleans())
    q_lens = None if decode else [draw(st.integers(0, n)) for n in seq_lens]
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    kwargs = {}
    if draw(st.booleans()):
        kwargs["sliding_window"] = draw(st.integers(1, 2 * block_size + 3))
    if draw(st.booleans()):
        kwargs["soft_cap"] = draw(st.floats(0.5, 30.0))
    if draw(st.booleans()):
        kwargs["alibi_slopes"] = torch.rand(num_kv_heads * group)
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.01, 2.0))
    case = make_case(seq_lens, q_lens, num_heads=num_kv_heads * group,
                     num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                     dtype=dtype, seed=draw(st.integers(0, 2**16)),
                     share_prefix=draw(st.booleans()), nhd=draw(st.booleans()))
    return case, kwargs, dtype


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_reference_matches_oracle(problem):
    case, kwargs, dtype = problem
    out = torch.full_like(case.query, math.nan)
    got, lse = pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                  case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out,
                                  return_lse=True, backend="reference", **kwargs)
    ref, ref_lse = attention_oracle(case.query, case.keys, case.values, case.q_lens, **kwargs)
    if case.query.shape[0] == 0:
        return
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_error(got, ref) <= tol
    assert rel_error(lse, ref_lse) <= 1e-5
