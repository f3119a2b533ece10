"""The Triton backend's registration, launch-config table, split planning and write_kv kernel.

Runs natively on a CUDA device, else in Triton's interpreter on CPU tensors (see
tests/triton_env.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

import paged_kernels as pk
from paged_case import nan_cache
from paged_kernels.abi import check_attention_args
from triton_env import DEVICE  # before triton_impl: skips this module where triton is unusable
from triton_impl import configs, decode, runtime
from triton_impl.backend import TritonBackend

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- registration ---------------------------------------------------------------------------

def test_device_types_and_priority() -> None:
    backend = pk.get_backend("triton")
    reference = pk.get_backend("reference")
    assert backend.support.device_types == frozenset({DEVICE})
    if DEVICE == "cpu":
        assert backend.priority < reference.priority  # the interpreter never wins "auto"
    else:
        assert backend.priority > reference.priority


def test_auto_never_picks_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter "auto" on CPU picks a backend ranked at least as high as the
    reference (the reference itself, or the native cpu backend where it is built), never triton."""
    if DEVICE != "cpu":
        pytest.skip("interpreter-only behaviour")
    monkeypatch.delenv("PAGED_KERNELS_BACKEND", raising=False)
    from paged_kernels.backends import resolve_backend
    picked = resolve_backend("auto", torch.device("cpu"))
    assert picked.name != "triton"
    assert picked.priority >= pk.get_backend("reference").priority


def test_unavailable_without_device_or_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pk.BackendUnavailable, match="TRITON_INTERPRET"):
        TritonBackend()


def test_unsupported_head_size_is_refused() -> None:
    q = torch.zeros(1, 1, 320, device=DEVICE)
    cache = torch.zeros(1, 1, 16, 320, device=DEVICE)
    with pytest.raises(NotImplementedError, match="triton.*head_size 320"):
        pk.paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                           torch.ones(1, dtype=torch.int32, device=DEVICE), backend="triton")


# --- launch configurations ------------------------------------------------------------------

@pytest.mark.parametrize("mode", configs.MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [1, 8, 16, 40, 64, 80, 96, 128, 192, 256])
def test_config_table_covers_supported_shapes(mode: str, dtype: torch.dtype,
                                              head_size: int) -> None:
    cfg = configs.launch_config(mode, head_size, 16, dtype)
    for value in (cfg.tile_n, cfg.block_m, cfg.num_warps):
        assert value & (value - 1) == 0  # powers of two, as tl.arange needs
    assert cfg.tile_n >= 16 and cfg.block_m >= 16  # tl.dot needs >= 16 on the GPU
    assert cfg.num_stages >= 1


@pytest.mark.parametrize("head_size,padded", [(1, 16), (16, 16), (17, 32), (40, 64), (64, 64),
                                              (80, 128), (96, 128), (192, 256), (256, 256)])
def test_padded_head_size(head_size: int, padded: int) -> None:
    assert configs.padded_head_size(head_size) == padded


def test_config_keys() -> None:
    """Non-powers of two share their padded size's entry; float16/bfloat16 share (2 bytes);
    float32 has its own; an override for one exact key wins only for that key."""
    bf16 = configs.launch_config("varlen", 80, 16, torch.bfloat16)
    assert bf16 == configs.launch_config("varlen", 128, 16, torch.float16)
    assert configs._TABLE[("varlen", 128, 4)] == configs.launch_config("varlen", 80, 16,
                                                                          torch.float32)
    special = configs.LaunchConfig(16, 16, 2, 1)
    key = ("decode", 128, 32, torch.bfloat16)
    configs.set_override(*key, special)
    try:
        assert configs.launch_config(*key) == special
        assert configs.launch_config("decode", 128, 16, torch.bfloat16) != special
    finally:
        configs.set_override(*key, None)
    assert configs.launch_config(*key) != special


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="mode"):
        configs.launch_config("prefill", 64, 16, torch.float16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="head_size"):
        configs.launch_config("decode", 512, 16, torch.float16)


# --- split planning -------------------------------------------------------------------------

