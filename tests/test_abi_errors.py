"""Every bad input listed in docs/abi.md raises the documented error, naming the argument, and
the same error through a plan (`plan(...)` then `run` / `write_kv`) as through the one-shot call.
"""

from __future__ import annotations

import pytest
import torch

import paged_kernels as pk
from paged_case import make_case
from paged_kernels.abi import FEATURES, Support
from paged_kernels.attention import plan
from paged_kernels.backends import _REGISTRY, Backend, _instances


@pytest.fixture
def case():
    return make_case([5, 20], [2, 3], num_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                     dtype=torch.float32)


def _arguments(case, overrides: dict) -> dict:
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens,
                cu_seqlens_q=case.cu_seqlens_q)
    args.update(overrides)
    return args


def call(case, **overrides):
    """The one-shot `paged_attention` on the fixture's arguments, some replaced."""
    args = _arguments(case, overrides)
    return pk.paged_attention(args.pop("query"), args.pop("key_cache"), args.pop("value_cache"),
                              args.pop("block_tables"), args.pop("seq_lens"), **args)


def call_planned(case, scales_at="plan", **overrides):
    """The same call through a plan: `plan(<metadata and options>)` for the fixture's layout (the
    model's), then `run(<the layer's tensors>)`; an 8-bit cache's scales go to `plan` or, with
    `scales_at="run"`, to `run` (a layer's own scales)."""
    args = _arguments(case, overrides)
    layer = [args.pop(name) for name in ("query", "key_cache", "value_cache")]
    scales = {}
    if scales_at == "run":
        scales = {name: args.pop(name) for name in ("k_scale", "v_scale") if name in args}
    out = args.pop("out", None)
    _, num_heads, head_size = case.query.shape
    num_blocks, num_kv_heads, block_size, _ = case.key_cache.shape
    if isinstance(layer[1], torch.Tensor) and layer[1].dtype in EIGHT_BIT:
        args["kv_cache_dtype"] = layer[1].dtype  # the model's cache dtype, known to the plan
    attn = plan(args.pop("block_tables"), args.pop("seq_lens"), num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                num_blocks=num_blocks, dtype=case.query.dtype, **args)
    return attn.run(*layer, out=out, **scales)


def raised(fn, *args, **kwargs) -> Exception:
    """The exception `fn(*args, **kwargs)` raises (failing the test when it raises none)."""
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value


