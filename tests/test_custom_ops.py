"""The torch custom operators (paged_kernels.custom_ops): eager results against the float64 oracle,
`torch.compile(fullgraph=True)` of write_kv + paged_attention against eager and the oracle, the
fake implementations under FakeTensorMode, `torch.library.opcheck`, and CUDA-graph capture (GPU
only)."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import attention_oracle, rel_error
from paged_case import PagedCase, make_case
from torch._subclasses.fake_tensor import FakeTensorMode

import paged_kernels as pk
from paged_kernels import custom_ops

SEQ_LENS, Q_LENS = [19, 40, 1, 9], [19, 6, 1, 1]  # prefill, chunked prefill, two decodes


def _slots(case: PagedCase, block_size: int) -> list[int]:
    """Cache slots of each sequence's query tokens (its last q_len positions), in token order."""
    slots = []
    for s, (n, q) in enumerate(zip(case.seq_lens.tolist(), case.q_lens)):
        for pos in range(n - q, n):
            slots.append(int(case.block_tables[s, pos // block_size]) * block_size
                         + pos % block_size)
    return slots


def _new_kv(case: PagedCase, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This step's K/V rows and slot mapping (with one padding token at slot -1); their slots in
    the caches are overwritten with NaN, so attention is right only if write_kv wrote them."""
    dtype = case.key_cache.dtype
    rows_k = [k[n - q:] for k, n, q in zip(case.keys, case.seq_lens.tolist(), case.q_lens)]
    rows_v = [v[n - q:] for v, n, q in zip(case.values, case.seq_lens.tolist(), case.q_lens)]
    key = torch.cat(rows_k + [torch.full_like(rows_k[0][:1], 7.0)]).to(dtype)
    value = torch.cat(rows_v + [torch.full_like(rows_v[0][:1], 7.0)]).to(dtype)
    slots = torch.tensor(_slots(case, block_size) + [-1], dtype=torch.int64)
    for cache in (case.key_cache, case.value_cache):
        for slot in slots[:-1].tolist():
            cache[slot // block_size, :, slot % block_size] = math.nan
    return key, value, slots


def _step(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
          cu_seqlens_q):
    """One layer's attention step as a model writes it: store this step's K/V, then attend."""
    custom_ops.write_kv(key, value, key_cache, value_cache, slot_mapping, backend="reference")
    out, lse = custom_ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                          cu_seqlens_q=cu_seqlens_q, soft_cap=3.0,
                                          return_lse=True, backend="reference")
    return out * 2.0, lse


def _case(dtype: torch.dtype = torch.float32, seed: int = 0, head_size: int = 32,
          block_size: int = 8) -> PagedCase:
    return make_case(SEQ_LENS, Q_LENS, num_heads=4, num_kv_heads=2, head_size=head_size,
                     block_size=block_size, dtype=dtype, seed=seed)


def _step_args(case: PagedCase) -> tuple:
    key, value, slots = _new_kv(case, 8)
    return (case.query, key, value, case.key_cache, case.value_cache, slots, case.block_tables,
            case.seq_lens, case.cu_seqlens_q)


def test_compiled_step_matches_eager_and_oracle() -> None:
    torch._dynamo.reset()
    eager_case, compiled_case = _case(), _case()
    eager_out, eager_lse = _step(*_step_args(eager_case))
    compiled = torch.compile(_step, fullgraph=True)
    got_out, got_lse = compiled(*_step_args(compiled_case))
    ref_out, ref_lse = attention_oracle(compiled_case.query, compiled_case.keys,
                                        compiled_case.values, compiled_case.q_lens, soft_cap=3.0)
    assert rel_error(got_out, 2.0 * ref_out) <= 1e-5
    assert rel_error(got_lse, ref_lse) <= 1e-5
    torch.testing.assert_close(got_out, eager_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse, eager_lse, rtol=1e-6, atol=1e-6)
    # write_kv ran inside the graph: the caches hold the written rows, not the NaN poison
    torch.testing.assert_close(compiled_case.key_cache, eager_case.key_cache, equal_nan=True)


def test_compiled_graph_has_no_breaks_and_both_ops() -> None:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_step)(*_step_args(_case()))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    code = str(explanation.graphs[0].code)
    assert "paged_kernels.write_kv" in code and "paged_kernels.paged_attention" in code


def test_dynamic_shapes_compile_once_for_every_batch() -> None:
    """With dynamic shapes, batches of other sizes reuse the graph (the fake implementation
    introduces no guard on the number of tokens, sequences or blocks)."""
    torch._dynamo.reset()
    graphs = []

    def count_graphs(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm  # runs the captured graph eagerly: the custom ops are called as they are

    def attend(q, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q):
        return custom_ops.paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                                          cu_seqlens_q=cu_seqlens_q, sliding_window=7)

    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend=count_graphs)
    # first batch: every size distinct (13 blocks of 8 slots, 7 per table, 11 tokens, 3
    # sequences, 6 heads over 2), so that duck sizing adds no equality guard between them
    for seq_lens, q_lens in (([9, 20, 40], [2, 5, 4]), ([30, 4, 5, 17], [7, 1, 1, 3]),
                             ([8, 8, 13, 2, 40], [1, 8, 2, 2, 1])):
        case = make_case(seq_lens, q_lens, num_heads=6, num_kv_heads=2, head_size=16,
                         block_size=8, dtype=torch.float32, seed=len(seq_lens))
        out = compiled(case.query, case.key_cache, case.value_cache, case.block_tables,
                       case.seq_lens, case.cu_seqlens_q)
        ref, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens,
                                  sliding_window=7)
        assert rel_error(out, ref) <= 1e-5
    assert len(graphs) == 1


@pytest.mark.parametrize("backend", pk.available_backends())
def test_ops_eager_match_oracle_per_backend(backend: str) -> None:
    why = pk.get_backend(backend).support.unsupported(
        torch.float32, 32, 8, frozenset({"varlen", "sliding_window"}), "cpu")
    if why is not None:
        pytest.skip(f"{backend} declares no support for {why}")
    case = _case(torch.float32, seed=2)
    key, value, slots = _new_kv(case, 8)
    custom_ops.write_kv(key, value, case.key_cache, case.value_cache, slots, backend=backend)
    out = torch.full_like(case.query, math.nan)
    got = custom_ops.paged_attention(case.query, case.key_cache, case.value_cache,
                                     case.block_tables, case.seq_lens,
                                     cu_seqlens_q=case.cu_seqlens_q, sliding_window=11, out=out,
                                     backend=backend)
    assert got is out
    ref, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens, sliding_window=11)
    assert rel_error(out, ref) <= 1e-5


def test_decode_with_alibi_and_scale() -> None:
    case = make_case([5, 17, 33], None, num_heads=4, num_kv_heads=1, head_size=16, block_size=4,
                     dtype=torch.bfloat16, seed=4)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    got = custom_ops.paged_attention(case.query, case.key_cache, case.value_cache,
                                     case.block_tables, case.seq_lens, scale=0.3,
                                     alibi_slopes=slopes)
    ref, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens, scale=0.3,
                              alibi_slopes=slopes)
    assert got.dtype == torch.bfloat16 and rel_error(got, ref) <= 1e-2


def test_fake_gives_shapes_and_dtypes() -> None:
    with FakeTensorMode():
        query = torch.empty(7, 8, 64, dtype=torch.bfloat16)
        cache = torch.empty(10, 2, 16, 64, dtype=torch.bfloat16)
        tables = torch.empty(3, 4, dtype=torch.int32)
        lens = torch.empty(3, dtype=torch.int32)
        cu = torch.empty(4, dtype=torch.int32)
        out, lse = custom_ops.paged_attention(query, cache, cache, tables, lens, cu_seqlens_q=cu,
                                              return_lse=True)
        custom_ops.write_kv(torch.empty(7, 2, 64, dtype=torch.bfloat16),
                            torch.empty(7, 2, 64, dtype=torch.bfloat16), cache, cache,
                            torch.empty(7, dtype=torch.int64))
    assert (out.shape, out.dtype) == ((7, 8, 64), torch.bfloat16)
    assert (lse.shape, lse.dtype) == ((7, 8), torch.float32)


def test_fake_raises_the_abi_errors_at_trace_time() -> None:
    with FakeTensorMode():
        query = torch.empty(3, 8, 64, dtype=torch.float16)
        cache = torch.empty(10, 3, 16, 64, dtype=torch.float16)  # 3 KV heads do not divide 8
        tables = torch.empty(3, 4, dtype=torch.int32)
        lens = torch.empty(3, dtype=torch.int32)
        with pytest.raises(ValueError, match="key_cache: expected num_kv_heads dividing"):
            custom_ops.paged_attention(query, cache, cache, tables, lens)
        with pytest.raises(ValueError, match="slot_mapping: expected shape \\[3\\]"):
            custom_ops.write_kv(query[:, :2], query[:, :2], cache[:, :2], cache[:, :2],
                                torch.empty(4, dtype=torch.int64))
        with pytest.raises(ValueError, match="lse: expected a float32"):
            torch.ops.paged_kernels.paged_attention(
                query, cache[:, :2], cache[:, :2], tables, lens, None, torch.empty_like(query),
                torch.empty(3, 8, dtype=torch.float16), None, None, None, None, None, None,
                "auto")


def test_errors_pass_through_unchanged() -> None:
    case = _case()
    with pytest.raises(ValueError, match="backend: expected one of"):
        custom_ops.paged_attention(case.query, case.key_cache, case.value_cache,
                                   case.block_tables, case.seq_lens,
                                   cu_seqlens_q=case.cu_seqlens_q, backend="nope")
    with pytest.raises(ValueError, match="slot_mapping"):
        custom_ops.write_kv(case.query[:, :2], case.query[:, :2], case.key_cache,
                            case.value_cache, torch.zeros(3, dtype=torch.int64))


def _opcheck_attention_args(features: bool) -> tuple:
    case = make_case([9, 3, 20], [2, 3, 1] if features else None, num_heads=4, num_kv_heads=2,
                     head_size=16, block_size=4, dtype=torch.float32, seed=5, nhd=features)
    lse = torch.empty(case.query.shape[:2]) if features else None
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if features else None
    return (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
            case.cu_seqlens_q, torch.empty_like(case.query), lse, 0.2 if features else None,
            5 if features else None, 4.0 if features else None, slopes, None, None,
            "reference")


@pytest.mark.parametrize("features", [False, True], ids=["decode", "varlen-all-features"])
def test_opcheck_paged_attention(features: bool) -> None:
    torch.library.opcheck(torch.ops.paged_kernels.paged_attention.default,
                          _opcheck_attention_args(features))


def test_opcheck_write_kv() -> None:
    cache = torch.randn(6, 4, 2, 8).permute(0, 2, 1, 3)  # strided (NHD storage)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 17, 0, 9])
    torch.library.opcheck(torch.ops.paged_kernels.write_kv.default,
                          (key, value, cache, cache.clone(), slots, None, None, "reference"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("backend", pk.available_backends())
def test_cuda_graph_capture_and_replay(backend: str) -> None:
    """Captures write_kv + paged_attention once, replays with new inputs copied into the static
    buffers, and checks each replay against the oracle."""
    if backend == "reference" or "cuda" not in pk.get_backend(backend).support.device_types:
        pytest.skip(f"{backend}: not a CUDA-graph-safe CUDA backend (the reference synchronises)")
    # head size 64, block size 16: inside every GPU backend's declared support (cuda starts at 64)
    cases = [_case(torch.bfloat16, seed=s, head_size=64, block_size=16) for s in (6, 7)]
    args = [[t.cuda() if torch.is_tensor(t) else t for t in _step_args(c)] for c in cases]
    static = [t.clone() if torch.is_tensor(t) else t for t in args[0]]

    def step():
        q, k, v, kc, vc, slots, bt, sl, cu = static
        custom_ops.write_kv(k, v, kc, vc, slots, backend=backend)
        return custom_ops.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=cu, backend=backend)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture (compilation, workspace allocation)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for case, new in zip(cases, args):
        for dst, src in zip(static, new):
            if torch.is_tensor(dst):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens)
        assert rel_error(out, ref) <= 1e-2


def _8bit_case(dtype: torch.dtype) -> PagedCase:
    return make_case([9, 3, 20], None, num_heads=4, num_kv_heads=2, head_size=16, block_size=4,
                     dtype=torch.float32, seed=8, kv_cache_dtype=dtype, k_scale=[0.02, 0.02],
                     v_scale=[0.05, 0.01])


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_opcheck_8bit_cache(per_head: bool) -> None:
    """The operators with an 8-bit cache and its scales (tensors in the schema): schema, fake
    implementation and tracing agree with eager. int8: opcheck's schema check compares tensors
    with operations torch's CPU lacks for fp8 (the fp8 path: the next test)."""
    case = _8bit_case(torch.int8)
    k_scale = torch.tensor(case.k_scale if per_head else case.k_scale[:1])
    v_scale = torch.tensor(case.v_scale if per_head else case.v_scale[:1])
    torch.library.opcheck(torch.ops.paged_kernels.paged_attention.default, (
        case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, None,
        torch.empty_like(case.query), None, None, None, None, None, k_scale, v_scale,
        "reference"))
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    torch.library.opcheck(torch.ops.paged_kernels.write_kv.default, (
        key, value, case.key_cache.clone(), case.value_cache.clone(), torch.tensor([0, -1, 5]),
        k_scale, v_scale, "reference"))


def test_8bit_cache_through_the_operators_equals_the_eager_api() -> None:
    """A float scale (made a tensor by the wrapper) and a per-head tensor give the eager API's
    results bit for bit, and the fake implementation refuses a missing scale at trace time."""
    case = _8bit_case(torch.float8_e5m2)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    scales = {"k_scale": case.k_scale[0], "v_scale": torch.tensor(case.v_scale)}
    got = custom_ops.paged_attention(*args, backend="reference", **scales)
    want = pk.paged_attention(*args, backend="reference", **scales)
    assert torch.equal(got, want)
    ref, _ = attention_oracle(case.query, case.keys, case.values, case.q_lens)
    assert rel_error(got, ref) <= 1e-5
    caches = [(case.key_cache.clone(), case.value_cache.clone()) for _ in range(2)]
    key, value, slots = torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.tensor([0, -1, 5])
    custom_ops.write_kv(key, value, *caches[0], slots, backend="reference", **scales)
    pk.write_kv(key, value, *caches[1], slots, backend="reference", **scales)
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args]
        with pytest.raises(TypeError, match="k_scale: expected a scale"):
            custom_ops.paged_attention(*fake, v_scale=1.0)
