"""What is specific to the "cpu" backend (cpu_impl/), against the shared float64 oracle
(tests/oracle.py, no code shared with the kernel) on the shared NaN-poisoned paged cases
(tests/paged_case.py): thread-count independence, head sizes that are not multiples of the SIMD
width, block size 1, several query tiles and key chunks per sequence, memory safety on unchecked
bad contents, and the build's flag choice."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import paged_kernels as pk
from oracle import attention_oracle, rel_error
from paged_case import PagedCase, make_case

pytestmark = pytest.mark.skipif("cpu" not in pk.available_backends(),
                                reason=f"cpu backend unavailable: "
                                       f"{pk.unavailable_backends().get('cpu')}")


def build_case(seq_lens: list[int], q_lens: list[int] | None, heads: tuple[int, int],
               head_size: int, block_size: int, dtype: torch.dtype, *, nhd: bool = False,
               seed: int = 0) -> PagedCase:
    """The shared NaN-poisoned case (tests/paged_case.py) with this file's argument order."""
    return make_case(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                     head_size=head_size, block_size=block_size, dtype=dtype, nhd=nhd, seed=seed)


def dense_oracle(c: PagedCase, *, window: int | None = None, soft_cap: float | None = None,
                 alibi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out, lse) from the unpaged K/V (tests/oracle.py)."""
    return attention_oracle(c.query, c.keys, c.values, c.q_lens, sliding_window=window,
                            soft_cap=soft_cap, alibi_slopes=alibi)


rel_err = rel_error


TOL = {torch.float32: 2e-6, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def run_cpu(c: PagedCase, **kwargs):
    return pk.paged_attention(c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens,
                              cu_seqlens_q=c.cu_seqlens_q, backend="cpu", **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size,block_size,heads", [
    (64, 16, (9, 3)),    # the engine's SmolLM2-135M layout
    (80, 1, (4, 2)),     # block size 1; head size a multiple of 8 but not of 64
    (13, 5, (3, 3)),     # head size below and not a multiple of the SIMD width; MHA
    (256, 8, (8, 1)),    # large head size, MQA
])
def test_decode_and_mixed_match_oracle(dtype, head_size, block_size, heads):
    for q_lens in (None, [3, 1, 70, 0]):
        seq_lens = [5, 1, 150, 9] if q_lens else [1, 37, 150, block_size]
        c = build_case(seq_lens, q_lens, heads, head_size, block_size, dtype, seed=head_size)
        want, _ = dense_oracle(c)
        assert rel_err(run_cpu(c), want) <= TOL[dtype]


@pytest.mark.parametrize("window", [None, 300])
def test_several_chunks_per_sequence(window):
    """Sequences longer than one chunk (256 keys on the bf16 vdpbf16ps path, 64 elsewhere): the
    online softmax rescales the accumulators between chunks, odd lengths pad the last pair."""
    for q_lens in (None, [1, 40, 3, 300]):
        c = build_case([300, 601, 257, 300], q_lens, (9, 3), 64, 16, torch.bfloat16, seed=11)
        want, want_lse = dense_oracle(c, window=window)
        out, lse = run_cpu(c, return_lse=True, sliding_window=window)
        assert rel_err(out, want) <= TOL[torch.bfloat16]
        assert rel_err(lse, want_lse) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features_with_lse_and_nhd_caches(dtype, decode):
    """Varlen, and a decode batch of 4 (items that own all KV heads of a sequence)."""
    if decode:
        c = build_case([40, 130, 7, 64], None, (6, 2), 64, 16, dtype, nhd=True, seed=8)
    else:
        c = build_case([40, 130, 7], [40, 66, 1], (6, 2), 64, 16, dtype, nhd=True, seed=7)
    alibi = torch.tensor([2.0 ** (-(h + 1)) for h in range(6)])
    kwargs = {"sliding_window": 45, "soft_cap": 3.0, "alibi_slopes": alibi}
    out, lse = run_cpu(c, return_lse=True, **kwargs)
    want, want_lse = dense_oracle(c, window=45, soft_cap=3.0, alibi=alibi)
    assert rel_err(out, want) <= TOL[dtype]
    assert rel_err(lse, want_lse) <= TOL[dtype]


def test_strided_query_and_out():
    c = build_case([30, 90], [30, 4], (4, 2), 32, 16, torch.float32, seed=3)
    q_store = torch.full((c.query.shape[0], 4, 48), math.nan)
    q_store[:, :, :32] = c.query
    out_store = torch.full((c.query.shape[0], 4, 40), math.nan)
    pk.paged_attention(q_store[:, :, :32], c.key_cache, c.value_cache, c.block_tables,
                       c.seq_lens, cu_seqlens_q=c.cu_seqlens_q, out=out_store[:, :, :32],
                       backend="cpu")
    want, _ = dense_oracle(c)
    assert rel_err(out_store[:, :, :32], want) <= TOL[torch.float32]
    assert torch.isnan(out_store[:, :, 32:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_does_not_change_the_result(dtype):
    c = build_case([300, 17, 260], [300, 1, 20], (9, 3), 64, 16, dtype, seed=11)
    previous = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(run_cpu(c, return_lse=True))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("nhd", [False, True])
def test_read_ahead_reads_one_byte_per_line_of_each_sequences_blocks(nhd: bool):
    """A decode call's read-ahead (csrc/read_ahead.h) sums the first byte of every 64-byte line of
    each block a sequence reads (its first ceil(seq_len / block_size) table entries, in order,
    repeats read again; entries past them never), in both caches and through the caches' strides,
    on any thread count."""
    from cpu_impl import build
    ext = build.load()
    gen = torch.Generator().manual_seed(3)
    shape = (9, 16, 3, 64) if nhd else (9, 3, 16, 64)
    caches = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2)]
    views = [c.permute(0, 2, 1, 3) if nhd else c for c in caches]
    tables = torch.tensor([[4, 0, 8], [4, -1, 100], [2, 3, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 16, 17], dtype=torch.int32)  # blocks 4 0 8 | 4 | 2 3
    want = 0
    for c in caches:
        raw = c.view(torch.uint8).reshape(c.shape[0], -1)  # a block is one contiguous row here
        want += sum(int(raw[b, ::64].sum()) for b in (4, 0, 8, 4, 2, 3))
    for threads in (1, 2):
        assert ext.read_ahead(*views, tables, seq_lens, threads) == want
    with pytest.raises(RuntimeError, match="valid decode contents"):
        ext.read_ahead(*views, tables, torch.tensor([40, 17, 17], dtype=torch.int32), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_ahead_does_not_change_the_result(dtype, monkeypatch: pytest.MonkeyPatch):
    """Decode with and without the read-ahead (`cpu_impl.backend.read_ahead`): the same bits."""
    from cpu_impl import backend
    c = build_case([300, 17, 260, 1, 64], None, (9, 3), 64, 16, dtype, seed=12)
    results = []
    for on in (True, False):
        monkeypatch.setattr(backend, "read_ahead", on)
        results.append(run_cpu(c, return_lse=True))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def write_cache_dir(root: Path, caches: dict[str, tuple[str, str]]) -> Path:
    """A sysfs-like cpu0/cache folder: index name -> (level, size)."""
    for name, (level, size) in caches.items():
        (root / name).mkdir(parents=True)
        (root / name / "level").write_text(level + "\n")
        (root / name / "size").write_text(size + "\n")
    return root


@pytest.mark.parametrize("l3,expected", [("32768K", True), ("107520K", False), ("64M", True),
                                         ("96M", False)])
def test_read_ahead_by_default_only_under_a_small_last_level_cache(tmp_path, l3, expected):
    """The highest cache level's size decides (not the largest number or the last index), with
    K/M/G suffixes; 64 MiB and less: on."""
    from cpu_impl import backend
    root = write_cache_dir(tmp_path, {"index0": ("1", "48K"), "index1": ("1", "32K"),
                                      "index3": ("3", l3), "index2": ("2", "2048K")})
    llc = backend.last_level_cache_bytes(root)
    assert llc == int(l3[:-1]) << (10 if l3.endswith("K") else 20)
    assert backend.default_read_ahead(llc) is expected


def test_read_ahead_when_the_cache_size_is_unknown(tmp_path):
    from cpu_impl import backend
    assert backend.last_level_cache_bytes(tmp_path / "missing") is None
    broken = write_cache_dir(tmp_path / "broken", {"index0": ("x", "48K")})
    assert backend.last_level_cache_bytes(broken) is None
    assert backend.default_read_ahead(None) is True


def test_empty_batches():
    c = build_case([5], [0], (2, 1), 8, 4, torch.float32)
    out = run_cpu(c)  # a sequence with no query rows: nothing to write, no error
    assert out.shape == (0, 2, 8)
    none = torch.empty(0, 2, 8)
    out = pk.paged_attention(none, c.key_cache, c.value_cache, c.block_tables[:0],
                             c.seq_lens[:0], backend="cpu")
    assert out.shape == (0, 2, 8)


def test_auto_picks_cpu_for_cpu_tensors(monkeypatch):
    from paged_kernels import backends
    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)
    assert backends.resolve_backend("auto", torch.device("cpu")).name == "cpu"


@pytest.mark.parametrize("check", [False, True])
def test_bad_contents_raise_the_abi_error_even_unchecked(check):
    """The kernel's own content scan is cheap on the CPU, so it runs even with check=False."""
    c = build_case([20, 40], [20, 2], (2, 1), 16, 4, torch.float32, seed=5)
    table = c.block_tables
    bad_ids = [table.clone(), table.clone()]
    bad_ids[0][0, 4], bad_ids[1][1, 0] = 10 ** 9, -7  # last read entry; first read entry
    bad = [(t, c.seq_lens, c.cu_seqlens_q, "block_tables") for t in bad_ids] + [
        (table, torch.tensor([20, 10 ** 6], dtype=torch.int32), c.cu_seqlens_q, "seq_lens"),
        (table, c.seq_lens, torch.tensor([0, 23, 22], dtype=torch.int32), "cu_seqlens_q"),
        (table, torch.tensor([20, 1], dtype=torch.int32), c.cu_seqlens_q, "cu_seqlens_q"),
    ]
    for t, lens, cu, arg in bad:
        with pytest.raises(ValueError, match=arg):
            pk.paged_attention(c.query, c.key_cache, c.value_cache, t, lens, cu_seqlens_q=cu,
                               backend="cpu", check=check)
    decode = build_case([3, 5], None, (2, 1), 16, 4, torch.float32, seed=6)
    with pytest.raises(ValueError, match="seq_lens"):
        pk.paged_attention(decode.query, decode.key_cache, decode.value_cache,
                           decode.block_tables, torch.tensor([3, 0], dtype=torch.int32),
                           backend="cpu", check=check)