EIGHT_BIT = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def as_8bit(cache: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Zero bytes in an 8-bit cache of `cache`'s shape (the values do not matter to the checks)."""
    return torch.zeros(cache.shape, dtype=torch.uint8).view(dtype)


def quantized(c, dtype: torch.dtype = torch.int8, **scales) -> dict:
    """Overrides that make the fixture's caches 8-bit, with the given scales (default 1.0), on
    the reference backend (which declares every 8-bit cache dtype)."""
    return {"key_cache": as_8bit(c.key_cache, dtype), "value_cache": as_8bit(c.value_cache, dtype),
            "k_scale": 1.0, "v_scale": 1.0, "backend": "reference", **scales}


BAD_ARGS = [
    # (name, overrides builder, error type, words that must appear)
    ("2-D query", lambda c: {"query": c.query[:, 0]}, ValueError, ["query", "3-D"]),
    ("int query", lambda c: {"query": c.query.long()}, TypeError, ["query", "dtype"]),
    ("not a tensor", lambda c: {"query": [1.0]}, TypeError, ["query", "torch.Tensor"]),
    ("head size mismatch", lambda c: {"query": torch.randn(5, 4, 16)}, ValueError,
     ["key_cache", "head_size 16"]),
    ("heads not a multiple", lambda c: {"query": torch.randn(5, 3, 8)}, ValueError,
     ["num_kv_heads", "num_heads=3"]),
    ("cache dtype", lambda c: {"key_cache": c.key_cache.half()}, TypeError,
     ["key_cache", "float32"]),
    ("value shape", lambda c: {"value_cache": c.value_cache[:-1]}, ValueError, ["value_cache"]),
    ("3-D cache", lambda c: {"key_cache": c.key_cache[0]}, ValueError, ["key_cache", "4-D"]),
    ("cache last dim strided",
     lambda c: {"key_cache": torch.randn(*c.key_cache.shape[:3], 16)[..., ::2]}, ValueError,
     ["key_cache", "contiguous"]),
    ("float block table", lambda c: {"block_tables": c.block_tables.float()}, TypeError,
     ["block_tables", "int32"]),
    ("int64 seq_lens", lambda c: {"seq_lens": c.seq_lens.long()}, TypeError,
     ["seq_lens", "int32"]),
    ("seq_lens length", lambda c: {"seq_lens": c.seq_lens[:1]}, ValueError,
     ["seq_lens", "shape [2]"]),
    ("cu_seqlens_q length", lambda c: {"cu_seqlens_q": c.cu_seqlens_q[:2]}, ValueError,
     ["cu_seqlens_q", "shape [3]"]),
    ("decode with many tokens", lambda c: {"cu_seqlens_q": None}, ValueError,
     ["query", "num_tokens == num_seqs"]),
    ("bad scale", lambda c: {"scale": -1.0}, ValueError, ["scale"]),
    ("bad window", lambda c: {"sliding_window": 0}, ValueError, ["sliding_window"]),
    ("bad soft cap", lambda c: {"soft_cap": float("inf")}, ValueError, ["soft_cap"]),
    ("alibi shape", lambda c: {"alibi_slopes": torch.ones(2)}, ValueError,
     ["alibi_slopes", "(4,)"]),
    ("out shape", lambda c: {"out": torch.empty(1, 4, 8)}, ValueError, ["out"]),
    ("out dtype", lambda c: {"out": torch.empty_like(c.query).half()}, ValueError, ["out"]),
    ("unknown backend", lambda c: {"backend": "nope"}, ValueError, ["backend", "nope"]),
    ("block id out of range", lambda c: {"block_tables": c.block_tables.clone().fill_(10**6)},
     ValueError, ["block_tables", "block ids in"]),
    ("seq_len beyond table", lambda c: {"seq_lens": torch.tensor([5, 10**5],
                                                                 dtype=torch.int32)},
     ValueError, ["seq_lens", "max_blocks_per_seq"]),
    ("q_len > seq_len", lambda c: {"cu_seqlens_q": torch.tensor([0, 6, 9], dtype=torch.int32),
                                   "query": torch.randn(9, 4, 8)},
     ValueError, ["cu_seqlens_q", "q_len 6 > seq_len 5"]),
    ("cu_seqlens_q decreasing", lambda c: {"cu_seqlens_q": torch.tensor([0, 4, 3],
                                                                        dtype=torch.int32),
                                           "query": torch.randn(3, 4, 8)},
     ValueError, ["cu_seqlens_q", "non-decreasing"]),
    # 8-bit caches and their scales
    ("k_scale with a float cache", lambda c: {"k_scale": 1.0}, TypeError,
     ["k_scale", "None with a torch.float32 cache"]),
    ("v_scale with a float cache", lambda c: {"v_scale": torch.ones(1)}, TypeError,
     ["v_scale", "None with a torch.float32 cache"]),
    ("k_scale missing", lambda c: quantized(c, k_scale=None), TypeError,
     ["k_scale", "torch.int8 cache", "got None"]),
    ("v_scale missing", lambda c: quantized(c, torch.float8_e5m2, v_scale=None), TypeError,
     ["v_scale", "torch.float8_e5m2 cache"]),
    ("8-bit key, float value", lambda c: {**quantized(c), "value_cache": c.value_cache},
     ValueError, ["value_cache", "dtype torch.int8 (the key_cache's)"]),
    ("two 8-bit types", lambda c: {**quantized(c, torch.float8_e4m3fn),
                                   "value_cache": as_8bit(c.value_cache, torch.float8_e5m2)},
     ValueError, ["value_cache", "dtype torch.float8_e4m3fn"]),
    ("16-bit cache", lambda c: {"key_cache": c.key_cache.short()}, TypeError,
     ["key_cache", "8-bit cache dtype"]),
    ("scale shape", lambda c: quantized(c, k_scale=torch.ones(3)), ValueError,
     ["k_scale", "(1,) (per tensor) or (2,) (per KV head)", "shape (3,)"]),
    ("scale 2-D", lambda c: quantized(c, v_scale=torch.ones(1, 2)), ValueError,
     ["v_scale", "shape (1, 2)"]),
    ("scale dtype", lambda c: quantized(c, k_scale=torch.ones(2, dtype=torch.float64)),
     ValueError, ["k_scale", "float32", "torch.float64"]),
    ("scale device", lambda c: quantized(c, k_scale=torch.ones(2, device="meta")), ValueError,
     ["k_scale", "on cpu (the cache's device)", "on meta"]),
    ("scale not a number", lambda c: quantized(c, k_scale="1"), TypeError,
     ["k_scale", "a float or a float32 tensor", "str"]),
    ("negative scale", lambda c: quantized(c, k_scale=-0.5), ValueError,
     ["k_scale", "finite scale > 0", "-0.5"]),
    ("infinite scale", lambda c: quantized(c, v_scale=float("inf")), ValueError,
     ["v_scale", "finite scale > 0", "inf"]),
    ("scale beyond float32", lambda c: quantized(c, k_scale=1e39), ValueError,
     ["k_scale", "finite scale > 0 (as a float32)", "1e+39"]),
    ("scale below float32", lambda c: quantized(c, k_scale=1e-50), ValueError,
     ["k_scale", "finite scale > 0 (as a float32)", "1e-50"]),
    ("zero in a scale tensor", lambda c: quantized(c, v_scale=torch.tensor([1.0, 0.0])),
     ValueError, ["v_scale", "finite scales > 0", "[1.0, 0.0]"]),
    ("NaN scale tensor", lambda c: quantized(c, k_scale=torch.tensor([float("nan")])),
     ValueError, ["k_scale", "finite scales > 0", "nan"]),
    ("inf in a scale tensor", lambda c: quantized(c, k_scale=torch.tensor([1.0, float("inf")])),
     ValueError, ["k_scale", "finite scales > 0", "inf"]),
]


@pytest.mark.parametrize("name,make,error,words", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_bad_attention_input(case, name, make, error, words):
    with pytest.raises(error) as info:
        call(case, **make(case))
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.parametrize("scales_at", ["plan", "run"])
@pytest.mark.parametrize("name,make,error,words", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_plan_raises_what_the_one_shot_call_raises(case, name, make, error, words, scales_at):
    """Every bad input, through `plan(...).run(...)`: the same type and message, raised by
    `plan()` (the metadata) or by `run()` (the layer's tensors, and the scales given to it)."""
    once = raised(call, case, **make(case))
    planned = raised(call_planned, case, scales_at, **make(case))
    assert (type(planned), str(planned)) == (type(once), str(once))


def test_block_table_padding_is_never_checked(case):
    """Entries past ceil(seq_len / block_size) may hold anything: no error."""
    assert (case.block_tables[:, -1] != 0).all()
    call(case)


def test_unsupported_feature_names_backend_and_feature(case):
    from paged_kernels.abi import Support
    from paged_kernels.backends import Backend, _instances, _REGISTRY

    class Narrow(Backend):
        name = "narrow-test"
        support = Support(dtypes=frozenset({torch.float32}), device_types=frozenset({"cpu"}),
                          features=frozenset({"varlen"}))

        def paged_attention(self, problem):  # pragma: no cover - must not be reached
            raise AssertionError("called despite unsupported feature")

        def write_kv(self, *args):  # pragma: no cover
            raise AssertionError

    _REGISTRY["narrow-test"] = "unused:unused"
    _instances["narrow-test"] = Narrow()
    try:
        with pytest.raises(NotImplementedError, match="'narrow-test'.*soft_cap"):
            call(case, soft_cap=3.0, backend="narrow-test")
    finally:
        del _REGISTRY["narrow-test"], _instances["narrow-test"]


class EightBitless(Backend):
    """A backend that supports every float configuration and no 8-bit cache."""

    name = "no-8bit-test"
    support = Support(dtypes=frozenset({torch.float32}), device_types=frozenset({"cpu"}),
                      features=frozenset(FEATURES))

    def paged_attention(self, problem):  # pragma: no cover - must not be reached
        raise AssertionError("called with an 8-bit cache it does not declare")

    def write_kv(self, *args, **kwargs):  # pragma: no cover
        raise AssertionError("called with an 8-bit cache it does not declare")


@pytest.fixture
def no_8bit_backend():
    _REGISTRY[EightBitless.name] = "unused:unused"
    _instances[EightBitless.name] = EightBitless()
    yield EightBitless.name
    del _REGISTRY[EightBitless.name], _instances[EightBitless.name]


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=str)
def test_undeclared_8bit_cache_is_refused_on_every_path(case, no_8bit_backend, dtype):
    """A backend whose Support lists no 8-bit dtype raises NotImplementedError naming itself
    and the dtype, through paged_attention, plan + run, write_kv and plan + write_kv."""
    words = f"backend '{no_8bit_backend}' does not support KV cache dtype {dtype}"
    args = {**quantized(case, dtype), "backend": no_8bit_backend}
    for fn in (call, call_planned):
        with pytest.raises(NotImplementedError, match=words):
            fn(case, **args)
    k8, v8 = as_8bit(torch.zeros(CACHE_SHAPE), dtype), as_8bit(torch.zeros(CACHE_SHAPE), dtype)
    with pytest.raises(NotImplementedError, match=words):
        pk.write_kv(*kv_rows(), k8, v8, torch.tensor([0, 1, 2]), k_scale=1.0, v_scale=1.0,
                    backend=no_8bit_backend)
    with pytest.raises(NotImplementedError, match=words):
        write_planned(*kv_rows(), k8, v8, torch.tensor([0, 1, 2]), k_scale=1.0, v_scale=1.0,
                      backend=no_8bit_backend)


def test_forced_backend_env(case, monkeypatch):
    monkeypatch.setenv("PAGED_KERNELS_BACKEND", "nope")
    with pytest.raises(ValueError, match="backend"):
        call(case)
    monkeypatch.setenv("PAGED_KERNELS_BACKEND", "reference")
    call(case)


def kv_rows(n=3):
    return torch.randn(n, 2, 8), torch.randn(n, 2, 8)


CACHE_SHAPE = (4, 2, 4, 8)  # [num_blocks, num_kv_heads, block_size, head_size]
CACHE = lambda: (torch.zeros(CACHE_SHAPE), torch.zeros(CACHE_SHAPE))  # noqa: E731


def write_planned(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None,
                  backend="reference", scales_at="plan"):
    """`write_kv` through a plan: `plan(..., slot_mapping=slot_mapping)` for a decode step of
    `kv_rows()`' 3 tokens over CACHE_SHAPE in the key's dtype (the key cache's dtype when it is
    8-bit), then `write_kv(<the layer's tensors>)`; the scales go to `plan` or `write_kv`."""
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if scales_at == "plan":
        k_scale, v_scale = scales.pop("k_scale"), scales.pop("v_scale")
    else:
        k_scale = v_scale = None
    num_blocks, num_kv_heads, block_size, head_size = CACHE_SHAPE
    num_tokens = kv_rows()[0].shape[0]
    cache_dtype = key_cache.dtype if key_cache.dtype in EIGHT_BIT else None
    attn = plan(torch.zeros(num_tokens, 1, dtype=torch.int32),
                torch.ones(num_tokens, dtype=torch.int32), num_heads=num_kv_heads,
                num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                num_blocks=num_blocks, dtype=key.dtype if key.is_floating_point() else
                torch.float32, slot_mapping=slot_mapping,
                kv_cache_dtype=cache_dtype, k_scale=k_scale, v_scale=v_scale, backend=backend)
    attn.write_kv(key, value, key_cache, value_cache, **scales)


BAD_WRITES = [
    ("slot dtype", lambda: (*kv_rows(), *CACHE(), torch.tensor([0, 1, 2], dtype=torch.int32)),
     TypeError, ["slot_mapping", "int64"]),
    ("slot length", lambda: (*kv_rows(), *CACHE(), torch.tensor([0, 1])), ValueError,
     ["slot_mapping", "shape [3]"]),
    ("key heads", lambda: (torch.randn(3, 1, 8), torch.randn(3, 1, 8), *CACHE(),
                           torch.tensor([0, 1, 2])), ValueError, ["key", "[num_tokens, 2, 8]"]),
    ("value dtype", lambda: (torch.randn(3, 2, 8), torch.randn(3, 2, 8).half(), *CACHE(),
                             torch.tensor([0, 1, 2])), ValueError, ["value"]),
    ("slot out of range", lambda: (*kv_rows(), *CACHE(), torch.tensor([0, 1, 16])), ValueError,
     ["slot_mapping", "16"]),
]


@pytest.mark.parametrize("name,make,error,words", BAD_WRITES, ids=[b[0] for b in BAD_WRITES])
def test_bad_write_kv(name, make, error, words):
    with pytest.raises(error) as info:
        pk.write_kv(*make(), backend="reference")
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("name,make,error,words", BAD_WRITES, ids=[b[0] for b in BAD_WRITES])
def test_planned_write_raises_what_the_one_shot_write_raises(name, make, error, words):
    once = raised(pk.write_kv, *make(), backend="reference")
    planned = raised(write_planned, *make())
    assert (type(planned), str(planned)) == (type(once), str(once))


def CACHE8(dtype=torch.int8):  # noqa: N802
    return as_8bit(torch.zeros(CACHE_SHAPE), dtype), as_8bit(torch.zeros(CACHE_SHAPE), dtype)


SLOTS = lambda: torch.tensor([0, 1, 2])  # noqa: E731
BAD_8BIT_WRITES = [
    # (name, make -> (args, scales), error type, words that must appear)
    ("scale with a float cache", lambda: ((*kv_rows(), *CACHE(), SLOTS()), {"k_scale": 2.0}),
     TypeError, ["k_scale", "None with a torch.float32 cache"]),
    ("v_scale missing", lambda: ((*kv_rows(), *CACHE8(), SLOTS()), {"k_scale": 2.0}),
     TypeError, ["v_scale", "torch.int8 cache"]),
    ("rows of two dtypes", lambda: ((torch.randn(3, 2, 8).half(), torch.randn(3, 2, 8),
                                     *CACHE8(), SLOTS()), {"k_scale": 1.0, "v_scale": 1.0}),
     ValueError, ["value", "dtype torch.float16"]),
    ("integer rows", lambda: ((torch.ones(3, 2, 8, dtype=torch.int8),) * 2 + (*CACHE8(), SLOTS()),
                              {"k_scale": 1.0, "v_scale": 1.0}),
     ValueError, ["key", "a float tensor"]),
    ("8-bit key, float value", lambda: ((*kv_rows(), CACHE8()[0], CACHE()[1], SLOTS()),
                                        {"k_scale": 1.0, "v_scale": 1.0}),
     ValueError, ["value_cache", "dtype torch.int8"]),
    ("scale shape", lambda: ((*kv_rows(), *CACHE8(torch.float8_e4m3fn), SLOTS()),
                             {"k_scale": 1.0, "v_scale": torch.ones(4)}),
     ValueError, ["v_scale", "(2,) (per KV head)"]),
    ("zero scale", lambda: ((*kv_rows(), *CACHE8(), SLOTS()), {"k_scale": 0.0, "v_scale": 1.0}),
     ValueError, ["k_scale", "> 0"]),
    ("negative scale tensor", lambda: ((*kv_rows(), *CACHE8(), SLOTS()),
                                       {"k_scale": 1.0, "v_scale": torch.tensor([-1.0])}),
     ValueError, ["v_scale", "finite scales > 0"]),
]


@pytest.mark.parametrize("name,make,error,words", BAD_8BIT_WRITES,
                         ids=[b[0] for b in BAD_8BIT_WRITES])
def test_bad_8bit_write_kv_one_shot_and_planned(name, make, error, words):
    args, scales = make()
    once = raised(pk.write_kv, *args, backend="reference", **scales)
    assert isinstance(once, error)
    for word in words:
        assert word in str(once), f"{word!r} not in {once}"
    for scales_at in ("plan", "write_kv"):
        args, scales = make()
        planned = raised(write_planned, *args, scales_at=scales_at, **scales)
        assert (type(planned), str(planned)) == (type(once), str(once)), scales_at


def test_bad_block_mapping():
    k, v = CACHE()
    with pytest.raises(TypeError, match="block_mapping.*int64"):
        pk.copy_blocks([k], [v], torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_mapping.*shape \[\*, 2\]"):
        pk.copy_blocks([k], [v], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="block_mapping.*block ids"):
        pk.copy_blocks([k], [v], torch.tensor([[0, 9]]))
    with pytest.raises(ValueError, match="value_caches"):
        pk.copy_blocks([k, k], [v], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="dst"):
        pk.swap_blocks(k, torch.zeros(4, 2, 4, 4), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="value_cache: expected dtype torch.int8"):
        pk.copy_blocks([CACHE8()[0]], [v], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="dst: expected a torch.float8_e4m3fn cache"):
        pk.swap_blocks(CACHE8(torch.float8_e4m3fn)[0], CACHE8()[0], torch.tensor([[0, 1]]))
