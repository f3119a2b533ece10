"""`paged_kernels.empty_cache` and `zeros_cache`: a KV cache tensor of the asked shape and dtype,
usable by every operation of the ABI, and on a Linux CPU with transparent huge pages in `madvise`
or `always` mode, backed by huge pages; `zeros_cache`'s reads zero with no page made resident
until written."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch

import paged_kernels as pk

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
@pytest.mark.parametrize("shape", [(3, 2, 16, 64), (0, 2, 16, 64), (1,)])
def test_shape_dtype_and_contiguity(shape, dtype):
    cache = pk.empty_cache(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.device == torch.device("cpu")
    cache.view(torch.uint8).fill_(0x3C)
    assert bool((cache.view(torch.uint8) == 0x3C).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("shape", [(3, 2, 16, 64), (0, 2, 16, 64), (1,)])
def test_zeros_cache_reads_zero(shape, dtype):
    cache = pk.zeros_cache(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert int(torch.count_nonzero(cache.view(torch.uint8))) == 0


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    return _smaps_field(address, "AnonHugePages")


def _smaps_field(address: int, field: str) -> int:
    text = Path("/proc/self/smaps").read_text()
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        start, end = (int(x, 16) for x in entry.split(" ", 1)[0].split("-"))
        if start <= address < end:
            return int(re.search(field + r":\s+(\d+) kB", entry).group(1))
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="zeros_cache is torch.zeros here")
def test_a_zeros_cache_is_resident_only_where_written():
    """A 256 MiB zeros_cache costs no resident memory until written (the engine's pool is one);
    writing one 256 KiB block makes about that much resident, not the whole cache."""
    before = _process_rss_kib()
    cache = pk.zeros_cache((1024, 8, 16, 128), torch.bfloat16)
    allocated = _process_rss_kib()
    cache[100].fill_(1.0)
    written = _process_rss_kib()
    assert allocated - before < 16 * 1024
    assert 0 < written - allocated < 16 * 1024
    assert float(cache[100].float().sum()) == 8 * 16 * 128 and float(cache[99].abs().sum()) == 0


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="zeros_cache is torch.zeros here")
@pytest.mark.parametrize("madvise", [True, False], ids=["populate-write", "touch"])
def test_prefault_makes_every_page_resident_and_keeps_the_contents(madvise, monkeypatch):
    """`prefault` on a 32 MiB zeros_cache with one written block: the whole cache becomes
    resident (through madvise(MADV_POPULATE_WRITE), or through the read-and-rewrite of one byte
    per page where that advice is refused), and every byte reads as before."""
    from paged_kernels import cache_memory
    if not madvise:
        monkeypatch.setattr(cache_memory, "_madvise", lambda *args: False)
    cache = pk.zeros_cache((1024, 8, 16, 128), torch.bfloat16)
    cache[100].fill_(1.5)
    cache[1023, 7, 15, 127] = -2.0  # the last element: its page is the range's last
    before = _process_rss_kib()
    pk.prefault(cache)
    after = _process_rss_kib()
    assert after - before > 24 * 1024
    assert float(cache[100].float().sum()) == 1.5 * 8 * 16 * 128
    assert float(cache[1023, 7, 15, 127]) == -2.0
    assert float(cache.float().abs().sum()) == 1.5 * 8 * 16 * 128 + 2.0


def test_prefault_of_a_view_and_of_other_tensors():
    """A view prefaults its whole storage and changes nothing (an offset that is not a page
    boundary, a plain torch tensor); an empty tensor is a no-op."""
    base = torch.randn(3 * 4096 + 5)
    want = base.clone()
    pk.prefault(base[7:])
    assert torch.equal(base, want)
    pk.prefault(torch.empty(0))


def _process_rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages in this kernel")
def test_a_large_cache_is_backed_by_huge_pages():
    cache = pk.empty_cache((64, 8, 16, 128), torch.bfloat16)  # 32 MiB
    cache.fill_(1.0)  # first touch faults the pages in
    assert _anon_huge_kib(cache.data_ptr()) >= 2048
    plain = torch.empty((64, 8, 16, 128), dtype=torch.bfloat16)
    plain.fill_(1.0)
    if "[madvise]" in THP.read_text():  # torch.empty does not ask for them
        assert _anon_huge_kib(plain.data_ptr()) == 0


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_attention_over_it_equals_attention_over_torch_empty(backend):
    """write_kv, copy_blocks and decode attention read and write the same bytes in either
    memory (random non-contiguous block table, NaN in every unwritten slot, bfloat16 and an fp8
    cache); attention through the copied block equals attention through its source."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, heads, kv_heads, block_size, head_size = 12, 4, 2, 16, 64
    seq_lens = torch.tensor([37, 5], dtype=torch.int32)
    block_tables = torch.randperm(num_blocks, generator=gen)[:6].view(2, 3).int()
    slots = torch.cat([block_tables[s, torch.arange(n) // block_size] * block_size
                       + torch.arange(n) % block_size for s, n in enumerate(seq_lens.tolist())])
    k = torch.randn(len(slots), kv_heads, head_size, generator=gen).bfloat16()
    v = torch.randn(len(slots), kv_heads, head_size, generator=gen).bfloat16()
    query = torch.randn(2, heads, head_size, generator=gen).bfloat16()
    shape = (num_blocks, kv_heads, block_size, head_size)
    for dtype, scale in ((torch.bfloat16, None), (torch.float8_e4m3fn, 0.05)):
        outs = []
        for alloc in (torch.empty, pk.empty_cache):
            key_cache, value_cache = alloc(shape, dtype=dtype), alloc(shape, dtype=dtype)
            for cache in (key_cache, value_cache):
                cache.view(torch.uint8).fill_(0x7F)  # NaN in fp8 e4m3fn, in bfloat16 pairs too
            pk.write_kv(k, v, key_cache, value_cache, slots, k_scale=scale, v_scale=scale,
                        backend=backend)
            free = int(torch.tensor([b for b in range(num_blocks)
                                     if b not in block_tables.flatten().tolist()])[0])
            moved = block_tables.clone()
            moved[0, 1] = free  # the copy-on-write copy of sequence 0's second block
            pk.copy_blocks([key_cache], [value_cache],
                           torch.tensor([[int(block_tables[0, 1]), free]]), backend=backend)
            for table in (block_tables, moved):
                outs.append(pk.paged_attention(query, key_cache, value_cache, table, seq_lens,
                                               k_scale=scale, v_scale=scale, backend=backend))
        assert not outs[0].isnan().any()
        assert all(torch.equal(outs[0], out) for out in outs[1:])
