"""The CUDA kernels (cuda/csrc) run by the host emulator, as backend "cuda-host".

Checked against a float64 dense oracle written here (no code shared with the kernels, the
reference backend or tests/oracle.py): NaN in every cache slot and block that must not be read,
shuffled block tables, GQA/MQA, decode with forced split-K partitions, varlen on the mma (f16,
bf16) and SIMT (f32) kernels, every feature. Beyond values, the emulator checks the kernels'
synchronisation: a kernel without data races gives bit-identical results whatever order the
threads run in between barriers, so each kernel is run under the forward, reverse and random
schedules (PK_HOST_SCHEDULE) and the outputs must be equal to the bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import paged_kernels as pk
from paged_kernels.abi import check_attention_args

BACKEND = "cuda-host"


@pytest.fixture(scope="module", autouse=True)
def _available():
    if BACKEND not in pk.available_backends():
        pytest.skip(f"{BACKEND} unavailable: {pk.unavailable_backends().get(BACKEND)}")


# ---- the oracle ----

def oracle(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
           q_lens: list[int], scale: float, window: Optional[int] = None,
           soft_cap: Optional[float] = None, slopes: Optional[torch.Tensor] = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention in float64: each sequence's queries are its last q_len positions."""
    num_heads = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    row = 0
    for k, v, q_len in zip(keys, values, q_lens):
        length, group = k.shape[0], num_heads // k.shape[1]
        k64, v64 = k.double(), v.double()
        for i in range(q_len):
            pos = length - q_len + i
            key_pos = torch.arange(length, dtype=torch.float64)
            mask = key_pos <= pos
            if window is not None:
                mask &= key_pos > pos - window
            for h in range(num_heads):
                s = (k64[:, h // group] @ q[row, h].double()) * scale
                if soft_cap is not None:
                    s = soft_cap * torch.tanh(s / soft_cap)
                if slopes is not None:
                    s = s + float(slopes[h]) * (key_pos - pos)
                s = s.masked_fill(~mask, -math.inf)
                lse[row, h] = torch.logsumexp(s, 0)
                out[row, h] = torch.softmax(s, 0) @ v64[:, h // group]
            row += 1
    return out, lse


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


# ---- paged cases ----

@dataclass
class Case:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    q_lens: list[int]


def make_case(seq_lens: list[int], q_lens: Optional[list[int]], *, heads: int, kv_heads: int,
              head_size: int, block_size: int, dtype: torch.dtype, seed: int = 0,
              strided: bool = False) -> Case:
    """Random K/V scattered into shuffled blocks of NaN-filled caches. Table entries past a
    sequence's blocks point at a NaN block, so reading one would show in the result."""
    g = torch.Generator().manual_seed(seed)
    blocks_of = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_of) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    spare = order.pop()  # never written: all NaN
    shape = (num_blocks, block_size, kv_heads, head_size) if strided else \
        (num_blocks, kv_heads, block_size, head_size)
    caches = [torch.full(shape, math.nan, dtype=dtype) for _ in range(2)]
    if strided:  # [blocks, slots, heads, dim] viewed as [blocks, heads, slots, dim]
        caches = [c.permute(0, 2, 1, 3) for c in caches]
    width = max(blocks_of) + 2
    table = torch.full((len(seq_lens), width), spare, dtype=torch.int32)
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, head_size, generator=g).to(dtype)
        for b in range(blocks_of[s]):
            blk = order.pop()
            table[s, b] = blk
            rows = slice(b * block_size, min(n, (b + 1) * block_size))
            caches[0][blk, :, : rows.stop - rows.start] = k[rows].transpose(0, 1)
            caches[1][blk, :, : rows.stop - rows.start] = v[rows].transpose(0, 1)
        keys.append(k)
        values.append(v)
    lens = q_lens if q_lens is not None else [1] * len(seq_lens)
    query = torch.randn(sum(lens), heads, head_size, generator=g).to(dtype)
    cu = None
    if q_lens is not None:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Case(query, caches[0], caches[1], table, torch.tensor(seq_lens, dtype=torch.int32),
                cu, keys, values, lens)


def run(case: Case, **kwargs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    out = torch.full_like(case.query, math.nan)
    result = pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out,
                                backend=BACKEND, **kwargs)
    if kwargs.get("return_lse"):
        assert result[0] is out
        return out, result[1]
    assert result is out
    return out, None


def check(case: Case, dtype: torch.dtype, **kwargs) -> None:
    out, lse = run(case, return_lse=True, **kwargs)
    scale = kwargs.get("scale") or 1.0 / math.sqrt(case.query.shape[2])
    want, want_lse = oracle(case.query, case.keys, case.values, case.q_lens, scale,
                            kwargs.get("sliding_window"), kwargs.get("soft_cap"),
                            kwargs.get("alibi_slopes"))
    assert not torch.isnan(out).any()
    assert rel_err(out, want) <= TOL[dtype], rel_err(out, want)
    assert rel_err(lse, want_lse) <= TOL[dtype], rel_err(lse, want_lse)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DECODE_LENS = [1, 16, 17, 53, 130]
MIXED = ([19, 39, 1, 17, 40], [19, 5, 1, 1, 3])  # prefill, chunked, decodes, a 3-token verify


# ---- decode ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (8, 1)], ids=["gqa4", "mha", "mqa8"])
def test_decode(dtype, heads):
    case = make_case(DECODE_LENS, None, heads=heads[0], kv_heads=heads[1], head_size=64,
                     block_size=16, dtype=dtype, seed=1)
    check(case, dtype)


@pytest.mark.parametrize("partition", ["16", "48"])
def test_decode_split_k(monkeypatch, partition):
    """Forced small partitions: several splits per sequence, some empty (the window), merged
    by the reduce kernel through their log-sum-exp."""
    monkeypatch.setenv("PAGED_KERNELS_CUDA_PARTITION", partition)
    case = make_case([200, 33, 1, 64], None, heads=8, kv_heads=2, head_size=128, block_size=8,
                     dtype=torch.bfloat16, seed=2)
    check(case, torch.bfloat16)
    check(case, torch.bfloat16, sliding_window=40, soft_cap=5.0)


def test_decode_group_tiles():
    """GQA groups of 3 and 16 heads: partial group tiles and several head chunks per KV head."""
    for heads, kv in [(6, 2), (16, 1)]:
        case = make_case([9, 70], None, heads=heads, kv_heads=kv, head_size=64, block_size=32,
                         dtype=torch.float16, seed=heads)
        check(case, torch.float16)


# ---- varlen (mma for 16-bit types, SIMT for float32) ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 256])
def test_varlen_mixed_batch(dtype, head_size):
    case = make_case(*MIXED, heads=8, kv_heads=2, head_size=head_size, block_size=16,
                     dtype=dtype, seed=head_size)
    check(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_long_prefill_many_tiles(dtype):
    """More query rows than one block's tile (64 mma rows / 16 SIMT rows) and several K/V tiles."""
    case = make_case([70, 45], [70, 12], heads=4, kv_heads=1, head_size=64, block_size=8,
                     dtype=dtype, seed=5)
    check(case, dtype)


# ---- features ----

@pytest.mark.parametrize("dtype", DTYPES)
def test_all_features_strided_caches(dtype):
    slopes = torch.tensor([2.0 ** (-(h + 1)) for h in range(8)], dtype=torch.float32)
    for q_lens in (None, MIXED[1]):
        seq_lens = DECODE_LENS if q_lens is None else MIXED[0]
        case = make_case(seq_lens, q_lens, heads=8, kv_heads=2, head_size=64, block_size=16,
                         dtype=dtype, seed=7, strided=True)
        check(case, dtype, sliding_window=11, soft_cap=3.0, alibi_slopes=slopes, scale=0.2)


def test_out_strided_and_only_out_written():
    case = make_case(*MIXED, heads=8, kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float16, seed=8)
    storage = torch.full((case.query.shape[0], 8, 3 * 64), math.nan, dtype=torch.float16)
    out = storage[:, :, 64:128]
    pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                       case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out, backend=BACKEND)
    want, _ = oracle(case.query, case.keys, case.values, case.q_lens, 1 / 8)
    assert rel_err(out, want) <= TOL[torch.float16]
    assert torch.isnan(storage[:, :, :64]).all() and torch.isnan(storage[:, :, 128:]).all()


# ---- synchronisation: results independent of the thread schedule ----

@pytest.mark.parametrize("kind", ["decode-split", "varlen-mma", "varlen-simt"])
def test_results_bit_identical_under_every_schedule(monkeypatch, kind):
    monkeypatch.setenv("PAGED_KERNELS_CUDA_PARTITION", "32")
    dtype = torch.float32 if kind == "varlen-simt" else torch.bfloat16
    q_lens = None if kind == "decode-split" else MIXED[1]
    seq_lens = [90, 33, 1] if kind == "decode-split" else MIXED[0]
    case = make_case(seq_lens, q_lens, heads=8, kv_heads=2, head_size=64, block_size=16,
                     dtype=dtype, seed=9)
    results = []
    for schedule, seed in [("forward", "0"), ("reverse", "0"), ("random", "1"), ("random", "2"),
                           ("warps", "1"), ("warps", "2"), ("warps", "3")]:
        monkeypatch.setenv("PK_HOST_SCHEDULE", schedule)
        monkeypatch.setenv("PK_HOST_SEED", seed)
        results.append(run(case, return_lse=True))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for out, lse in results[1:]:
        assert torch.equal(out.view(bits), results[0][0].view(bits))
        assert torch.equal(lse.view(torch.int32), results[0][1].view(torch.int32))


# ---- launch errors reach Python ----

def test_launch_error_is_a_runtime_error():
    """A plan the device would reject (2048 threads) fails in the emulator with its reason."""
    from cuda.paged_cuda import host_build, ops

    ext = host_build.host_module()
    case = make_case([5], None, heads=2, kv_heads=1, head_size=64, block_size=16,
                     dtype=torch.float32)
    p = check_attention_args(case.query, case.key_cache, case.value_cache, case.block_tables,
                             case.seq_lens)
    plan = ops.plan_attention(p, 132)
    values = ops._attn_values(p, plan, p.query, p.key_cache, p.value_cache, p.out, None)
    values["threads"] = 2048
    with pytest.raises(RuntimeError, match="1 to 1024 threads"):
        ext.paged_attention(ops.pack("attn", values), 0)


# ---- cache operations ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "2-byte-aligned"])
def test_write_kv_every_copy_unit(dtype, offset):
    """Offset 1 (element) makes rows only element-aligned, so the narrow copy units run."""
    g = torch.Generator().manual_seed(10)
    num_blocks, kv_heads, block_size, head_size, n = 5, 2, 8, 64, 12
    cache_k = torch.full((num_blocks, kv_heads, block_size, head_size), math.nan, dtype=dtype)
    cache_v = cache_k.clone()
    flat = torch.randn(n * kv_heads * head_size + offset, generator=g).to(dtype)
    key = flat[offset:].view(n, kv_heads, head_size)
    value = (key * 2).contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[3] = -1
    pk.write_kv(key, value, cache_k, cache_v, slots, backend=BACKEND)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(cache_k[slot // block_size, :, slot % block_size], key[i])
            assert torch.equal(cache_v[slot // block_size, :, slot % block_size], value[i])
    written = int((slots >= 0).sum()) * kv_heads * head_size
    assert int((~torch.isnan(cache_k.float())).sum()) == written


def test_copy_and_swap_blocks():
    g = torch.Generator().manual_seed(11)
    layers = [torch.randn(6, 2, 8, 64, generator=g).half() for _ in range(4)]
    before = [c.clone() for c in layers]
    mapping = torch.tensor([[0, 3], [5, 1]], dtype=torch.int64)
    pk.copy_blocks(layers[:2], layers[2:], mapping, backend=BACKEND)
    for c, b in zip(layers, before):
        expected = b.clone()
        expected[3], expected[1] = b[0], b[5]
        assert torch.equal(c, expected)
    src = torch.randn(4, 2, 8, 64, generator=g)
    dst = torch.zeros(7, 2, 8, 64)
    pk.swap_blocks(src, dst, torch.tensor([[2, 6], [0, 0]]), backend=BACKEND)
    assert torch.equal(dst[6], src[2]) and torch.equal(dst[0], src[0])
    assert not dst[1:6].any()


def test_concurrent_launches_from_host_threads():
    """The launchers release the GIL; each host thread has its own fibers and shared memory."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [make_case(*MIXED, heads=8, kv_heads=2, head_size=64, block_size=16,
                       dtype=dtype, seed=20 + i) for i, dtype in enumerate(DTYPES)]
    alone = [run(c)[0] for c in cases]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda c: run(c)[0], cases * 2))
    for got, want in zip(together, alone * 2):
        assert torch.equal(got, want)