def _problem(num_seqs: int, kv_heads: int, table_blocks: int, block_size: int = 16,
             window: int | None = None):
    q = torch.zeros(num_seqs, kv_heads, 64, device=DEVICE)
    cache = torch.zeros(1, kv_heads, block_size, 64, device=DEVICE)
    table = torch.zeros(num_seqs, table_blocks, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(num_seqs, dtype=torch.int32, device=DEVICE)
    return check_attention_args(q, cache, cache, table, lens, sliding_window=window)


@pytest.fixture
def clean_split(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(decode.SPLIT_SIZE_ENV, raising=False)
    decode.set_fixed_split_size(None)
    yield monkeypatch
    decode.set_fixed_split_size(None)


def test_split_plan_covers_context(clean_split) -> None:
    for num_seqs, kv_heads, blocks in ((1, 1, 512), (2, 8, 256), (64, 8, 256), (3, 2, 1)):
        p = _problem(num_seqs, kv_heads, blocks)
        size, count = decode.plan_splits(p, 64)
        assert size % 64 == 0 and count >= 1
        assert size * count >= blocks * 16 > size * (count - 1)


def test_split_heuristic_fills_the_device(clean_split) -> None:
    """Few (sequence, KV head) pairs and a long context: the shortest splits; a batch that already
    has many programs per SM or a short context: one split."""
    sms = runtime.num_sms(0)
    assert decode.plan_splits(_problem(1, 1, 1024), 64)[1] > 1
    assert decode.plan_splits(_problem(decode.PROGRAMS_PER_SM * sms, 1, 1024), 64)[1] == 1
    assert decode.plan_splits(_problem(1, 1, 8), 64)[1] == 1  # 128 keys < MIN_SPLIT_TOKENS


@pytest.mark.parametrize("num_seqs,kv_heads,blocks", [(32, 8, 256), (128, 8, 256), (32, 8, 1024),
                                                      (1, 8, 1024), (3, 2, 100), (7, 1, 4096)])
def test_split_heuristic_takes_the_longest_split_that_fills_the_device(
        clean_split, num_seqs: int, kv_heads: int, blocks: int) -> None:
    """The split is MIN_SPLIT_TOKENS * 2^k keys: the longest whose grid still reaches
    PROGRAMS_PER_SM programs per SM (the shortest when none does)."""
    context, programs = blocks * 16, num_seqs * kv_heads
    wanted = decode.PROGRAMS_PER_SM * runtime.num_sms(0)
    size, count = decode.plan_splits(_problem(num_seqs, kv_heads, blocks), 64)
    k = size // decode.MIN_SPLIT_TOKENS
    assert size % decode.MIN_SPLIT_TOKENS == 0 and k & (k - 1) == 0
    assert programs * count >= wanted or size == decode.MIN_SPLIT_TOKENS
    assert size >= context or programs * -(-context // (2 * size)) < wanted


def test_split_window_bounds_context(clean_split) -> None:
    clean_split.setenv(decode.SPLIT_SIZE_ENV, "64")
    assert decode.plan_splits(_problem(1, 1, 1024, window=100), 64) == (64, 3)  # 100 + 63 keys


def test_fixed_split_size_sources(clean_split) -> None:
    p = _problem(1, 1, 64)
    clean_split.setenv(decode.SPLIT_SIZE_ENV, "100")
    assert decode.plan_splits(p, 64) == (128, 8)  # rounded up to the tile
    decode.set_fixed_split_size(512)  # the module setting wins over the environment
    assert decode.plan_splits(p, 64) == (512, 2)
    decode.set_fixed_split_size(None)
    clean_split.setenv(decode.SPLIT_SIZE_ENV, "zero")
    with pytest.raises(ValueError, match=decode.SPLIT_SIZE_ENV):
        decode.plan_splits(p, 64)
    with pytest.raises(ValueError, match="split_size"):
        decode.set_fixed_split_size(0)


# --- write_kv -------------------------------------------------------------------------------

_nan_cache = functools.partial(nan_cache, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nhd", [False, True], ids=["hnd", "nhd"])
@pytest.mark.parametrize("shape", [(2, 64, 16), (3, 40, 8), (1, 256, 32)],
                         ids=["gqa", "nonpow2", "big-head"])
def test_write_kv(dtype: torch.dtype, nhd: bool, shape: tuple[int, int, int]) -> None:
    kv_heads, head_size, block_size = shape
    num_blocks, num_tokens = 5, 11
    gen = torch.Generator().manual_seed(1)
    k_cache = _nan_cache(num_blocks, kv_heads, block_size, head_size, dtype, nhd=nhd)
    v_cache = _nan_cache(num_blocks, kv_heads, block_size, head_size, dtype, nhd=nhd)
    # key/value as non-contiguous slices of a fused qkv-like tensor
    fused = torch.randn(num_tokens, 2 * kv_heads + 1, head_size, generator=gen).to(dtype)
    fused = fused.to(DEVICE)
    key, value = fused[:, :kv_heads], fused[:, kv_heads + 1:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    pk.write_kv(key, value, k_cache, v_cache, slots, backend="triton")

    want_k = _nan_cache(num_blocks, kv_heads, block_size, head_size, dtype, nhd=nhd)
    want_v = _nan_cache(num_blocks, kv_heads, block_size, head_size, dtype, nhd=nhd)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // block_size, :, slot % block_size] = key[t]
            want_v[slot // block_size, :, slot % block_size] = value[t]
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)


def test_write_kv_out_of_range_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without content checks a slot past the cache is skipped (never written out of bounds);
    with PAGED_KERNELS_CHECK=1 it raises ValueError naming slot_mapping."""
    k_cache = _nan_cache(2, 1, 8, 16, torch.float32)
    v_cache = _nan_cache(2, 1, 8, 16, torch.float32)
    rows = torch.ones(2, 1, 16, device=DEVICE)
    slots = torch.tensor([3, 16], device=DEVICE)
    monkeypatch.delenv("PAGED_KERNELS_CHECK", raising=False)
    pk.write_kv(rows, rows, k_cache, v_cache, slots, backend="triton")
    assert (k_cache[0, 0, 3] == 1).all() and int(torch.isnan(k_cache).sum()) == 15 * 16
    monkeypatch.setenv("PAGED_KERNELS_CHECK", "1")
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.write_kv(rows, rows, k_cache, v_cache, slots, backend="triton")


def test_write_kv_then_attend_roundtrip() -> None:
    """Rows written by the Triton write_kv are what the Triton attention reads: a single visible
    key makes the output equal to its value row."""
    k_cache = _nan_cache(4, 2, 16, 32, torch.float16)
    v_cache = _nan_cache(4, 2, 16, 32, torch.float16)
    key = torch.randn(1, 2, 32, device=DEVICE).half()
    value = torch.randn(1, 2, 32, device=DEVICE).half()
    pk.write_kv(key, value, k_cache, v_cache, torch.tensor([2 * 16], device=DEVICE),
                backend="triton")
    q = torch.randn(1, 4, 32, device=DEVICE).half()
    out = pk.paged_attention(q, k_cache, v_cache, torch.tensor([[2]], dtype=torch.int32,
                                                              device=DEVICE),
                             torch.tensor([1], dtype=torch.int32, device=DEVICE),
                             backend="triton")
    assert torch.equal(out, value.repeat_interleave(2, dim=1))


def test_write_kv_strided_slot_mapping() -> None:
    k_cache = _nan_cache(2, 1, 8, 16, torch.float32)
    v_cache = _nan_cache(2, 1, 8, 16, torch.float32)
    rows = torch.arange(3 * 16, dtype=torch.float32, device=DEVICE).view(3, 1, 16)
    slots = torch.tensor([[5, 0], [-1, 0], [9, 0]], device=DEVICE)[:, 0]
    pk.write_kv(rows, rows, k_cache, v_cache, slots, backend="triton")
    assert torch.equal(k_cache[0, 0, 5], rows[0, 0]) and torch.equal(k_cache[1, 0, 1], rows[2, 0])
    assert int(torch.isnan(k_cache).sum()) == 14 * 16
