"""`paged_kernels.attention.plan`: one plan per step, `run` / `write_kv` per layer.

On every backend available here: the plan's results equal the one-shot calls' bit for bit (same
backend, same arguments) and the float64 oracle within the dtype's tolerance, over several
layers' caches with one plan; NaN fills every cache slot that must not be read. Then the errors:
each names the argument, at plan time for the metadata and at run time for a layer's tensors.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from oracle import attention_oracle, rel_error
from paged_case import make_case
from test_conformance import (
    backend_device,
    config_case,
    feature_kwargs,
    kv_scales,
    scale_kwargs,
    skip_if_unsupported,
)

import paged_kernels as pk
from paged_kernels.attention import paged_attention, plan, write_kv
from paged_kernels.conformance import Config, tolerance

CONFIGS = [
    Config(dtype=torch.bfloat16, batch="decode"),
    Config(dtype=torch.float32, batch="mixed"),
    Config(dtype=torch.float16, batch="chunked", heads=(6, 2), block_size=8,
           features=("sliding_window", "soft_cap", "alibi", "lse", "strided")),
    # an 8-bit cache, each layer with its own scales (given to run, not to plan)
    Config(dtype=torch.bfloat16, batch="decode", kv_cache_dtype=torch.int8,
           scale_form="per_tensor", features=("strided",)),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` (so that NaN compares equal to the same NaN)."""
    return t.contiguous().view(torch.uint8)


def _layers(config: Config, device: str, count: int = 2) -> list:
    """`count` cases with the same metadata and different K/V (one per layer): layer i's K/V
    are layer 0's times (-0.5)**i, exact in every dtype, NaN slots still NaN. With an 8-bit
    cache, layer i has layer 0's bytes and scales times 0.5**i (so its K/V are times 0.5**i)."""
    case = config_case(config, device)
    cases = [case]
    for i in range(1, count):
        if config.kv_cache_dtype is not None:
            f = 0.5 ** i
            cases.append(replace(case, k_scale=[x * f for x in case.k_scale],
                                 v_scale=[x * f for x in case.v_scale],
                                 keys=[t * f for t in case.keys],
                                 values=[t * f for t in case.values]))
            continue
        f = (-0.5) ** i
        # mul_ on a clone keeps the (possibly strided) layout of the cache view
        k, v = case.key_cache.clone(), case.value_cache.clone()
        cases.append(replace(case, key_cache=k.mul_(f), value_cache=v.mul_(f),
                             keys=[t * f for t in case.keys],
                             values=[t * f for t in case.values]))
    return cases


def _plan_for(case, config: Config, backend: str, device: str, **kwargs):
    num_heads, num_kv_heads = config.heads
    return plan(case.block_tables, case.seq_lens, cu_seqlens_q=case.cu_seqlens_q,
                num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=config.head_size,
                block_size=config.block_size, num_blocks=case.key_cache.shape[0],
                dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype, backend=backend,
                **kwargs)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.id for c in CONFIGS])
@pytest.mark.parametrize("backend", pk.registered_backends())
def test_run_equals_one_shot_and_oracle(backend: str, config: Config) -> None:
    device = backend_device(backend)
    skip_if_unsupported(backend, config, device)
    kwargs = feature_kwargs(config, config.heads[0], device)
    want_lse = "lse" in config.features
    cases = _layers(config, device)
    attn = _plan_for(cases[0], config, backend, device, return_lse=want_lse, **kwargs)
    for case in cases:
        scales = scale_kwargs(config, case.k_scale, case.v_scale, device)  # this layer's
        out = torch.full_like(case.query, math.nan)
        got = attn.run(case.query, case.key_cache, case.value_cache, out=out, **scales)
        once = paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                               case.seq_lens, cu_seqlens_q=case.cu_seqlens_q,
                               return_lse=want_lse, backend=backend, **kwargs, **scales)
        if want_lse:
            (got, lse), (once, once_lse) = got, once
            assert torch.equal(_bits(lse), _bits(once_lse))
        assert got is out
        assert torch.equal(_bits(got), _bits(once)), "plan.run differs from paged_attention"
        oracle_kwargs = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
        ref, ref_lse = attention_oracle(case.query, case.keys, case.values, case.q_lens,
                                        **oracle_kwargs)
        assert rel_error(got, ref) <= tolerance(config.dtype)
        if want_lse:
            assert rel_error(lse, ref_lse) <= tolerance(config.dtype)


WRITE_CONFIGS = [Config(dtype=torch.bfloat16, batch="mixed", features=("strided",)),
                 Config(dtype=torch.bfloat16, batch="decode", kv_cache_dtype=torch.float8_e5m2)]


