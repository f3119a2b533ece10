"""The CUDA kernels (cuda/csrc) run by the host emulator, as backend "cuda-host".

Checked against the float64 dense oracle of tests/oracle.py (no code shared with the kernels or
the reference backend) on cases from tests/paged_case.py: NaN in every cache slot and block that
must not be read (unused block-table entries name a NaN block), shuffled block tables, GQA/MQA,
decode with forced split-K partitions, varlen on the mma (f16, bf16) and SIMT (f32) kernels,
every feature. Beyond values, the emulator checks the kernels'
synchronisation: a kernel without data races gives bit-identical results whatever order the
threads run in between barriers, so each kernel is run under the forward, reverse and random
schedules (PK_HOST_SCHEDULE) and the outputs must be equal to the bit.
"""

from __future__ import annotations

import math

import paged_case
import pytest
import torch
from oracle import attention_oracle, rel_error
from paged_case import PagedCase

import paged_kernels as pk
from paged_kernels.abi import check_attention_args

BACKEND = "cuda-host"


@pytest.fixture(scope="module", autouse=True)
def _available():
    if BACKEND not in pk.available_backends():
        pytest.skip(f"{BACKEND} unavailable: {pk.unavailable_backends().get(BACKEND)}")


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def make_case(seq_lens: list[int], q_lens: list[int] | None, *, heads: int, kv_heads: int,
              strided: bool = False, **kwargs) -> PagedCase:
    """A tests/paged_case.py case whose block-table entries past a sequence's blocks point at a
    NaN block, so reading one would show in the result; `strided` stores the cache NHD."""
    return paged_case.make_case(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads,
                                nhd=strided, table_pad="nan_block", **kwargs)


def run(case: PagedCase, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = torch.full_like(case.query, math.nan)
    result = pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out,
                                backend=BACKEND, **kwargs)
    if kwargs.get("return_lse"):
        assert result[0] is out
        return out, result[1]
    assert result is out
    return out, None


def check(case: PagedCase, dtype: torch.dtype, **kwargs) -> None:
    out, lse = run(case, return_lse=True, **kwargs)
    want, want_lse = attention_oracle(case.query, case.keys, case.values, case.q_lens, **kwargs)
    assert not torch.isnan(out).any()
    assert rel_error(out, want) <= TOL[dtype], rel_error(out, want)
    assert rel_error(lse, want_lse) <= TOL[dtype], rel_error(lse, want_lse)


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["mma", "simt"])
@pytest.mark.parametrize("head_size,block_size", [(80, 24), (256, 8), (112, 64)])
def test_decode_kernels_head_and_block_sizes(monkeypatch, dtype, head_size, block_size):
    """Both decode kernels (mma for 16-bit types, SIMT for float32) on head sizes that are not
    powers of two or that reload Q per tile, block sizes that are not powers of two, a partial
    last K/V tile, a GQA group of 32 (two mma row chunks), split-K, and every feature."""
    monkeypatch.setenv("PAGED_KERNELS_CUDA_PARTITION", "64")
    slopes = torch.tensor([2.0 ** (-(h % 8 + 1)) for h in range(32)], dtype=torch.float32)
    case = make_case([1, 64, 65, 150], None, heads=32, kv_heads=1, head_size=head_size,
                     block_size=block_size, dtype=dtype, seed=head_size, strided=True)
    check(case, dtype)
    check(case, dtype, sliding_window=70, soft_cap=4.0, alibi_slopes=slopes)


@pytest.mark.parametrize("sync,prefetch", [("block", "0"), ("warp", "0"), ("block", "1")])
@pytest.mark.parametrize("stages", ["2", "3", "4"])
def test_decode_mma_ring_depths(monkeypatch, stages, sync, prefetch):
    """The mma decode kernel with every K/V ring depth (PAGED_KERNELS_CUDA_DECODE_STAGES) on
    partitions of up to 5 tiles, the last one partial, with the block or each warp waiting for
    its tiles (PAGED_KERNELS_CUDA_DECODE_SYNC), and with the L2 prefetch of the rows an
    iteration ahead (PAGED_KERNELS_CUDA_DECODE_PREFETCH: the emulator checks its alignment and
    size and reads both ends of every prefetched range)."""
    monkeypatch.setenv("PAGED_KERNELS_CUDA_DECODE_STAGES", stages)
    monkeypatch.setenv("PAGED_KERNELS_CUDA_DECODE_SYNC", sync)
    monkeypatch.setenv("PAGED_KERNELS_CUDA_DECODE_PREFETCH", prefetch)
    monkeypatch.setenv("PAGED_KERNELS_CUDA_PARTITION", "320")
    case = make_case([700, 129, 64, 2], None, heads=8, kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.bfloat16, seed=int(stages))
    check(case, torch.bfloat16)


