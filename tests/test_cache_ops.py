"""write_kv, copy_blocks, swap_blocks and merge_attn_states, on every available backend."""

from __future__ import annotations

import math

import pytest
import torch

import paged_kernels as pk
from oracle import attention_oracle, rel_error
from paged_case import make_case
from test_conformance import backend_device

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=pk.registered_backends())
def backend(request) -> str:
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nhd", [False, True], ids=["hnd", "nhd"])
def test_write_kv_scatters_and_skips_negative_slots(backend, dtype, nhd):
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(0)
    num_blocks, heads, block_size, head_size, n = 6, 2, 8, 64, 20
    shape = (num_blocks, block_size, heads, head_size) if nhd else \
        (num_blocks, heads, block_size, head_size)
    caches = [torch.full(shape, math.nan, dtype=dtype, device=device) for _ in range(2)]
    views = [c.permute(0, 2, 1, 3) if nhd else c for c in caches]
    key = torch.randn(n, heads, head_size, generator=gen).to(dtype).to(device)
    value = torch.randn(n, heads, head_size, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[::4] = -1
    pk.write_kv(key, value, views[0], views[1], slots.to(device), backend=backend)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        b, o = divmod(slot, block_size)
        assert torch.equal(views[0][b, :, o].cpu(), key[i].cpu())
        assert torch.equal(views[1][b, :, o].cpu(), value[i].cpu())
    untouched = views[0].permute(0, 2, 1, 3).reshape(-1, heads, head_size)[~written]
    assert torch.isnan(untouched.float()).all(), "write_kv wrote a slot it was not given"


def test_write_then_attend_matches_oracle(backend):
    """The engine's path: write each token's K/V through slot_mapping, then attend."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_size, block_size, seq_len = 4, 2, 64, 16, 37
    cache = [torch.full((8, kv_heads, block_size, head_size), math.nan, device=device)
             for _ in range(2)]
    blocks = [5, 0, 3]
    keys = torch.randn(seq_len, kv_heads, head_size, generator=gen)
    values = torch.randn(seq_len, kv_heads, head_size, generator=gen)
    pos = torch.arange(seq_len)
    slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
    pk.write_kv(keys.to(device), values.to(device), *cache, slots.to(device), backend=backend)
    q = torch.randn(seq_len, heads, head_size, generator=gen)
    supported = pk.get_backend(backend).support.unsupported(
        torch.float32, head_size, block_size, frozenset({"varlen"}), device)
    if supported is not None:
        pytest.skip(supported)
    out = pk.paged_attention(q.to(device), *cache, torch.tensor([blocks], dtype=torch.int32,
                                                                device=device),
                             torch.tensor([seq_len], dtype=torch.int32, device=device),
                             cu_seqlens_q=torch.tensor([0, seq_len], dtype=torch.int32,
                                                       device=device), backend=backend)
    ref, _ = attention_oracle(q, [keys], [values], [seq_len])
    assert rel_error(out, ref) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_every_layer(backend, dtype):
    device = backend_device(backend)
    layers = [[torch.randn(6, 2, 4, 8).to(dtype).to(device) for _ in range(3)] for _ in range(2)]
    before = [[c.clone() for c in kind] for kind in layers]
    mapping = torch.tensor([[0, 5], [2, 1]], device=device)
    pk.copy_blocks(layers[0], layers[1], mapping, backend=backend)
    for kind, old in zip(layers, before):
        for cache, prev in zip(kind, old):
            assert torch.equal(cache[5], prev[0]) and torch.equal(cache[1], prev[2])
            keep = [0, 2, 3, 4]
            assert torch.equal(cache[keep], prev[keep])


def test_swap_blocks_round_trip(backend):
    device = backend_device(backend)
    src = torch.randn(6, 2, 4, 8, device=device)
    host = torch.full((4, 2, 4, 8), math.nan)
    pk.swap_blocks(src, host, torch.tensor([[4, 0], [1, 3]]), backend=backend)
    back = torch.full_like(src, math.nan)
    pk.swap_blocks(host, back, torch.tensor([[0, 2], [3, 5]]), backend=backend)
    assert torch.equal(back[2], src[4]) and torch.equal(back[5], src[1])
    assert torch.isnan(back[[0, 1, 3, 4]]).all()


EIGHT_BIT = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=str)
def test_copy_and_swap_8bit_blocks_as_bytes(backend, dtype):
    """8-bit caches (random bytes, NaN codes included) copy and swap unchanged, byte for byte."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(3)

    def random_cache(num_blocks):
        return torch.randint(0, 256, (num_blocks, 2, 4, 8), generator=gen,
                             dtype=torch.uint8).to(device).view(dtype)

    layers = [[random_cache(6) for _ in range(2)] for _ in range(2)]
    before = [[c.view(torch.uint8).clone() for c in kind] for kind in layers]
    pk.copy_blocks(layers[0], layers[1], torch.tensor([[0, 5], [2, 1]], device=device),
                   backend=backend)
    for kind, old in zip(layers, before):
        for cache, prev in zip(kind, old):
            data = cache.view(torch.uint8)
            assert torch.equal(data[5], prev[0]) and torch.equal(data[1], prev[2])
            assert torch.equal(data[[0, 2, 3, 4]], prev[[0, 2, 3, 4]])
    src = layers[0][0]
    host = random_cache(4).cpu()
    pk.swap_blocks(src, host, torch.tensor([[4, 0], [1, 3]]), backend=backend)
    back = torch.zeros(src.shape, dtype=torch.uint8, device=device).view(dtype)
    pk.swap_blocks(host, back, torch.tensor([[0, 2], [3, 5]]), backend=backend)
    got, want = back.view(torch.uint8), src.view(torch.uint8)
    assert torch.equal(got[2], want[4]) and torch.equal(got[5], want[1])
    assert not got[[0, 1, 3, 4]].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_equals_attention_over_union(dtype):
    """Attention over a prefix and a suffix of the keys, merged, equals attention over all."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(50, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(50, 2, 16, generator=gen, dtype=torch.float64)

    def part(lo, hi):
        # all three queries see keys lo..hi-1 (non-causal partial attention)
        s = torch.einsum("thd,khd->thk", q, k[lo:hi].repeat_interleave(2, dim=1))
        s = s / 4.0
        lse = torch.logsumexp(s, -1)
        out = torch.einsum("thk,khd->thd", torch.softmax(s, -1),
                           v[lo:hi].repeat_interleave(2, dim=1))
        return out.to(dtype), lse.float()

    full_out, full_lse = part(0, 50)
    out, lse = pk.merge_attn_states(*part(0, 17), *part(17, 50))
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_error(out, full_out) <= tol and rel_error(lse, full_lse) <= 1e-6


def test_merge_with_empty_side():
    out = torch.randn(2, 3, 8)
    lse = torch.randn(2, 3)
    empty_out = torch.full_like(out, math.nan)
    empty_lse = torch.full_like(lse, -math.inf)
    merged, merged_lse = pk.merge_attn_states(out, lse, empty_out, empty_lse)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)


def test_split_context_merge_matches_paged_attention():
    """Decode attention over blocks [0, 2) and [2, 4) of a sequence (each as its own sequence,
    whose last position sees all its keys), merged by lse, equals attention over all 4 blocks."""
    case = make_case([64], None, num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                     dtype=torch.float32, seed=4)
    args = (case.query, case.key_cache, case.value_cache)
    half = torch.tensor([32], dtype=torch.int32)
    first = pk.paged_attention(*args, case.block_tables[:, :2].contiguous(), half,
                               return_lse=True)
    second = pk.paged_attention(*args, case.block_tables[:, 2:4].contiguous(), half,
                                return_lse=True)
    merged, merged_lse = pk.merge_attn_states(*first, *second)
    ref, ref_lse = attention_oracle(case.query, case.keys, case.values, case.q_lens)
    assert rel_error(merged, ref) <= 1e-5 and rel_error(merged_lse, ref_lse) <= 1e-5