@pytest.mark.parametrize("config", WRITE_CONFIGS, ids=[c.id for c in WRITE_CONFIGS])
@pytest.mark.parametrize("backend", pk.registered_backends())
def test_write_kv_equals_one_shot(backend: str, config: Config) -> None:
    """plan.write_kv equals write_kv bit for bit (an 8-bit cache: with the plan's scales, and
    with a layer's own); float rows land unchanged in their slots (8-bit bytes: the conformance
    suite's bit-exact test)."""
    device = backend_device(backend)
    skip_if_unsupported(backend, config, device)
    case = _layers(config, device, count=1)[0]
    num_tokens, _, head_size = case.query.shape
    num_kv_heads = case.key_cache.shape[1]
    num_slots = case.key_cache.shape[0] * case.key_cache.shape[2]
    gen = torch.Generator().manual_seed(7)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[1] = -1  # skipped
    slots = slots.to(device)
    # strided rows, as a model's fused QKV projection gives them
    rows = torch.randn(num_tokens, 3 * num_kv_heads, head_size, generator=gen).to(config.dtype)
    key, value = rows[:, :num_kv_heads].to(device), rows[:, 2 * num_kv_heads:].to(device)
    scales = scale_kwargs(config, *kv_scales(config, num_kv_heads), device)
    attn = _plan_for(case, config, backend, device, slot_mapping=slots, **scales)
    caches = [(case.key_cache.clone(), case.value_cache.clone()) for _ in range(3)]
    attn.write_kv(key, value, *caches[0])
    write_kv(key, value, *caches[1], slots, backend=backend, **scales)
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(_bits(a), _bits(b)), "plan.write_kv differs from write_kv"
    if scales:  # a layer's own scales replace the plan's
        attn.write_kv(key, value, *caches[2], k_scale=2.0, v_scale=0.5)
        write_kv(key, value, *caches[1], slots, backend=backend, k_scale=2.0, v_scale=0.5)
        for a, b in zip(caches[2], caches[1]):
            assert torch.equal(_bits(a), _bits(b)), "a layer's scales were not used"
        return
    expected = [case.key_cache.clone().cpu(), case.value_cache.clone().cpu()]
    for t, slot in enumerate(slots.tolist()):  # the oracle: one row at a time
        if slot >= 0:
            block, offset = divmod(slot, config.block_size)
            expected[0][block, :, offset] = key[t].cpu()
            expected[1][block, :, offset] = value[t].cpu()
    for got, want in zip(caches[0], expected):
        assert torch.equal(_bits(got.cpu()), _bits(want)), "a slot differs from the oracle"


def _simple(backend: str = "reference", **kwargs):
    """A small decode case and a plan for it (the reference runs everywhere)."""
    case = make_case([5, 17], None, num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                     dtype=torch.float32)
    args = dict(num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                num_blocks=case.key_cache.shape[0], dtype=torch.float32, backend=backend)
    args.update(kwargs)
    return case, args


@pytest.mark.parametrize("change, arg, kind", [
    (dict(num_heads=3), "num_kv_heads", ValueError),
    (dict(head_size=0), "head_size", ValueError),
    (dict(dtype=torch.int32), "dtype", TypeError),
    (dict(num_tokens=3), "num_tokens", ValueError),
    (dict(scale=-1.0), "scale", ValueError),
    (dict(slot_mapping=torch.zeros(2, dtype=torch.int32)), "slot_mapping", TypeError),
    (dict(slot_mapping=torch.zeros(3, dtype=torch.int64)), "slot_mapping", ValueError),
    (dict(alibi_slopes=torch.zeros(3)), "alibi_slopes", ValueError),
    (dict(backend="nope"), "backend", ValueError),
])
def test_plan_errors_name_the_argument(change: dict, arg: str, kind: type) -> None:
    case, args = _simple(**change)
    with pytest.raises(kind, match=f"^{arg}"):
        plan(case.block_tables, case.seq_lens, **args)


def test_plan_metadata_errors() -> None:
    case, args = _simple()
    with pytest.raises(TypeError, match="^block_tables"):
        plan(case.block_tables.long(), case.seq_lens, **args)
    with pytest.raises(ValueError, match="^seq_lens"):
        plan(case.block_tables, case.seq_lens[:1], **args)
    with pytest.raises(ValueError, match="^cu_seqlens_q"):
        plan(case.block_tables, case.seq_lens, cu_seqlens_q=torch.zeros(2, dtype=torch.int32),
             **args)
    bad = case.block_tables.clone()
    bad[1, 0] = 10_000
    # the reference always checks contents; another backend on request
    with pytest.raises(ValueError, match="^block_tables: expected block ids"):
        plan(bad, case.seq_lens, **args)
    if "cpu" in pk.available_backends():
        plan(bad, case.seq_lens, **{**args, "backend": "cpu"})  # unchecked: no error here
        with pytest.raises(ValueError, match="^block_tables: expected block ids"):
            plan(bad, case.seq_lens, check=True, **{**args, "backend": "cpu"})
    with pytest.raises(ValueError, match="^slot_mapping: expected slots"):
        plan(case.block_tables, case.seq_lens,
             slot_mapping=torch.tensor([0, 10_000], dtype=torch.int64), **args)