#: kernel -> (dtype, query tokens, forced settings) for the int64-offset test
OFFSET_KERNELS = {
    "decode-mma": (torch.bfloat16, 1, {}),
    "decode-mma-tile32": (torch.bfloat16, 1, {"PAGED_KERNELS_CUDA_DECODE_TILE": "32"}),
    "decode-mma-warp-sync": (torch.bfloat16, 1, {"PAGED_KERNELS_CUDA_DECODE_SYNC": "warp"}),
    "decode-mma-l2-prefetch": (torch.bfloat16, 1, {"PAGED_KERNELS_CUDA_DECODE_PREFETCH": "1"}),
    "decode-simt": (torch.float32, 1, {}),
    "varlen-async": (torch.float16, 3, {}),
    "varlen-async-8-warps": (torch.float16, 3, {"PAGED_KERNELS_CUDA_VARLEN_WARPS": "8"}),
}


@pytest.mark.parametrize("kernel", OFFSET_KERNELS)
def test_cache_offsets_past_int32(monkeypatch, kernel):
    """A cache whose block stride puts block 2 at element 2^32 + 2048 (every decode and 16-bit
    varlen kernel): offsets computed in 32 bits would wrap to the wrong rows. The storage is
    allocated but only the three blocks are touched (untouched pages are never committed);
    slots past seq_len are NaN."""
    dtype, q_len, env = OFFSET_KERNELS[kernel]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kv, bs, d, seq_len = 2, 16, 64, 27
    stride = 2 ** 31 + 1024
    g = torch.Generator().manual_seed(11)
    views, dense = [], []
    for _ in range(2):  # K, V
        storage = torch.empty(2 * stride + kv * bs * d, dtype=dtype)
        view = storage.as_strided((3, kv, bs, d), (stride, bs * d, d, 1))
        data = torch.randn(3, kv, bs, d, generator=g).to(dtype)
        data[1, :, seq_len - bs:] = math.nan  # block 1 holds positions 16..31
        view.copy_(data)
        views.append(view)
        dense.append(torch.cat([data[2], data[1]], dim=1)[:, :seq_len].transpose(0, 1))
    q = torch.randn(q_len, 8, d, generator=g).to(dtype)
    cu = None if q_len == 1 else torch.tensor([0, q_len], dtype=torch.int32)
    out = pk.paged_attention(q, views[0], views[1], torch.tensor([[2, 1]], dtype=torch.int32),
                             torch.tensor([seq_len], dtype=torch.int32), cu_seqlens_q=cu,
                             backend=BACKEND)
    want, _ = attention_oracle(q, [dense[0]], [dense[1]], [q_len])
    assert rel_error(out, want) <= TOL[dtype]


@pytest.mark.parametrize("tile,sync,prefetch", [("32", "block", "0"), ("32", "warp", "0"),
                                                ("64", "warp", "0"), ("32", "block", "1"),
                                                ("64", "block", "1")])
@pytest.mark.parametrize("stages", ["2", "3", "4"])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (80, 24), (256, 8)])
def test_decode_mma_tiles_and_syncs(monkeypatch, stages, head_size, block_size, tile, sync,
                                    prefetch):
    """The 2-warp, 32-key-tile decode kernel (PAGED_KERNELS_CUDA_DECODE_TILE=32), the
    warp-synchronised one (PAGED_KERNELS_CUDA_DECODE_SYNC=warp, both tiles) and the L2 prefetch
    (PAGED_KERNELS_CUDA_DECODE_PREFETCH=1, both tiles) at every ring depth:
    Q in the K ring's last slot (head sizes 64, 80) or in its own region (256), partial last
    tiles, several head chunks (a GQA group of 20), split-K, and every feature."""
    monkeypatch.setenv("PAGED_KERNELS_CUDA_DECODE_TILE", tile)
    monkeypatch.setenv("PAGED_KERNELS_CUDA_DECODE_SYNC", sync)
    monkeypatch.setenv("PAGED_KERNELS_CUDA_DECODE_PREFETCH", prefetch)
    monkeypatch.setenv("PAGED_KERNELS_CUDA_DECODE_STAGES", stages)
    monkeypatch.setenv("PAGED_KERNELS_CUDA_PARTITION", "160")
    slopes = torch.tensor([2.0 ** (-(h % 8 + 1)) for h in range(20)], dtype=torch.float32)
    case = make_case([1, 31, 33, 170], None, heads=20, kv_heads=1, head_size=head_size,
                     block_size=block_size, dtype=torch.bfloat16, seed=head_size + int(stages),
                     strided=True)
    check(case, torch.bfloat16)
    check(case, torch.bfloat16, sliding_window=90, soft_cap=4.0, alibi_slopes=slopes)


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


#: The 16-bit varlen kernel's warps (PAGED_KERNELS_CUDA_VARLEN_WARPS)
VARLEN_KERNELS = {"async": "4", "async-8-warps": "8"}


