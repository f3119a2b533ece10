"""Every available backend against the float64 oracle and against the reference backend.

One parametrised suite for all backends: a backend's declared `Support` turns configurations it
does not handle into explicit skips that say why, so this suite is also the support table.
"""

from __future__ import annotations

import math

import pytest
import torch

import paged_kernels as pk
from oracle import attention_oracle, rel_error
from paged_case import make_case
from paged_kernels.conformance import (
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
        config.dtype, config.head_size, config.block_size, config.api_features(), device)
    if why is not None:
        pytest.skip(f"{name} declares no support for {why}")


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
    seq_lens, q_lens = batch_lengths(config.batch, config.block_size)
    num_heads, num_kv_heads = config.heads
    case = make_case(seq_lens, q_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=config.head_size, block_size=config.block_size,
                     dtype=config.dtype, seed=seed, nhd="strided" in config.features,
                     share_prefix="shared_prefix" in config.features, device=device)
    kwargs = feature_kwargs(config, num_heads, device)
    want_lse = "lse" in config.features
    out = torch.full_like(case.query, math.nan)  # every element must be written
    result = pk.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                case.seq_lens, cu_seqlens_q=case.cu_seqlens_q, out=out,
                                return_lse=want_lse, backend=name, **kwargs)
    got, lse = result if want_lse else (result, None)
    assert got is out
    oracle_kwargs = {**kwargs}
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
