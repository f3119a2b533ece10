"""Triton-specific attention tests: split-K, fixed-split determinism, the interpreter workaround,
non-power-of-two head sizes, block sizes 8 and 256, strided caches, GQA/MQA, every feature.

Runs natively on a CUDA device, else in Triton's interpreter on CPU tensors (see
tests/triton_env.py). Checked against tests/oracle.py, a float64 dense attention
that shares no code with the kernels, on cases from tests/paged_case.py: unused cache slots are
NaN, unused block-table entries are garbage, block tables are shuffled.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

import paged_case
import paged_kernels as pk
from oracle import attention_oracle
from triton_env import DEVICE  # before triton_impl: skips this module where triton is unusable
from triton_impl import decode, runtime

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_case(seq_lens: list[int], q_lens: Optional[list[int]], *, heads: tuple[int, int] = (4, 2),
              head_size: int = 32, block_size: int = 16, dtype: torch.dtype = torch.float32,
              layout: str = "hnd", **kwargs) -> paged_case.PagedCase:
    """`paged_case.make_case` with this file's defaults, on DEVICE; `q_lens=None` is decode.
    `layout` "nhd" permutes the cache, "padded" widens each row (contiguous last dim, larger
    row stride, misaligned base)."""
    return paged_case.make_case(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                                head_size=head_size, block_size=block_size, dtype=dtype,
                                nhd=layout == "nhd",
                                row_pad=(3, 5) if layout == "padded" else (0, 0),
                                device=DEVICE, **kwargs)


def run(case: paged_case.PagedCase, out: Optional[torch.Tensor] = None, **kwargs
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The triton backend's (out, lse) for `case`; `out` defaults to a NaN tensor to prove every
    element is written."""
    if out is None:
        out = torch.full_like(case.query, math.nan)
    got, lse = pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                  case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out,
                                  return_lse=True, backend="triton", **kwargs)
    assert got is out
    return got, lse


