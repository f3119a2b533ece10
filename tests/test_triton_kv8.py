"""8-bit KV caches (float8_e4m3fn, float8_e5m2, int8) in the Triton kernels.

Runs natively on a CUDA device, else in Triton's interpreter on CPU tensors (tests/triton_env.py;
tiny shapes: the interpreter is slow). `write_kv` must store exactly the bytes of an independent
quantisation (tests/kv8_case.py): the kernel rounds onto the format's grid itself, so this holds
on the interpreter (whose fp8 conversion does not round ties to even) as on a GPU. Attention over
a quantised cache must match the float64 oracle on the dequantised values (decode with and
without split-K, varlen), with per-KV-head and per-tensor scales; unused fp8 slots are NaN, and
int8's (no NaN) hold extreme values that must not change a bit of the result.
"""

from __future__ import annotations

import math

import paged_case
import pytest
import torch
from kv8_case import CACHE_DTYPES, quantize, quantized_case, scales, special_values
from oracle import attention_oracle, rel_error
from triton_env import DEVICE  # before triton_impl: skips this module where triton is unusable
from triton_impl import decode

import paged_kernels as pk

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _case(seq_lens, q_lens, *, dtype, cache_dtype, seed, heads=(4, 2), int8_poison=-128):
    case = paged_case.make_case(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                                head_size=32, block_size=8, dtype=dtype, seed=seed,
                                device=DEVICE)
    k_scale, v_scale = (s.to(DEVICE) for s in scales(heads[1], seed))
    return quantized_case(case, cache_dtype, k_scale, v_scale, int8_poison), k_scale, v_scale


def _run(case, k_scale, v_scale):
    out = torch.full_like(case.query, math.nan)
    return pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                              case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out,
                              return_lse=True, backend="triton", k_scale=k_scale,
                              v_scale=v_scale)


def _check(case, k_scale, v_scale):
    out, lse = _run(case, k_scale, v_scale)
    want, want_lse = attention_oracle(case.query, case.keys, case.values, case.q_lens)
    tol = TOL[case.query.dtype]
    assert not torch.isnan(out).any()
    assert rel_error(out, want) <= tol, rel_error(out, want)
    assert rel_error(lse, want_lse) <= tol, rel_error(lse, want_lse)


@pytest.mark.parametrize("cache_dtype,dtype", [
    (torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float16),
    (torch.int8, torch.float32)], ids=["e4m3-bf16", "e5m2-f16", "int8-f32"])
def test_decode_and_varlen_match_the_oracle(cache_dtype, dtype):
    """The decode kernel (one split) and the varlen kernel (prefill, chunked prefill, decode)
    on a quantised cache with per-KV-head scales."""
    case, ks, vs = _case([1, 21], None, dtype=dtype, cache_dtype=cache_dtype, seed=1)
    _check(case, ks, vs)
    case, ks, vs = _case([9, 20], [9, 3], dtype=dtype, cache_dtype=cache_dtype, seed=2)
    _check(case, ks, vs)


def test_split_k_decode_with_a_per_tensor_scale():
    """A forced split size (partials scaled by v_scale before the reduce), scales given as
    one-element tensors."""
    case, ks, vs = _case([40, 3], None, dtype=torch.float32, cache_dtype=torch.float8_e5m2,
                         seed=3, heads=(2, 1))
    decode.set_fixed_split_size(16)
    try:
        out, _ = _run(case, ks[:1], vs[:1])
    finally:
        decode.set_fixed_split_size(None)
    want, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens)
    assert rel_error(out, want) <= TOL[torch.float32]


def test_int8_unused_slots_are_never_read():
    """The same problem with int8's unused slots at -128 and at 127 gives the same bits."""
    outs = [_run(*_case([3, 13], [3, 2], dtype=torch.float16, cache_dtype=torch.int8, seed=4,
                        int8_poison=poison))[0] for poison in (-128, 127)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, on inf and NaN
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["e4m3", "e5m2", "int8"])
def test_write_kv_stores_an_independent_quantisation(cache_dtype):
    """The stored bytes equal tests/kv8_case.py's quantisation bit for bit on rounding ties,
    subnormals, signed zeros, saturation and infinities (and NaN: NaN in fp8, 0 in int8),
    with
    a different scale per KV head, from float32 and bfloat16 rows; a negative slot writes
    nothing."""
    values = special_values()
    rows = torch.stack([values, values.flip(0) * 3.0])[None]  # [1, 2 heads, 64]
    k_scale = torch.tensor([1.0, 0.75], device=DEVICE)
    v_scale = torch.tensor([2.0 ** -6, 3.0], device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        key = torch.cat([rows, -rows, torch.full_like(rows, math.nan)]).to(dtype).to(DEVICE)
        value = key.flip(2)
        key_cache = torch.zeros(3, 2, 4, 64, dtype=cache_dtype, device=DEVICE)
        value_cache = torch.zeros_like(key_cache)
        pk.write_kv(key, value, key_cache, value_cache, torch.tensor([5, -1, 10], device=DEVICE),
                    k_scale=k_scale, v_scale=v_scale, backend="triton")
        for token, slot in ((0, 5), (2, 10)):
            block, offset = divmod(slot, 4)
            for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
                got = cache[block, :, offset]
                want = quantize(x[token], scale[:, None], cache_dtype)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        written = torch.zeros(3, 4, dtype=torch.bool, device=DEVICE)
        written[1, 1] = written[2, 2] = True
        assert not key_cache.view(torch.uint8).permute(0, 2, 1, 3)[~written].any()
