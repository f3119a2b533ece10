"""8-bit KV caches (float8_e4m3fn, float8_e5m2, int8) in the CUDA kernels, run by the host
emulator as backend "cuda-host" (the portable bit conversions of cuda/csrc/pk_kv8.cuh; the sm_89+
hardware conversions are compiled by tests/test_cuda_build.py, not run here).

`write_kv` must store exactly the bytes of an independent quantisation (tests/kv8_case.py), and
attention over a quantised cache must match the float64 oracle on the dequantised values: the
SIMT decode kernel (with and without split-K) and the SIMT varlen kernel, for every query dtype,
with per-tensor and per-KV-head scales. Unused fp8 slots are NaN; int8 has no NaN, so its unused
slots hold extreme values and two different poisons must give the same bits.
"""

from __future__ import annotations

import math

import paged_case
import pytest
import torch
from kv8_case import CACHE_DTYPES, quantize, quantized_case, scales, special_values
from oracle import attention_oracle, rel_error

import paged_kernels as pk

BACKEND = "cuda-host"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module", autouse=True)
def _available():
    if BACKEND not in pk.available_backends():
        pytest.skip(f"{BACKEND} unavailable: {pk.unavailable_backends().get(BACKEND)}")


def _case(seq_lens, q_lens, *, heads, dtype, cache_dtype, seed, int8_poison=-128,
          per_tensor=False):
    case = paged_case.make_case(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                                head_size=64, block_size=16, dtype=dtype, seed=seed,
                                table_pad="nan_block")
    k_scale, v_scale = scales(heads[1], seed)
    if per_tensor:
        k_scale, v_scale = k_scale[:1].expand(heads[1]), v_scale[:1].expand(heads[1])
    return quantized_case(case, cache_dtype, k_scale, v_scale, int8_poison), k_scale, v_scale


def _run(case, k_scale, v_scale, **kwargs):
    out = torch.full_like(case.query, math.nan)
    result = pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out,
                                return_lse=True, backend=BACKEND, k_scale=k_scale,
                                v_scale=v_scale, **kwargs)
    return result


def _check(case, k_scale, v_scale, dtype, **kwargs):
    out, lse = _run(case, k_scale, v_scale, **kwargs)
    want, want_lse = attention_oracle(case.query, case.keys, case.values, case.q_lens, **kwargs)
    assert not torch.isnan(out).any()
    assert rel_error(out, want) <= TOL[dtype], rel_error(out, want)
    assert rel_error(lse, want_lse) <= TOL[dtype], rel_error(lse, want_lse)


#: (cache dtype, query dtype): every cache dtype and every query dtype at least once
PAIRS = [(torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float16),
         (torch.int8, torch.float32), (torch.float8_e4m3fn, torch.float32)]
IDS = ["e4m3-bf16", "e5m2-f16", "int8-f32", "e4m3-f32"]


@pytest.mark.parametrize("cache_dtype,dtype", PAIRS, ids=IDS)
def test_decode_and_varlen_match_the_oracle(cache_dtype, dtype):
    """The SIMT decode kernel (GQA groups of 4) and the SIMT varlen kernel (prefill, chunked
    prefill, decode) on a quantised cache, per-KV-head scales given as a tensor."""
    case, ks, vs = _case([1, 17, 53], None, heads=(8, 2), dtype=dtype, cache_dtype=cache_dtype,
                         seed=3)
    _check(case, ks, vs, dtype)
    case, ks, vs = _case([19, 30, 1], [19, 4, 1], heads=(6, 2), dtype=dtype,
                         cache_dtype=cache_dtype, seed=4)
    _check(case, ks, vs, dtype, sliding_window=12)


def test_split_k_decode_and_a_float_scale(monkeypatch):
    """Forced small partitions (several splits merged by the reduce kernel of the query's
    dtype), with one float scale for every KV head."""
    monkeypatch.setenv("PAGED_KERNELS_CUDA_PARTITION", "16")
    case, ks, vs = _case([70, 33, 5], None, heads=(4, 2), dtype=torch.bfloat16,
                         cache_dtype=torch.float8_e5m2, seed=5, per_tensor=True)
    out, _ = _run(case, float(ks[0]), float(vs[0]), soft_cap=3.0)
    want, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens, soft_cap=3.0)
    assert rel_error(out, want) <= TOL[torch.bfloat16]


def test_int8_unused_slots_are_never_read():
    """int8 has no NaN: the same problem with its unused slots (and the block the table's
    padding names) at -128 and at 127 gives the same bits."""
    outs = []
    for poison in (-128, 127):
        case, ks, vs = _case([9, 40], [9, 2], heads=(4, 1), dtype=torch.float16,
                             cache_dtype=torch.int8, seed=6, int8_poison=poison)
        outs.append(_run(case, ks, vs)[0])
        case, ks, vs = _case([9, 40], None, heads=(4, 1), dtype=torch.float16,
                             cache_dtype=torch.int8, seed=6, int8_poison=poison)
        outs.append(_run(case, ks, vs)[0])
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_write_kv_stores_an_independent_quantisation(cache_dtype, dtype):
    """The stored bytes equal tests/kv8_case.py's quantisation bit for bit on rounding ties,
    subnormals, signed zeros, saturation and infinities (and NaN: NaN in fp8, 0 in int8),
    with a different scale per KV head; a negative slot writes nothing."""
    values = special_values()
    key = torch.stack([values, values.flip(0) * 3.0])[None].to(dtype)  # [1, 2 heads, 64]
    key = torch.cat([key, -key, torch.full_like(key, math.nan)])
    value = key.flip(2)
    k_scale, v_scale = torch.tensor([1.0, 0.75]), torch.tensor([2.0 ** -6, 3.0])
    key_cache = torch.zeros(3, 2, 4, 64, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([5, -1, 10])
    pk.write_kv(key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale,
                backend=BACKEND)
    for token, slot in ((0, 5), (2, 10)):
        block, offset = divmod(slot, 4)
        for cache, rows, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
            want = quantize(rows[token], scale[:, None], cache_dtype)
            assert torch.equal(cache[block, :, offset].view(torch.uint8), want.view(torch.uint8))
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[1, 1] = written[2, 2] = True
    assert not key_cache.view(torch.uint8).permute(0, 2, 1, 3)[~written].any()
