"""Every available backend against the float64 oracle and against the reference backend.

One parametrised suite for all backends: a backend's declared `Support` turns configurations it
does not handle into explicit skips that say why, so this suite is also the support table.

8-bit caches: the case holds the bytes of the test's own quantisation (tests/oracle.py) and the
oracle reads their float64 dequantisation, so the tolerance is the query dtype's as for a float
cache; `write_kv`'s stored bytes must equal that quantisation bit for bit; slots that must not be
read are NaN in fp8, and an int8 result must not change with the poison byte.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

import paged_kernels as pk
from oracle import attention_oracle, fp8_decode, quantize_oracle, rel_error
from paged_case import PagedCase, make_case
from paged_kernels.conformance import (
    KV_CACHE_DTYPES,
    Config,
    batch_lengths,
    exhaustive_matrix,
    fast_matrix,
    tolerance,
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "config" in metafunc.fixturenames:
        exhaustive = metafunc.config.getoption("--exhaustive")
        configs = list(exhaustive_matrix()) if exhaustive else fast_matrix()
        metafunc.parametrize("config", configs, ids=[c.id for c in configs])
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", pk.registered_backends())


def backend_device(name: str) -> str:
    """The device a backend is tested on here, or skips with the reason it is unavailable."""
    if name not in pk.available_backends():
        pytest.skip(f"{name} unavailable here: {pk.unavailable_backends().get(name)}")
    types = pk.get_backend(name).support.device_types
    if "cuda" in types and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def skip_if_unsupported(name: str, config: Config, device: str) -> None:
    why = pk.get_backend(name).support.unsupported(
        config.dtype, config.head_size, config.block_size, config.api_features(), device,
        config.kv_cache_dtype)
    if why is not None:
        pytest.skip(f"{name} declares no support for {why}")


#: Per-tensor scales that put |x| <= 4 at the top of each 8-bit format's range.
BASE_SCALES = {torch.float8_e4m3fn: 4 / 448, torch.float8_e5m2: 4 / 57344, torch.int8: 4 / 127}


def kv_scales(config: Config, num_kv_heads: int
              ) -> tuple[Optional[list[float]], Optional[list[float]]]:
    """The per-KV-head scales (K, V) of a config's 8-bit cache, or (None, None). Per head they
    differ, and head 0's saturates the larger values (|x| > 2.4)."""
    if config.kv_cache_dtype is None:
        return None, None
    base = BASE_SCALES[config.kv_cache_dtype]
    if config.scale_form == "per_tensor":
        return [base] * num_kv_heads, [1.25 * base] * num_kv_heads
    return ([base * (0.6 + 0.5 * h) for h in range(num_kv_heads)],
            [base * (0.8 + 0.25 * h) for h in range(num_kv_heads)])


def scale_kwargs(config: Config, k_scale: Optional[list[float]], v_scale: Optional[list[float]],
                 device: str) -> dict:
    """The API's `k_scale`/`v_scale` for a config: per tensor, a float for K and a one-element
    tensor for V (both per-tensor forms); per head, float32 `[num_kv_heads]` tensors."""
    if k_scale is None or v_scale is None:
        return {}
    if config.scale_form == "per_tensor":
        return {"k_scale": k_scale[0], "v_scale": torch.tensor(v_scale[:1], device=device)}
    return {"k_scale": torch.tensor(k_scale, device=device),
            "v_scale": torch.tensor(v_scale, device=device)}


def config_case(config: Config, device: str, seed: int = 0, **extra) -> PagedCase:
    """The config's random case (8-bit caches with `kv_scales`)."""
    seq_lens, q_lens = batch_lengths(config.batch, config.block_size)
    num_heads, num_kv_heads = config.heads
    k_scale, v_scale = kv_scales(config, num_kv_heads)
    return make_case(seq_lens, q_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=config.head_size, block_size=config.block_size,
                     dtype=config.dtype, seed=seed, nhd="strided" in config.features,
                     share_prefix="shared_prefix" in config.features, device=device,
                     kv_cache_dtype=config.kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
                     **extra)


def feature_kwargs(config: Config, num_heads: int, device: str) -> dict:
    kwargs: dict = {}
    if "sliding_window" in config.features:
        kwargs["sliding_window"] = config.block_size + 3
    if "soft_cap" in config.features:
        kwargs["soft_cap"] = 2.5
    if "alibi" in config.features:
        kwargs["alibi_slopes"] = torch.tensor(
            [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)], device=device)
    return kwargs