def check(case: paged_case.PagedCase, out: Optional[torch.Tensor] = None, **kwargs
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs `case` and compares out and lse with the oracle."""
    got, lse = run(case, out, **kwargs)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].cpu()
    want, want_lse = attention_oracle(case.query, case.keys, case.values, case.q_lens, **kwargs)
    tol = TOL[case.query.dtype]
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double().cpu(), want_lse, atol=1e-4, rtol=1e-5)
    return got, lse


def slopes(num_heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)],
                        device=DEVICE)


@pytest.fixture
def fixed_split():
    """Forces a split size for one test and restores the heuristic afterwards."""
    yield decode.set_fixed_split_size
    decode.set_fixed_split_size(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", ["decode", "varlen"])
def test_dtypes(dtype: torch.dtype, batch: str) -> None:
    q_lens = None if batch == "decode" else [3, 20, 1]
    check(make_case([9, 40, 17], q_lens, dtype=dtype))


@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (6, 2), (8, 2), (16, 1)],
                         ids=["mha", "mqa", "gqa3", "gqa4", "mqa16"])
@pytest.mark.parametrize("batch", ["decode", "varlen"])
def test_gqa_mqa(heads: tuple[int, int], batch: str) -> None:
    q_lens = None if batch == "decode" else [5, 2]
    check(make_case([21, 34], q_lens, heads=heads, dtype=torch.float16))


@pytest.mark.parametrize("head_size", [8, 24, 40, 80, 256])
@pytest.mark.parametrize("batch", ["decode", "varlen"])
def test_head_sizes(head_size: int, batch: str) -> None:
    """Non-powers of two are padded to the next power of two and masked; 8 is padded to 16."""
    q_lens = None if batch == "decode" else [4, 7]
    check(make_case([19, 7], q_lens, head_size=head_size, heads=(2, 1)))


@pytest.mark.parametrize("block_size", [1, 8, 24, 256])
@pytest.mark.parametrize("batch", ["decode", "varlen"])
def test_block_sizes(block_size: int, batch: str) -> None:
    q_lens = None if batch == "decode" else [30, 1]
    check(make_case([70, 9], q_lens, block_size=block_size, dtype=torch.bfloat16))


@pytest.mark.parametrize("layout", ["nhd", "padded"])
@pytest.mark.parametrize("batch", ["decode", "varlen"])
def test_strided_caches(layout: str, batch: str) -> None:
    q_lens = None if batch == "decode" else [6, 3]
    check(make_case([23, 40], q_lens, layout=layout, block_size=8))


def test_varlen_batch_kinds() -> None:
    """Prefill (q_len == seq_len), chunked prefill over a cached prefix, decode, several queries
    per sequence and an empty sequence (q_len 0), in one launch; long enough for several query
    tiles per sequence."""
    seq_lens = [70, 90, 33, 12, 5]
    q_lens = [70, 40, 1, 4, 0]
    check(make_case(seq_lens, q_lens, heads=(8, 2), dtype=torch.float16))


@pytest.mark.parametrize("feature", ["sliding_window", "soft_cap", "alibi", "all"])
@pytest.mark.parametrize("batch", ["decode", "varlen"])
def test_features(feature: str, batch: str) -> None:
    q_lens = None if batch == "decode" else [25, 3, 1]
    case = make_case([90, 40, 13], q_lens, heads=(6, 2), layout="padded")
    kwargs: dict = {}
    if feature in ("sliding_window", "all"):
        kwargs["sliding_window"] = 19
    if feature in ("soft_cap", "all"):
        kwargs["soft_cap"] = 1.5
    if feature in ("alibi", "all"):
        kwargs["alibi_slopes"] = slopes(6)
    check(case, scale=0.3, **kwargs)


def test_window_skips_blocks_outside_it() -> None:
    """Blocks wholly before the window are never read: pointing them at NaN blocks changes
    nothing (a read of their V would turn the output into NaN)."""
    case = make_case([100, 64], None, block_size=8)
    want, want_lse = run(case, sliding_window=9)
    used = {int(b) for s, n in enumerate([100, 64]) for b in case.block_tables[s, :-(-n // 8)]}
    nan_block = min(set(range(case.key_cache.shape[0])) - used)  # a spare block: all NaN
    assert torch.isnan(case.key_cache[nan_block]).all()
    table = case.block_tables.clone()
    table[0, :11] = nan_block  # positions 0..87; the window of position 99 starts at 91
    table[1, :6] = nan_block  # positions 0..47; the window of position 63 starts at 55
    case.block_tables = table
    got, lse = run(case, sliding_window=9)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("batch", ["decode", "varlen"])
def test_out_with_strides(batch: str) -> None:
    """`out=` may be a strided view; only its elements are written."""
    q_lens = None if batch == "decode" else [3, 2]
    case = make_case([17, 30], q_lens, heads=(4, 2))
    backing = torch.full((case.query.shape[0], 4, 2 * 32), 7.0, device=DEVICE)
    out = backing[:, :, :32]
    check(case, out=out)
    assert (backing[:, :, 32:] == 7.0).all()


@pytest.mark.parametrize("split_size", [64, 128])
@pytest.mark.parametrize("feature", ["none", "sliding_window", "alibi"])
def test_split_k_matches_one_split_and_oracle(fixed_split, split_size: int, feature: str) -> None:
    """Forced splits (several per sequence) agree with one split and with the oracle."""
    case = make_case([300, 130, 5], None, heads=(8, 2), block_size=16)
    kwargs: dict = {}
    if feature == "sliding_window":
        kwargs["sliding_window"] = 150
    if feature == "alibi":
        kwargs["alibi_slopes"] = slopes(8)
    fixed_split(split_size)
    p = pk.abi.check_attention_args(case.query, case.key_cache, case.value_cache,
                                    case.block_tables, case.seq_lens)
    assert decode.plan_splits(p, 64)[1] > 2  # several splits are really used
    split_out, split_lse = check(case, **kwargs)
    fixed_split(10**6)
    one_out, one_lse = check(case, **kwargs)
    tol = TOL[torch.float32]
    torch.testing.assert_close(split_out, one_out, atol=tol, rtol=tol)
    torch.testing.assert_close(split_lse, one_lse, atol=1e-5, rtol=1e-5)


def test_split_k_heuristic_path() -> None:
    """One sequence and one KV head leave most SMs idle: the heuristic splits the context."""
    case = make_case([600], None, heads=(4, 1), dtype=torch.bfloat16)
    p = pk.abi.check_attention_args(case.query, case.key_cache, case.value_cache,
                                    case.block_tables, case.seq_lens)
    assert decode.plan_splits(p, 64)[1] > 1
    check(case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fixed_split_is_batch_invariant(fixed_split, dtype: torch.dtype) -> None:
    """With a fixed split size a sequence's result is bitwise the same alone or in a batch with
    other sequences (which changes the grid, the table width and the number of splits)."""
    fixed_split(64)
    big = make_case([200, 37, 300, 5], None, heads=(8, 2), dtype=dtype, seed=3)
    alone = make_case([37], None, heads=(8, 2), dtype=dtype, seed=3, extra_table=0)
    # the same sequence: copy its K/V and query from the batch into the single-sequence case
    alone.query = big.query[1:2].clone()
    for b in range(-(-37 // 16)):
        alone.key_cache[alone.block_tables[0, b]] = big.key_cache[big.block_tables[1, b]]
        alone.value_cache[alone.block_tables[0, b]] = big.value_cache[big.block_tables[1, b]]
    out_big, lse_big = run(big)
    out_alone, lse_alone = run(alone)
    assert torch.equal(out_big[1:2], out_alone) and torch.equal(lse_big[1:2], lse_alone)


def test_varlen_is_batch_invariant() -> None:
    """Query tiles start at each sequence's first query, so batching does not change results."""
    big = make_case([50, 37], [20, 37], dtype=torch.bfloat16, seed=5)
    alone = make_case([37], [37], dtype=torch.bfloat16, seed=5)
    alone.query = big.query[20:].clone()
    for b in range(-(-37 // 16)):
        alone.key_cache[alone.block_tables[0, b]] = big.key_cache[big.block_tables[1, b]]
        alone.value_cache[alone.block_tables[0, b]] = big.value_cache[big.block_tables[1, b]]
    out_big, lse_big = run(big)
    out_alone, lse_alone = run(alone)
    assert torch.equal(out_big[20:], out_alone) and torch.equal(lse_big[20:], lse_alone)


def test_interpreter_workaround_only_under_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 operands are upcast before tl.dot only in the interpreter; the GPU path keeps the
    native bf16 dot (and fp16/fp32 are never upcast)."""
    case = make_case([5], None, dtype=torch.bfloat16)
    p = pk.abi.check_attention_args(case.query, case.key_cache, case.value_cache,
                                    case.block_tables, case.seq_lens)
    assert runtime.kernel_flags(p)["UPCAST"] == runtime.interpreting()
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    assert runtime.kernel_flags(p)["UPCAST"] is False
    case16 = make_case([5], None, dtype=torch.float16)
    p16 = pk.abi.check_attention_args(case16.query, case16.key_cache, case16.value_cache,
                                      case16.block_tables, case16.seq_lens)
    monkeypatch.setattr(runtime, "interpreting", lambda: True)
    assert runtime.kernel_flags(p16)["UPCAST"] is False
    assert runtime.kernel_flags(p16)["IEEE"] is False


def test_lse_merges_with_merge_attn_states() -> None:
    """The returned lse is the ABI's natural-log log-sum-exp: attention over keys [0, 32)
    (seq_len 32) merged with attention over [32, 40) (seq_len 40, window 8) is the full result."""
    case = make_case([40], None, dtype=torch.float32)
    full, full_lse = run(case)
    tail, tail_lse = run(case, sliding_window=8)
    case.seq_lens = torch.tensor([32], dtype=torch.int32, device=DEVICE)
    head, head_lse = run(case)
    merged, merged_lse = pk.merge_attn_states(head, head_lse, tail, tail_lse)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, full_lse, atol=1e-5, rtol=1e-5)


def test_varlen_kernel_finds_sequences_across_many_tiles() -> None:
    """Many short and empty sequences: the binary search over cu_seqlens_q maps each query tile
    to its sequence (a wrong mapping would leave NaN rows or mix sequences)."""
    seq_lens = [3, 0, 1, 18, 0, 7, 2, 40, 1, 1]
    q_lens = [3, 0, 1, 17, 0, 2, 2, 33, 0, 1]
    check(make_case(seq_lens, q_lens, heads=(2, 1), head_size=16, block_size=8))


@pytest.mark.parametrize("split_size", [None, 64])
def test_decode_empty_sequence_writes_zero(fixed_split, split_size: Optional[int]) -> None:
    """seq_len 0 in decode is outside the ABI (content checks reject it), but unchecked it still
    writes every element: out 0 and lse -inf, with one split or several."""
    fixed_split(split_size)
    case = make_case([0, 200], None)
    out, lse = run(case)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("batch", ["decode", "varlen"])
def test_strided_index_tensors(batch: str) -> None:
    """Block tables, lengths, cu_seqlens_q and ALiBi slopes may be strided views (the ABI fixes
    their dtype and shape only)."""
    q_lens = None if batch == "decode" else [5, 2]
    case = make_case([21, 34], q_lens, heads=(4, 2))
    want, want_lse = run(case, alibi_slopes=slopes(4))
    case.block_tables = case.block_tables.t().contiguous().t()  # column-major
    case.seq_lens = torch.stack([case.seq_lens, -case.seq_lens], 1)[:, 0]  # stride 2
    if case.cu_seqlens_q is not None:
        case.cu_seqlens_q = torch.stack([case.cu_seqlens_q] * 3, 1)[:, 1]
    strided_slopes = torch.stack([slopes(4)] * 2, 1)[:, 0]
    assert not case.block_tables.is_contiguous() and not case.seq_lens.is_contiguous()
    got, lse = run(case, alibi_slopes=strided_slopes)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