def test_write_kv_into_nhd_view_then_attend():
    num_blocks, block_size, num_kv, d = 6, 4, 2, 24
    storage = [torch.full((num_blocks, block_size, num_kv, d), math.nan, dtype=torch.bfloat16)
               for _ in range(2)]
    k_cache, v_cache = (s.permute(0, 2, 1, 3) for s in storage)
    gen = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(10, num_kv, d, generator=gen).to(torch.bfloat16)
                    for _ in range(2))
    blocks = [4, 1, 3]
    slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                          for p in range(10)] + [-1])
    pk.write_kv(torch.cat([keys, keys[:1]]), torch.cat([values, values[:1]]), k_cache, v_cache,
                slots, backend="cpu")
    for p in range(10):
        assert torch.equal(k_cache[blocks[p // block_size], :, p % block_size], keys[p])
        assert torch.equal(v_cache[blocks[p // block_size], :, p % block_size], values[p])
    assert torch.isnan(k_cache[[0, 2, 5]].float()).all()
    before = [c.clone() for c in storage]
    out_of_range = torch.tensor([num_blocks * block_size + 5] * 10)
    pk.write_kv(keys, values, k_cache, v_cache, out_of_range, backend="cpu", check=False)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(before, storage)), "an out-of-range slot was written"
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.write_kv(keys, values, k_cache, v_cache, out_of_range, backend="cpu", check=True)


def test_build_flags_follow_the_cpu(tmp_path: Path):
    from cpu_impl import build
    from paged_kernels.cpp_build import cpu_flags
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags\t\t: fpu sse2 avx2 fma f16c\n")
    with_simd = build.compile_flags(cpu_flags(info))
    info.write_text("processor : 0\nflags\t\t: fpu sse2 avx2\n")
    without = build.compile_flags(cpu_flags(info))
    assert "-mavx2" in with_simd and "-mf16c" in with_simd
    assert not any(f.startswith("-m") for f in without) and "-fopenmp" in without
    assert "-march=native" not in with_simd
    assert build.extension_name(with_simd) != build.extension_name(without)
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert not any(f.startswith("-mavx512") for f in with_simd)
    info.write_text("processor : 0\nflags\t\t: avx2 fma f16c avx512f avx512bw avx512dq avx512vl "
                    "avx512_bf16\n")
    wide = build.compile_flags(cpu_flags(info))
    assert "-mavx2" in wide and "-mavx512bf16" in wide and "-mavx512bw" in wide
    info.write_text("processor : 0\nflags\t\t: avx2 fma f16c avx512f avx512bw avx512dq avx512vl\n")
    assert not any(f.startswith("-mavx512") for f in build.compile_flags(cpu_flags(info)))


def test_the_build_key_covers_the_kernel_headers():
    """The kernel is one translation unit over the headers next to it and the shared AMX header
    of paged_kernels/csrc: editing any of them must rebuild it (cpp_build.extension_name hashes
    the local headers)."""
    from cpu_impl import build
    from paged_kernels.cpp_build import local_headers
    shared = Path(pk.__file__).resolve().parent / "csrc" / "amx_tiles.h"
    headers = set(local_headers(build.SOURCE))
    assert headers == set(build.SOURCE.parent.glob("*.h")) | {shared}
    assert {"simd.h", "problem.h", "kernel.h", "read_ahead.h"} <= {p.name for p in headers}


@pytest.mark.parametrize("cpu", ["portable", "avx2"])
def test_narrower_builds_match_the_oracle(cpu: str):
    """The code paths of CPUs with fewer features than this one: portable (no AVX2/FMA/F16C) and
    AVX2 without AVX-512, each compiled here with those flags (a build of ~30 s the first time,
    cached after), against the oracle. Decode batches of 4 and more take the all-KV-heads items."""
    from cpu_impl import build
    features = frozenset() if cpu == "portable" else frozenset({"avx2", "fma", "f16c"})
    ext = build.load(build.compile_flags(features))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for q_lens, d in ((None, 64), ([9, 1, 40], 20)):
            seq_lens = [33, 70, 5, 16] if q_lens is None else [9, 17, 50]
            c = build_case(seq_lens, q_lens, (6, 2), d, 8, dtype, seed=d)
            out = torch.full_like(c.query, math.nan)
            lse = torch.empty(c.query.shape[:2])
            alibi = torch.tensor([0.5 ** (h + 1) for h in range(6)])
            assert ext.paged_attention(c.query, c.key_cache, c.value_cache, c.block_tables,
                                        c.seq_lens, c.cu_seqlens_q, out, lse, alibi,
                                        1 / math.sqrt(d), 30, 4.0, 16, 2, True, None, None)
            want, want_lse = dense_oracle(c, window=30, soft_cap=4.0, alibi=alibi)
            assert rel_err(out, want) <= TOL[dtype]
            assert rel_err(lse, want_lse) <= TOL[dtype]
    for cache_dtype in CACHE_8BIT:  # 8-bit codes through these builds' conversions
        for q_lens in (None, [9, 1, 20]):
            seq_lens = [33, 70, 5, 16] if q_lens is None else [9, 17, 50]
            c = build_case(seq_lens, q_lens, (6, 2), 40, 8, torch.bfloat16, seed=5)
            k_scale, v_scale = kv_scales_for(cache_dtype, 2)
            kc, vc, keys, values = quantized_case(c, cache_dtype, k_scale, v_scale)
            want, _ = attention_oracle(c.query, keys, values, c.q_lens)
            out = attend_ext(ext, c, kc, vc, k_scale, v_scale)
            assert rel_err(out, want) <= TOL[torch.bfloat16]


# --- 8-bit caches ---------------------------------------------------------------------------
# The test's own quantisation (torch's float32 -> fp8 conversion after clamping, torch.round for
# int8) and dequantisation (torch's fp8 -> float64 conversion times the scale); none of it is the
# kernel's code (csrc/paged_attention.cpp's quantize, csrc/simd.h's tables and bit conversions).

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
CACHE_8BIT = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


def quantize_8bit(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale[kv_head] as `dtype` codes; x's dimension 1 is the KV head (a cache
    [num_blocks, num_kv_heads, block_size, head_size] or rows [tokens, num_kv_heads, head_size])."""
    y = x.float() / scale.view([1, -1] + [1] * (x.dim() - 2))
    if dtype == torch.int8:
        return torch.nan_to_num(y.round(), nan=0.0).clamp(-128, 127).to(torch.int8)
    return y.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 values of [seq_len, num_kv_heads, head_size] codes."""
    return q.to(torch.float64) * scale.double().view(1, -1, 1)


def quantized_case(c: PagedCase, dtype: torch.dtype, k_scale: torch.Tensor,
                   v_scale: torch.Tensor, poison: int = 127):
    """(key_cache, value_cache, keys, values) of case `c` stored in `dtype` with these per-KV-head
    scales: the caches quantised (NaN-poisoned unused slots stay NaN in fp8; int8 has no NaN, so
    they hold `poison`), the oracle's K/V the dequantised codes of each sequence."""
    caches = []
    for cache, scale in ((c.key_cache, k_scale), (c.value_cache, v_scale)):
        q = torch.empty_like(cache, dtype=dtype)
        q.copy_(quantize_8bit(cache, scale, dtype))
        if dtype == torch.int8:
            q[torch.isnan(cache)] = poison
        caches.append(q)
    keys = [dequantize_rows(quantize_8bit(k, k_scale, dtype), k_scale) for k in c.keys]
    values = [dequantize_rows(quantize_8bit(v, v_scale, dtype), v_scale) for v in c.values]
    return caches[0], caches[1], keys, values


def attend_ext(ext, c: PagedCase, key_cache, value_cache, k_scale, v_scale, *, window=0,
               soft_cap=0.0, alibi=None, threads=2, lse=False):
    """The extension's paged_attention on case `c` with these caches (out NaN-filled first)."""
    out = torch.full_like(c.query, math.nan)
    lse_out = torch.empty(c.query.shape[:2]) if lse else None
    assert ext.paged_attention(c.query, key_cache, value_cache, c.block_tables, c.seq_lens,
                               c.cu_seqlens_q, out, lse_out, alibi,
                               1 / math.sqrt(c.query.shape[2]), window, soft_cap, 16, threads,
                               True, k_scale, v_scale)
    return (out, lse_out) if lse else out


def kv_scales_for(dtype: torch.dtype, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different scales per KV head (a wrong head's scale changes the result), with values of
    N(0, 1) reaching the format's range (e4m3fn and int8 saturate a few of them)."""
    base = 0.03 if dtype == torch.int8 else 2.0 ** -6
    k = torch.tensor([base * (1 + 0.5 * h) for h in range(num_kv_heads)])
    return k, k.flip(0) * 1.25


@pytest.mark.parametrize("cache_dtype,dtype", [
    *((c, d) for c in CACHE_8BIT for d in (torch.float32, torch.bfloat16)),
    (torch.float8_e4m3fn, torch.float16),
])
def test_8bit_caches_match_the_oracle(cache_dtype, dtype):
    """Decode (all-KV-heads items) and varlen over 8-bit caches: head sizes 64, 128, 96 and 32
    (on AVX-512 BF16 with a bf16 query, the vdpbf16ps paths: on VBMI the codes converted
    straight into their layouts where the head size is a multiple of 64, 4 to 64 rows per KV
    head; otherwise rows converted to bf16) and 40 (the widened-row paths, SIMD bodies and
    scalar tails)."""
    from cpu_impl import build
    ext = build.load()
    for head_size, q_lens in ((64, None), (64, [3, 1, 17, 0]), (128, [2, 1, 5, 0]),
                              (96, None), (96, [2, 1, 17, 0]), (32, None), (32, [3, 1, 5, 0]),
                              (40, [2, 1, 17, 0]), (40, None)):
        # Decode: a sequence over two 256-key chunks; varlen: several 16-row query tiles.
        seq_lens = [5, 1, 80, 9] if q_lens else [1, 37, 300, 16, 5]
        c = build_case(seq_lens, q_lens, (8, 2), head_size, 16, dtype, seed=head_size)
        k_scale, v_scale = kv_scales_for(cache_dtype, 2)
        kc, vc, keys, values = quantized_case(c, cache_dtype, k_scale, v_scale)
        want, _ = attention_oracle(c.query, keys, values, c.q_lens)
        assert rel_err(attend_ext(ext, c, kc, vc, k_scale, v_scale), want) <= TOL[dtype]
    # A window that starts and ends mid-chunk, a soft cap and ALiBi, decode and varlen: the
    # weights outside a row's window are 0 on every P.V path (the V rows read head by head too).
    for head_size, q_lens in ((64, None), (128, [2, 1, 5, 0])):
        seq_lens = [5, 1, 80, 9] if q_lens else [1, 37, 300, 16, 5]
        c = build_case(seq_lens, q_lens, (8, 2), head_size, 16, dtype, seed=7)
        k_scale, v_scale = kv_scales_for(cache_dtype, 2)
        kc, vc, keys, values = quantized_case(c, cache_dtype, k_scale, v_scale)
        alibi = torch.tensor([0.5 ** (h + 1) for h in range(8)])
        want, want_lse = attention_oracle(c.query, keys, values, c.q_lens, sliding_window=45,
                                          soft_cap=3.0, alibi_slopes=alibi)
        out, lse = attend_ext(ext, c, kc, vc, k_scale, v_scale, window=45, soft_cap=3.0,
                              alibi=alibi, lse=True)
        assert rel_err(out, want) <= TOL[dtype]
        assert rel_err(lse, want_lse) <= TOL[dtype]


@pytest.mark.parametrize("cache_dtype", CACHE_8BIT)
def test_8bit_staged_rows_path_of_bf16_builds_without_vbmi(cache_dtype):
    """AVX-512 BF16 without VBMI (the tier below this CPU's on a VBMI CPU: Cooper Lake, or any
    CPU on AMX's tier) reads 8-bit codes through bf16 rows staged per unit, not the byte tables
    of code_lut.h: that build, compiled here, against the oracle at the head sizes the tables
    would take (decode, and varlen tiles of 4 to 64 rows per KV head)."""
    from cpu_impl import build
    from paged_kernels.cpp_build import cpu_flags
    here = cpu_flags()
    if not {"avx512_bf16", "avx512vbmi"} <= here:
        pytest.skip("the default build is this path here, or neither build runs here")
    flags = build.compile_flags(here - {"avx512vbmi"})
    assert "-mavx512bf16" in flags and "-mavx512vbmi" not in flags
    assert "-mavx512vbmi" in build.compile_flags(here)
    ext = build.load(flags)
    for head_size, q_lens in ((64, None), (128, [3, 1, 17, 0]), (96, [2, 1, 5, 0])):
        seq_lens = [5, 1, 80, 9] if q_lens else [1, 37, 300, 16, 5]
        c = build_case(seq_lens, q_lens, (8, 2), head_size, 16, torch.bfloat16, seed=head_size)
        k_scale, v_scale = kv_scales_for(cache_dtype, 2)
        kc, vc, keys, values = quantized_case(c, cache_dtype, k_scale, v_scale)
        want, _ = attention_oracle(c.query, keys, values, c.q_lens)
        assert rel_err(attend_ext(ext, c, kc, vc, k_scale, v_scale), want) <= TOL[torch.bfloat16]


def fp8_codes(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The contract's fp8 code of each float32 `y` by search, not by conversion: saturate to the
    largest finite value, then the nearest finite code, a tie going to the even code (mantissa
    LSB 0, the code's LSB); the sign bit from y's sign (-0.0 included). NaN gives 0xFF."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double()
    finite = int((codes[:128].isfinite() & (codes[:128] <= FP8_MAX[dtype])).sum())
    grid = codes[:finite]  # the non-negative finite values, increasing with the code
    mag = y.double().abs().clamp(max=FP8_MAX[dtype])
    hi = torch.searchsorted(grid, mag).clamp(max=finite - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    negative = torch.signbit(y)
    out = (pick + 128 * negative.long()).to(torch.uint8)
    return torch.where(torch.isnan(y), torch.tensor(255, dtype=torch.uint8), out)


def hard_rows(dtype: torch.dtype, scales: torch.Tensor, head_size: int) -> torch.Tensor:
    """float32 rows [tokens, num_kv_heads, head_size] whose quotients by `scales` hit the
    formats' edges: every midpoint between neighbouring codes (ties) and the codes themselves,
    beyond the largest value, +-inf, NaN, -0.0, subnormals, and random values."""
    if dtype == torch.int8:
        special = torch.arange(-130, 131, dtype=torch.float32) * 0.5  # every half-integer tie
    else:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        grid = grid[grid.isfinite()].unique()
        special = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, grid * 1.0001])
    special = torch.cat([special, torch.tensor([1e6, -1e6, math.inf, -math.inf, math.nan, -0.0,
                                                1e-30, -1e-30])])
    gen = torch.Generator().manual_seed(4)
    count = -(-special.numel() // head_size) * head_size
    y = torch.randn(count, generator=gen) * 40
    y[:special.numel()] = special
    y = y.view(-1, 1, head_size).repeat(1, scales.numel(), 1)
    return y * scales.view(1, -1, 1)  # exact: the scales of the first heads are powers of 2


@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", CACHE_8BIT)
def test_write_kv_stores_the_contracts_codes_bit_for_bit(cache_dtype, rows_dtype):
    """write_kv into 8-bit caches (the C++ quantisation, through the public API with per-KV-head
    scales) against fp8 codes found by search (fp8_codes) and torch.round's half-to-even for
    int8: ties, saturation, infinities, NaN (fp8: NaN, int8: 0), -0.0; other slots untouched."""
    head_size, block_size, num_blocks = 32, 4, 300
    scales = torch.tensor([0.5, 4.0, 0.3])  # powers of 2 keep the ties exact; 0.3 rounds x / s
    rows = hard_rows(cache_dtype, scales, head_size).to(rows_dtype)
    tokens = rows.shape[0]
    gen = torch.Generator().manual_seed(5)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    shape = (num_blocks, 3, block_size, head_size)
    key_cache = torch.full(shape, 0x55, dtype=torch.uint8).view(cache_dtype)
    value_cache = torch.full(shape, 0x55, dtype=torch.uint8).view(cache_dtype)
    pk.write_kv(rows, -rows, key_cache, value_cache, slots, k_scale=scales, v_scale=scales * 2,
                backend="cpu")
    for cache, x, scale in ((key_cache, rows, scales), (value_cache, -rows, scales * 2)):
        y = x.float() / scale.view(1, -1, 1)
        if cache_dtype == torch.int8:
            want = torch.nan_to_num(torch.round(y), nan=0.0).clamp(-128, 127).to(torch.int8)
            want = want.view(torch.uint8)
        else:
            want = fp8_codes(y, cache_dtype)
        stored = cache.view(torch.uint8)[slots // block_size, :, slots % block_size]
        if cache_dtype != torch.int8:  # any NaN code is NaN
            nan = torch.isnan(y)
            assert torch.isnan(stored[nan].view(cache_dtype).float()).all()
            stored, want = stored[~nan], want[~nan]
        assert torch.equal(stored, want)
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[slots] = False
        flat = cache.view(torch.uint8).permute(0, 2, 1, 3).reshape(-1, 3, head_size)
        assert (flat[untouched] == 0x55).all()


@pytest.mark.parametrize("cache_dtype", CACHE_8BIT)
def test_8bit_caches_through_the_api(cache_dtype):
    """The public API with the per-tensor scale forms (a float, a one-element tensor), written
    by write_kv and read by paged_attention on the cpu backend, against the oracle on the
    test's own quantisation; int8's unused slots: the results do not depend on their contents."""
    c = build_case([40, 130, 7, 64], None, (6, 2), 64, 16, torch.bfloat16, seed=9)
    scale = 0.03 if cache_dtype == torch.int8 else 2.0 ** -5
    per_head = torch.full((2,), scale)
    results = []
    for k_form, poison in ((scale, 127), (torch.tensor([scale]), -128)):
        kc, vc, keys, values = quantized_case(c, cache_dtype, per_head, per_head, poison)
        out, lse = pk.paged_attention(c.query, kc, vc, c.block_tables, c.seq_lens,
                                      k_scale=k_form, v_scale=k_form, return_lse=True,
                                      backend="cpu", check=True)
        results.append((out, lse))
    want, want_lse = attention_oracle(c.query, keys, values, c.q_lens)
    assert rel_err(results[0][0], want) <= TOL[torch.bfloat16]
    assert rel_err(results[0][1], want_lse) <= TOL[torch.bfloat16]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", CACHE_8BIT)
def test_every_8bit_code_reads_as_its_value(cache_dtype, dtype):
    """All 256 codes of the format (subnormals, the largest binade, inf and NaN codes, -0) as V
    rows of one-key sequences, so each output row is its V row exactly: equal, bit for bit, to
    torch's own decoding of the codes (the bf16 staging of the vdpbf16ps paths for a bf16
    query on AVX-512 BF16, the widened rows for float32)."""
    head_size = 64
    num_seqs = 256 // head_size
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype)
    gen = torch.Generator().manual_seed(11)
    num_blocks = 3 * num_seqs
    key_cache = torch.zeros(num_blocks, 1, 16, head_size, dtype=torch.uint8).view(cache_dtype)
    value_cache = torch.full((num_blocks, 1, 16, head_size), 0x7F,
                             dtype=torch.uint8).view(torch.int8).view(cache_dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[:num_seqs].to(torch.int32)[:, None]
    value_cache.view(torch.uint8)[block_tables[:, 0].long(), 0, 0] = (
        codes.view(torch.uint8).view(num_seqs, head_size))
    query = torch.randn(num_seqs, 1, head_size, generator=gen).to(dtype)
    out = pk.paged_attention(query, key_cache, value_cache, block_tables,
                             torch.ones(num_seqs, dtype=torch.int32), k_scale=1.0, v_scale=1.0,
                             backend="cpu", check=True)
    want = codes.float().view(num_seqs, 1, head_size).to(dtype)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(params=["amx", "vdpbf16ps"])
def qk_path(request):
    """Q.K^T of bf16 on AMX tiles (when this build and this CPU have them) or on vdpbf16ps, in
    the same build; the process-wide switch is restored after."""
    from cpu_impl import build
    ext = build.load()
    if ext.use_amx(request.param == "amx") != (request.param == "amx"):
        ext.use_amx(True)
        pytest.skip("AMX is not built in or not granted here")
    yield ext
    ext.use_amx(True)


@pytest.mark.parametrize("heads,head_size,block_size", [
    ((9, 3), 64, 16),    # the engine's layout: whole 16-key units on AMX, partial ones not
    ((32, 8), 128, 32),  # two units per block; four 32-element slices of the head size
    ((16, 1), 64, 8),    # 16 rows per KV head (the most a C tile holds); units span two blocks
    ((4, 2), 64, 16),
])
def test_bf16_qk_paths_match_the_oracle(qk_path, heads, head_size, block_size):
    """Decode (all-KV-heads items, a sequence over two 256-key chunks) and varlen (tiles of
    rows per KV head up to 16 on AMX, more on the transposed path), bf16 and 8-bit caches."""
    for q_lens in (None, [3, 1, 5, 0]):
        seq_lens = [1, 37, 300, block_size, 17] if q_lens is None else [5, 1, 80, 9]
        c = build_case(seq_lens, q_lens, heads, head_size, block_size, torch.bfloat16,
                       seed=head_size + block_size)
        want, _ = dense_oracle(c)
        assert rel_err(run_cpu(c), want) <= TOL[torch.bfloat16]
    c = build_case([1, 37, 300, 17], None, heads, head_size, block_size, torch.bfloat16)
    k_scale, v_scale = kv_scales_for(torch.float8_e4m3fn, heads[1])
    kc, vc, keys, values = quantized_case(c, torch.float8_e4m3fn, k_scale, v_scale)
    want, _ = attention_oracle(c.query, keys, values, c.q_lens)
    out = attend_ext(qk_path, c, kc, vc, k_scale, v_scale)
    assert rel_err(out, want) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("decode", [True, False])
def test_bf16_output_rounding_keeps_subnormals_and_writes_nan_as_torch(decode):
    """The bf16 outputs are the float32 results rounded as torch rounds them: to nearest even,
    subnormal results kept (not flushed), a NaN stored as 0x7FC0, every column in its place.
    Four keys of equal score (a zero query) average V; column 3 of key 0 is 2.4e-38, so its
    output 6e-39 is subnormal in bf16; column 5 of key 2 is NaN."""
    heads, head_size, block_size, keys = (9, 3), 64, 16, 4
    query = torch.zeros(1 if decode else keys, heads[0], head_size, dtype=torch.bfloat16)
    values = torch.randn(keys, heads[1], head_size, dtype=torch.float64)
    values[0, :, 3], values[1:, :, 3] = 2.4e-38, 0.0
    values[2, :, 5] = math.nan
    key_cache = torch.randn(3, heads[1], block_size, head_size).to(torch.bfloat16)
    value_cache = torch.full_like(key_cache, math.nan)
    value_cache[1, :, :keys] = values.to(torch.bfloat16).transpose(0, 1)
    block_tables = torch.tensor([[1]], dtype=torch.int32)
    seq_lens = torch.tensor([keys], dtype=torch.int32)
    cu = None if decode else torch.tensor([0, keys], dtype=torch.int32)
    out = pk.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                             cu_seqlens_q=cu, backend="cpu")
    group = heads[0] // heads[1]
    v = values.to(torch.bfloat16).to(torch.float64)  # what the cache holds
    want = v.mean(0).repeat_interleave(group, 0).to(torch.bfloat16)  # [heads, head_size]
    got = out[-1]
    assert got[:, 3].view(torch.int16).tolist() == want[:, 3].view(torch.int16).tolist()
    assert 0 < got[0, 3].float().abs() < torch.finfo(torch.bfloat16).tiny
    assert got[:, 5].view(torch.int16).tolist() == [0x7FC0] * heads[0]
    other = [c for c in range(head_size) if c not in (3, 5)]
    assert torch.allclose(got[:, other].double(), want[:, other].double(), rtol=1e-2, atol=1e-2)


def item_read_lines(c: PagedCase, key_cache: torch.Tensor, value_cache: torch.Tensor, seq: int,
                    heads: range, window: int, values_by_head: bool = False) -> list[int]:
    """The 64-byte lines a decode work item on the vdpbf16ps path reads, in the order it reads
    them (docs/cpu.md): per chunk of 256 keys, the K rows unit by unit (16 keys; in a unit, KV
    head by KV head, keys in order), then the V rows the same way, or, `values_by_head` (an
    8-bit cache read through the byte tables, at most 4 rows per KV head), KV head by KV head
    (in a head, unit by unit); a line read again straight after itself is listed once."""
    seq_len = int(c.seq_lens[seq])
    block_size = key_cache.shape[2]
    lo = max(0, seq_len - window) if window else 0
    lines: list[int] = []
    for c0 in range(lo, seq_len, 256):
        c1 = min(seq_len, c0 + 256)
        for cache in (key_cache, value_cache):
            units = [(j0, h) for j0 in range(c0, c1, 16) for h in heads]
            if cache is value_cache and values_by_head:
                units = [(j0, h) for h in heads for j0 in range(c0, c1, 16)]
            for j0, h in units:
                for pos in range(j0, min(c1, j0 + 16)):
                    row = cache[int(c.block_tables[seq, pos // block_size]), h, pos % block_size]
                    start = row.data_ptr()
                    end = start + row.numel() * row.element_size()
                    for line in range(start // 64 * 64, end, 64):
                        if not lines or lines[-1] != line:
                            lines.append(line)
    return lines


def split_into_items(log: list[int], items: list[list[int]]) -> list[list[int]]:
    """`log` cut into the sequences of `items` it is a concatenation of (in any order); fails
    the test where it is not one."""
    by_first = {lines[0]: lines for lines in items}
    assert len(by_first) == len(items), "items must start on different lines"
    found, i = [], 0
    while i < len(log):
        lines = by_first.pop(log[i], None)
        assert lines is not None, f"line {i} of the log starts no remaining item"
        assert log[i:i + len(lines)] == lines, "an item's lines differ from its reads"
        found.append(lines)
        i += len(lines)
    assert not by_first, f"{len(by_first)} items were never prefetched"
    return found


@pytest.mark.parametrize("cache_dtype,seq_lens,window,nhd,head_size", [
    (torch.bfloat16, [300, 37, 16, 529, 1], 0, False, 64),  # all-KV-heads items, several chunks
    (torch.bfloat16, [300, 37], 0, False, 64),               # one KV head per item
    (torch.bfloat16, [300, 37, 16, 529], 270, False, 64),    # a window: reads start mid-block
    (torch.bfloat16, [300, 37, 16, 529], 0, True, 64),       # NHD: a head's rows not contiguous
    (torch.int8, [300, 37, 16, 529], 0, False, 32),          # 32-byte rows: lines shared by rows
    (torch.float8_e4m3fn, [300, 37, 16, 529], 0, False, 64),  # V by head (VBMI byte tables)
    (torch.int8, [300, 37, 16, 529, 1], 270, False, 128),     # the same, a window, two lines
])
def test_paced_prefetch_requests_each_items_reads_in_read_order(cache_dtype, seq_lens, window,
                                                                nhd, head_size):
    """On the vdpbf16ps path every work item requests exactly the lines of the K and V rows it
    reads, in the order it reads them (csrc/line_cursor.h), whatever the layout, window or
    cache dtype; with `prefetch_lines` 0 it requests none."""
    from cpu_impl import backend, build
    if "-mavx512bf16" not in build.compile_flags():
        pytest.skip("the paced prefetch runs on the AVX-512 BF16 build's vdpbf16ps path")
    ext = build.load()
    c = build_case(seq_lens, None, (8, 2), head_size, 16, torch.bfloat16, nhd=nhd, seed=5)
    flags = build.compile_flags()
    values_by_head = (cache_dtype.itemsize == 1 and head_size % 64 == 0
                      and "-mavx512vbmi" in flags and "-mamx-tile" not in flags)
    if cache_dtype.itemsize == 1:
        k_scale, v_scale = kv_scales_for(cache_dtype, 2)
        kc, vc, _, _ = quantized_case(c, cache_dtype, k_scale, v_scale)
    else:
        kc, vc, k_scale, v_scale = c.key_cache, c.value_cache, None, None
    heads_per_item = 2 if len(seq_lens) >= 4 else 1
    items = [item_read_lines(c, kc, vc, s, range(h, h + heads_per_item), window, values_by_head)
             for s in range(len(seq_lens)) for h in range(0, 2, heads_per_item)]
    out = torch.empty_like(c.query)
    for lines in (backend.PREFETCH_LINES, 0):
        ext.prefetch_log(True)
        assert ext.paged_attention(c.query, kc, vc, c.block_tables, c.seq_lens, None, out, None,
                                   None, head_size ** -0.5, window, 0.0, 16, 1, False, k_scale,
                                   v_scale, lines)
        log = ext.prefetch_log(False)
        if lines:
            assert len(split_into_items(log, items)) == len(items)
        else:
            assert log == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paced_prefetch_does_not_change_the_result(dtype, monkeypatch: pytest.MonkeyPatch):
    """Decode with the paced prefetch at several distances and without it: the same bits."""
    from cpu_impl import backend
    c = build_case([300, 17, 260, 1, 64], None, (9, 3), 64, 16, dtype, seed=13)
    results = []
    for lines in (backend.PREFETCH_LINES, 1, 0):
        monkeypatch.setattr(backend, "prefetch_lines", lines)
        results.append(run_cpu(c, return_lse=True))
    for out, lse in results[1:]:
        assert torch.equal(results[0][0], out)
        assert torch.equal(results[0][1], lse)