def run_config(name: str, config: Config, seed: int = 0) -> None:
    device = backend_device(name)
    skip_if_unsupported(name, config, device)
    case = config_case(config, device, seed)
    kwargs = {**feature_kwargs(config, config.heads[0], device),
              **scale_kwargs(config, case.k_scale, case.v_scale, device)}
    want_lse = "lse" in config.features
    out = torch.full_like(case.query, math.nan)  # every element must be written
    result = pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out,
                                return_lse=want_lse, backend=name, **kwargs)
    got, lse = result if want_lse else (result, None)
    assert got is out
    oracle_kwargs = {k: v for k, v in kwargs.items() if k not in ("k_scale", "v_scale")}
    if "alibi_slopes" in oracle_kwargs:
        oracle_kwargs["alibi_slopes"] = oracle_kwargs["alibi_slopes"].cpu()
    ref_out, ref_lse = attention_oracle(case.query, case.keys, case.values, case.q_lens,
                                        **oracle_kwargs)
    tol = tolerance(config.dtype)
    assert rel_error(got, ref_out) <= tol, f"out vs oracle: {rel_error(got, ref_out):.3g}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == case.query.shape[:2]
        assert rel_error(lse, ref_lse) <= tol, f"lse vs oracle: {rel_error(lse, ref_lse):.3g}"
    if name != "reference":
        same = pk.paged_attention(case.query.cpu(), case.key_cache.cpu(), case.value_cache.cpu(),
                                  case.block_tables.cpu(), case.seq_lens.cpu(),
                                  cu_seqlens_q=None if case.cu_seqlens_q is None
                                  else case.cu_seqlens_q.cpu(), backend="reference",
                                  **{k: (v.cpu() if torch.is_tensor(v) else v)
                                     for k, v in kwargs.items()})
        assert rel_error(got, same) <= 2 * tol, f"vs reference: {rel_error(got, same):.3g}"


def test_against_oracle(backend: str, config: Config) -> None:
    run_config(backend, config)


@pytest.mark.parametrize("seed", [1, 2])
def test_decode_long_context(backend: str, seed: int) -> None:
    """Many blocks per sequence, so split-K paths engage in the fast backends."""
    config = Config(dtype=torch.bfloat16, head_size=128, block_size=16, heads=(8, 2),
                    batch="decode")
    device = backend_device(backend)
    skip_if_unsupported(backend, config, device)
    lens = [700, 33, 1]
    case = make_case(lens, None, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=torch.bfloat16, seed=seed, device=device)
    got = pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                             case.seq_lens, backend=backend)
    ref, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens)
    assert rel_error(got, ref) <= tolerance(torch.bfloat16)


def test_strided_out_written_in_place(backend: str) -> None:
    config = Config(dtype=torch.float32, batch="mixed")
    device = backend_device(backend)
    skip_if_unsupported(backend, config, device)
    seq_lens, q_lens = batch_lengths("mixed", 16)
    case = make_case(seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float32, seed=3, device=device)
    storage = torch.full((case.query.shape[0], 8, 2 * 64), math.nan, device=device)
    out = storage[:, :, :64]  # last dim contiguous, others strided
    pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                       case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out, backend=backend)
    ref, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens)
    assert rel_error(out, ref) <= 1e-5
    assert torch.isnan(storage[:, :, 64:]).all(), "wrote outside out"