def test_run_errors_name_the_argument() -> None:
    """A layer's tensors get the one-shot call's checks first (tests/test_abi_errors.py checks
    that every error there is the same through a plan), then are compared with the plan."""
    case, args = _simple()
    attn = plan(case.block_tables, case.seq_lens, **args)
    q, k, v = case.query, case.key_cache, case.value_cache
    with pytest.raises(ValueError, match=r"^query: expected shape \(2, 4, 16\) \(from the plan\)"):
        attn.run(q[:, :2], k, v)
    with pytest.raises(ValueError, match="^query: expected num_tokens == num_seqs=2"):
        attn.run(q[:1], k, v)
    with pytest.raises(TypeError, match="^query: expected dtype torch.float32"):
        attn.run(q.double(), k, v)
    with pytest.raises(TypeError, match=r"^query: expected dtype torch.float32 \(the plan's\)"):
        attn.run(q.half(), k.half(), v.half())
    with pytest.raises(TypeError, match="^query: expected a torch.Tensor"):
        attn.run(q.tolist(), k, v)
    with pytest.raises(ValueError, match="^query: expected a contiguous last dimension"):
        attn.run(q.transpose(0, 2).contiguous().transpose(0, 2), k, v)
    with pytest.raises(ValueError, match=r"^key_cache: expected shape .* \(from the plan\)"):
        attn.run(q, k[:-1], v[:-1])
    with pytest.raises(ValueError, match="^value_cache: expected the key_cache's shape"):
        attn.run(q, k[:-1], v)
    with pytest.raises(TypeError, match="^value_cache: expected dtype"):
        attn.run(q, k, v.half())
    with pytest.raises(ValueError, match=r"^out: expected a torch.float32 tensor of shape "
                                         r"\(2, 4, 16\)"):
        attn.run(q, k, v, out=torch.empty(3, 4, 16))
    with pytest.raises(ValueError, match="^slot_mapping: expected an int64 tensor given to plan"):
        attn.write_kv(k[0, :, :2].transpose(0, 1), k[0, :, :2].transpose(0, 1), k, v)
    with_slots = plan(case.block_tables, case.seq_lens,
                      slot_mapping=torch.tensor([4, 16], dtype=torch.int64), **args)
    with pytest.raises(ValueError, match=r"^key: expected shape \(2, 2, 16\) \(from the plan\)"):
        with_slots.write_kv(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), k, v)
    with pytest.raises(ValueError, match=r"^value: expected the key's shape \(2, 2, 16\)"):
        with_slots.write_kv(torch.zeros(2, 2, 16), torch.zeros(1, 2, 16), k, v)
    with pytest.raises(ValueError, match="^key: expected a contiguous last dimension"):
        with_slots.write_kv(torch.zeros(2, 2, 32)[..., ::2], torch.zeros(2, 2, 16), k, v)


def test_decode_plan_with_no_tokens() -> None:
    """An empty step: nothing to compute, nothing read."""
    attn = plan(torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                num_heads=2, num_kv_heads=1, head_size=8, block_size=4, num_blocks=1,
                dtype=torch.float32, slot_mapping=torch.zeros(0, dtype=torch.int64))
    cache = torch.full((1, 1, 4, 8), math.nan)
    assert attn.run(torch.zeros(0, 2, 8), cache, cache).shape == (0, 2, 8)
    attn.write_kv(torch.zeros(0, 1, 8), torch.zeros(0, 1, 8), cache, cache)
    assert torch.isnan(cache).all()


def test_native_entry_points_are_the_backends_own() -> None:
    """A backend without native entry points gives None; the cpu backend gives its two kernels'
    addresses, the header that types them, and what its own calls pass beyond the tensors."""
    from pathlib import Path

    case, args = _simple()
    reference = plan(case.block_tables, case.seq_lens, **{**args, "backend": "reference"})
    assert reference.native_entry_points() is None
    if "cpu" not in pk.available_backends():
        return
    from cpu_impl import backend as cpu

    entry = plan(case.block_tables, case.seq_lens,
                 **{**args, "backend": "cpu"}).native_entry_points()
    assert (Path(__file__).resolve().parent.parent / entry.header).is_file()
    assert entry.paged_attention > 0 and entry.write_kv > 0
    assert entry.paged_attention != entry.write_kv
    assert (entry.tile, entry.threads, entry.read_ahead, entry.prefetch_lines) == (
        cpu.QUERY_TILE, torch.get_num_threads(), cpu.read_ahead, cpu.prefetch_lines)