@pytest.mark.parametrize("kernel,head_size,block_size", [
    ("async", 112, 32), ("async", 128, 24), ("async", 192, 8), ("async-8-warps", 112, 32),
    ("async-8-warps", 192, 8)])
def test_varlen_mma_kernels_long_contexts(monkeypatch, kernel, head_size, block_size):
    """The 16-bit varlen kernel (4 or 8 warps) over 3-6 K/V tiles per block (the ring wraps
    several times; 64-key tiles up to head size 128, 32-key ones above; at 112 a tile is not a
    whole number of passes of 8 warps' copies), a chunk on a cached prefix, a prefill
    longer than one block's rows, decodes, a GQA group of 3, the window and every feature."""
    monkeypatch.setenv("PAGED_KERNELS_CUDA_VARLEN_WARPS", VARLEN_KERNELS[kernel])
    slopes = torch.tensor([2.0 ** (-(h + 1)) for h in range(6)], dtype=torch.float32)
    case = make_case([300, 150, 97, 1], [20, 150, 1, 1], heads=6, kv_heads=2,
                     head_size=head_size, block_size=block_size, dtype=torch.float16,
                     seed=head_size, strided=True)
    check(case, torch.float16)
    check(case, torch.float16, sliding_window=100, soft_cap=4.0, alibi_slopes=slopes)


@pytest.mark.parametrize("window", [None, 32, 33])
@pytest.mark.parametrize("head_size,warps", [(64, "4"), (192, "4"), (192, "8")])  # 64/32-key tiles
def test_varlen_async_masks_at_tile_edges(monkeypatch, warps, window, head_size):
    """Query rows whose positions fall one before, on and one after the last key of a K/V tile
    (both tile sizes), with windows whose start falls on a tile's first key: where every row of
    a block sees a whole tile the kernel skips the per-key masks, so an off-by-one there shows."""
    monkeypatch.setenv("PAGED_KERNELS_CUDA_VARLEN_WARPS", warps)
    seq_lens = [31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 160]
    q_lens = [1, 1, 2, 1, 2, 3, 1, 33, 2, 64, 1, 3, 97]
    case = make_case(seq_lens, q_lens, heads=2, kv_heads=1, head_size=head_size, block_size=16,
                     dtype=torch.float16, seed=window or 0)
    check(case, torch.float16, sliding_window=window)


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
    want, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens, scale=1 / 8)
    assert rel_error(out, want) <= TOL[torch.float16]
    assert torch.isnan(storage[:, :, :64]).all() and torch.isnan(storage[:, :, 128:]).all()


# ---- synchronisation: results independent of the thread schedule ----

@pytest.mark.parametrize("kind", ["decode-mma-split", "decode-mma-tile32-split",
                                  "decode-mma-warp-sync-split",
                                  "decode-mma-tile32-warp-sync-split", "decode-simt-split",
                                  "varlen-mma", "varlen-mma-8-warps", "varlen-simt"])
def test_results_bit_identical_under_every_schedule(monkeypatch, kind):
    monkeypatch.setenv("PAGED_KERNELS_CUDA_PARTITION", "32" if kind == "decode-simt-split"
                       else "128")
    if "tile32" in kind:
        monkeypatch.setenv("PAGED_KERNELS_CUDA_DECODE_TILE", "32")
    if "warp-sync" in kind:
        monkeypatch.setenv("PAGED_KERNELS_CUDA_DECODE_SYNC", "warp")
    if kind == "varlen-mma-8-warps":
        monkeypatch.setenv("PAGED_KERNELS_CUDA_VARLEN_WARPS", "8")
    dtype = torch.float32 if "simt" in kind else torch.bfloat16
    decode = kind.startswith("decode")
    # varlen mma: up to 4 tiles of 64 keys per block, so the cp.async ring wraps under every
    # schedule (the SIMT kernel, slow here, keeps the short mixed batch)
    long_varlen = kind.startswith("varlen-mma")
    q_lens = None if decode else [19, 5, 1, 1, 70] if long_varlen else MIXED[1]
    seq_lens = ([300, 90, 33, 1] if decode else [200, 39, 1, 17, 70] if long_varlen
                else MIXED[0])
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
    from cuda.paged_cuda import host_build, launch, params, planner

    ext = host_build.host_module()
    case = make_case([5], None, heads=2, kv_heads=1, head_size=64, block_size=16,
                     dtype=torch.float32)
    p = check_attention_args(case.query, case.key_cache, case.value_cache, case.block_tables,
                             case.seq_lens)
    plan = planner.plan_attention(p, 132)
    values = launch.attn_values(p, plan, p.query, p.key_cache, p.value_cache, p.out, None)
    values["threads"] = 2048
    with pytest.raises(RuntimeError, match="1 to 1024 threads"):
        ext.paged_attention(params.pack("attn", values), 0)


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