def _special_rows(num_tokens: int, num_kv_heads: int, head_size: int, scale: list[float],
                  dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random rows in `dtype` with the format's edge cases planted at known places: values that
    saturate (and infinities), exact ties of int8 rounding, tiny values, signed zeros, NaN."""
    x = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 3
    s = torch.tensor(scale)
    edge = torch.tensor([1e6, -1e6, math.inf, -math.inf, 2.5, -2.5, 3.5, 0.5, 1e-7, -1e-7, 0.0,
                         -0.0, math.nan])
    for h in range(num_kv_heads):
        n = min(edge.numel(), head_size)
        # a multiple of the scale (ties stay ties in float32 up to rounding of the product)
        x[0, h, :n] = edge[:n] * s[h]
    return x.to(dtype)


@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("rows_dtype,form", [(torch.float32, "per_head"),
                                             (torch.bfloat16, "per_tensor")], ids=str)
def test_write_kv_stores_the_independent_quantisation(backend, kv_dtype, rows_dtype, form):
    """Every stored byte equals the test's own quantisation (NaN: any NaN byte in fp8), every
    slot not written keeps its poison, one-shot and through a plan alike."""
    config = Config(dtype=rows_dtype, kv_cache_dtype=kv_dtype, scale_form=form)
    device = backend_device(backend)
    skip_if_unsupported(backend, config, device)
    num_blocks, heads, block_size, head_size, n = 3, 2, 8, config.head_size, 12
    gen = torch.Generator().manual_seed(11)
    k_scale, v_scale = kv_scales(config, heads)
    key = _special_rows(n, heads, head_size, k_scale, rows_dtype, gen)
    value = _special_rows(n, heads, head_size, v_scale, rows_dtype, gen).flip(0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[3] = -1
    shape = (num_blocks, heads, block_size, head_size)
    kwargs = scale_kwargs(config, k_scale, v_scale, device)
    for path in ("one-shot", "plan"):
        caches = [torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(kv_dtype)
                  for _ in range(2)]
        args = (key.to(device), value.to(device), *caches)
        if path == "one-shot":
            pk.write_kv(*args, slots.to(device), backend=backend, **kwargs)
        else:
            ones = torch.ones(n, 1, dtype=torch.int32, device=device)
            attn = pk.plan(ones, ones[:, 0], num_heads=heads, num_kv_heads=heads,
                           head_size=head_size, block_size=block_size, num_blocks=num_blocks,
                           dtype=rows_dtype, kv_cache_dtype=kv_dtype, slot_mapping=slots.to(device),
                           backend=backend)
            attn.write_kv(*args, **kwargs)
        for rows, scale, cache in ((key, k_scale, caches[0]), (value, v_scale, caches[1])):
            _assert_stored(rows, scale, cache.cpu(), slots, kv_dtype, path)


def _nan_bytes(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Which fp8 bytes (uint8) encode NaN, by the oracle's decoding of the format."""
    table = torch.tensor([math.isnan(fp8_decode(c, dtype)) for c in range(256)])
    return table[codes.long()]


def _assert_stored(rows: torch.Tensor, scale: list[float], cache: torch.Tensor,
                   slots: torch.Tensor, kv_dtype: torch.dtype, path: str) -> None:
    block_size = cache.shape[2]
    want = quantize_oracle(rows, scale, kv_dtype)
    got_bytes = cache.view(torch.uint8).permute(0, 2, 1, 3).reshape(-1, *cache.shape[1:2],
                                                                     cache.shape[3])
    written = torch.zeros(got_bytes.shape[0], dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        got = got_bytes[slot]
        if kv_dtype != torch.int8:
            nan = _nan_bytes(want[i], kv_dtype)
            assert torch.equal(nan, _nan_bytes(got, kv_dtype)), (
                f"{path}: NaN placement differs in slot {slot}")
            got, expected = got[~nan], want[i][~nan]
        else:
            expected = want[i]
        mismatch = (got != expected).nonzero()
        assert not mismatch.numel(), (
            f"{path}: slot {slot} ({slot // block_size}, {slot % block_size}): "
            f"{mismatch.shape[0]} bytes differ, first at {mismatch[0].tolist()}: got "
            f"{int(got[tuple(mismatch[0])])}, want {int(expected[tuple(mismatch[0])])}")
    assert bool((got_bytes[~written] == 0x7F).all()), f"{path}: wrote a slot it was not given"


def test_int8_result_does_not_depend_on_the_poison(backend):
    """int8 has no NaN: the slots that must not be read hold 127, then -128; the results must
    be equal bit for bit (and match the oracle). A mixed batch: prefill, chunked prefill and
    decode rows."""
    config = Config(batch="mixed", kv_cache_dtype=torch.int8)
    device = backend_device(backend)
    skip_if_unsupported(backend, config, device)
    outs = []
    for poison in (0x7F, 0x80):
        case = config_case(config, device, seed=5, poison_byte=poison, table_pad="nan_block")
        kwargs = scale_kwargs(config, case.k_scale, case.v_scale, device)
        outs.append(pk.paged_attention(case.query, case.key_cache, case.value_cache,
                                       case.block_tables, case.seq_lens,
                                       cu_seqlens_q=case.cu_seqlens_q, backend=backend,
                                       **kwargs))
    ref, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens)
    assert rel_error(outs[0], ref) <= tolerance(config.dtype)
    assert torch.equal(outs[0], outs[1])
