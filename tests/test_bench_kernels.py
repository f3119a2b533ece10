"""The benchmark code (bench/kernels.py, bench/ceilings.py, bench/kv_quant_speed.py,
bench/timing.py) at tiny sizes on the CPU, so that it is never found broken on the day a GPU is
lent: what it counts (bytes, flops) against direct counts, its check against SDPA, errors
recorded without ending a sweep, and its outputs."""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repo root

from bench import build_ab, ceilings, kernels  # noqa: E402
from bench.timing import seconds_in_turns  # noqa: E402
from paged_kernels.cpp_build import cpu_flags  # noqa: E402

TINY = dict(num_heads=4, num_kv_heads=2, head_size=16, block_size=4)


def test_ceilings_are_positive_rates() -> None:
    copy = ceilings.copy_bandwidth("cpu", nbytes=1 << 20, repeat=2)
    mm = ceilings.matmul_rate("cpu", torch.float32, n=64, repeat=2)
    assert copy["copy_bytes"] == 2 << 20 and copy["copy_GBps"] > 0
    assert mm["matmul_n"] == 64 and mm["matmul_TFLOPs"] > 0
    int8 = ceilings.int8_matmul_rate(n=64, repeat=2)
    assert int8["int8_matmul_n"] == 64 and int8["int8_matmul_TOPs"] > 0
    read = ceilings.read_bandwidth(nbytes=1 << 20, threads=2, repeat=2)
    assert read["read_bytes"] == 1 << 20 and read["read_GBps"] > 0 and read["read_threads"] == 2


def block_mix_oracle(iterations: int) -> float:
    """The sum that one thread of bench/csrc/int8_block_mix.cpp accumulates, in float64 from
    its stated inputs: per iteration 4 rows (row = (4 it + r) mod 64), whose 32 activation bytes
    are 8 groups of 4 equal bytes (row * 8 + g) mod 7; weight byte 64 g + 4 j + t is
    (37 i) mod 256 at its index i; acc_j += s_j * d_j * xd(row) + m_j * xs(row)."""
    w = (np.arange(8 * 64) * 37 % 256).astype(np.float64).reshape(8, 16, 4).sum(-1)  # [g, j]
    dm = np.array([0.5 / (1 + i) if i < 16 else -1000.0 / (i - 15) for i in range(32)],
                  np.float32)
    scales = np.array([1.0 / (1 + i) for i in range(128)], np.float32).astype(np.float64)
    total = 0.0
    for row in (np.arange(iterations * 4) % 64):
        x = (row * 8 + np.arange(8)) % 7  # [g]
        s = (w * x[:, None]).sum(0)  # [j]
        total += float((s * dm[:16] * scales[2 * row] + dm[16:] * scales[2 * row + 1]).sum())
    return total


def test_int8_block_mix_does_the_stated_arithmetic() -> None:
    """The block-mix ceiling's loop computes the products and scalings it claims to time (so the
    compiler kept every instruction), on every thread; on a CPU without AVX-512 VNNI it says so
    with -1 and `int8_block_rate` returns {}."""
    lib = ceilings._block_mix_library()
    sink = ctypes.c_float()
    want = block_mix_oracle(40)
    for threads in (1, 2):
        seconds = lib.int8_block_mix(40, threads, ctypes.byref(sink))
        if seconds < 0:
            assert "avx512_vnni" not in cpu_flags() and ceilings.int8_block_rate() == {}
            return
        assert seconds > 0 and sink.value == pytest.approx(threads * want, rel=1e-5)
    rate = ceilings.int8_block_rate(threads=2, iterations=1000, repeat=2)
    assert rate["int8_block_threads"] == 2 and rate["int8_block_TOPs"] > 0


def test_read_ceiling_reads_every_word_once() -> None:
    """The native read loop sums each word of its buffer exactly once, whatever the thread
    count and a length that is no multiple of the chains or the threads."""
    lib = ceilings._read_library()
    words = torch.arange(1, 1003, dtype=torch.int64)
    for threads in (1, 2, 3):
        assert lib.read_words(words.data_ptr(), words.numel(), threads) == 1002 * 1003 // 2


def test_seconds_in_turns_calls_each_function_once_per_round_in_turns() -> None:
    calls: list[int] = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    times = seconds_in_turns(fns, rounds=4)
    assert calls == [0, 1, 2] * 4
    assert [len(t) for t in times] == [4, 4, 4]
    assert all(x >= 0 for t in times for x in t)


def test_cold_and_hot_in_turns_rotates_the_layers_only_when_cold() -> None:
    calls: list[tuple[int, int]] = []
    per_call = build_ab.cold_and_hot_in_turns(lambda i, layer: calls.append((i, layer)), 2, 3)
    n = build_ab.LAYERS
    cold = [(i, layer) for i in range(2) for layer in range(n)] * 3
    hot = [(i, 0) for i in range(2) for _ in range(n)] * 3
    assert calls == [(0, 0), (1, 0)] + cold + [(0, 0), (1, 0)] + hot
    assert set(per_call) == {"cold", "hot"} and all(len(v) == 2 for v in per_call.values())


def test_steps_in_turns_switches_then_times_ten_steps() -> None:
    events: list[str] = []
    attention: list[float] = []

    class Engine:
        def step(self) -> None:
            events.append("step")
            attention.append(0.001)

    times, in_attention = build_ab.steps_in_turns(
        Engine(), [lambda: events.append("a"), lambda: events.append("b")], 2, attention)
    assert events == (["a"] + ["step"] * 11 + ["b"] + ["step"] * 11) * 2
    assert [len(t) for t in times] == [2, 2]
    assert all(x == pytest.approx(1.0) for t in in_attention for x in t)  # 10 x 1 ms / 10


@pytest.mark.parametrize("kernel,qtype,block", [("tiled", "Q4_1", 320), ("tiled", "Q8_0", 544),
                                                ("int8", "Q8_0", 576)])
def test_packed_tiles_size_alignment_and_scales(kernel: str, qtype: str, block: int) -> None:
    w = build_ab.packed_tiles(40, 64, qtype, kernel)  # 3 tiles of 16 features x 2 blocks
    assert w.numel() == 3 * 2 * block and w.data_ptr() % 64 == 0
    scales = w.view(-1, block)[:, build_ab.SCALES_AT[qtype]:].contiguous().view(torch.float16)
    # [0, 0.01) rounded to float16 (whose nearest values to 0.01 lie 2**-17 apart)
    assert bool(((scales >= 0) & (scales.float() <= 0.01 + 2 ** -17)).all())


@pytest.mark.parametrize("kind,batch,context,q_len", [
    ("decode", 3, 10, 1), ("prefill", 2, 9, 9), ("prefill", 2, 12, 5), ("mixed", 9, 12, 4),
])
def test_attention_counts_and_check(kind: str, batch: int, context: int, q_len: int) -> None:
    shape = kernels.Shape(kind, batch, context, q_len, **TINY)
    result = kernels.measure("reference", shape, torch.float32, "cpu", repeat=1)
    q_lens = [1] * batch if kind == "decode" else [q_len] * batch
    if kind == "mixed":  # one sequence in eight prefills (at least one), the rest decode
        q_lens = [q_len] * max(1, batch // 8) + [1] * (batch - max(1, batch // 8))
    tokens = sum(q_lens)
    kv_bytes = 2 * batch * context * TINY["num_kv_heads"] * TINY["head_size"] * 4
    assert result["bytes_moved"] == kv_bytes + 2 * tokens * TINY["num_heads"] * 16 * 4
    keys_seen = sum(context - q + i + 1 for q in q_lens for i in range(q))
    assert result["flops"] == 4 * keys_seen * TINY["num_heads"] * TINY["head_size"]
    assert result["GB/s"] == pytest.approx(result["bytes_moved"] / result["seconds"] / 1e9)
    if kind != "mixed":  # SDPA takes one q_len per batch
        assert result["rel_err_vs_sdpa"] < 1e-5


def test_write_kv_writes_the_rows_it_counts() -> None:
    shape = kernels.Shape("write_kv", 3, 8, 2, **TINY)
    prepared = kernels.prepare("reference", shape, torch.float32, "cpu")
    row_bytes = TINY["num_kv_heads"] * TINY["head_size"] * 4
    assert prepared.bytes_moved == 2 * 2 * 6 * row_bytes + 8 * 6
    prepared.run()


def test_sweep_records_failures_and_writes_outputs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "shapes", lambda device, quick: [
        kernels.Shape("decode", 2, 8, **TINY), kernels.Shape("mixed", 8, 8, 3, **TINY)])
    monkeypatch.setattr(kernels, "measure_ceilings", lambda device, dtype: {
        "copy_GBps": 1.0, "matmul_TFLOPs": 1.0, "matmul_dtype": "float32"})
    report = kernels.run(["reference", "no-such-backend"], "cpu", torch.float32, repeat=1)
    rows = {(r["backend"], r["kind"]): r for r in report["results"]}
    assert set(rows) == {("reference", "decode"), ("reference", "mixed"),
                         ("no-such-backend", "decode"), ("no-such-backend", "mixed"),
                         (kernels.SDPA, "decode")}
    assert rows[("no-such-backend", "decode")]["error"].startswith("ValueError: backend")
    assert rows[("reference", "decode")]["frac_copy_bw"] == rows[("reference", "decode")]["GB/s"]
    assert "failed: ValueError" in kernels.format_row(rows[("no-such-backend", "mixed")])
    paths = kernels.write_outputs(report, tmp_path)
    assert json.loads((tmp_path / "kernels.json").read_text())["results"] == report["results"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_kv_quant_speed_times_every_cache_in_both_kinds_of_memory() -> None:
    """`bench.kv_quant_speed` at a tiny shape: a row per kind of memory and cache dtype, each
    8-bit row compared with bfloat16 in the same kind, half its bytes."""
    from bench import kv_quant_speed

    rows = kv_quant_speed.measure(64, seqs=2, context=48, rounds=1, repeat=1)
    assert [(r["pages"], r["cache"]) for r in rows] == [
        (pages, cache) for pages in ("huge", "4k")
        for cache in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int8")]
    for r in rows:
        base = next(b for b in rows if b["pages"] == r["pages"] and b["cache"] == "bfloat16")
        assert r["speedup_vs_bf16"] == pytest.approx(base["seconds"] / r["seconds"])
        assert r["cache_bytes"] * (1 if r["cache"] == "bfloat16" else 2) == base["cache_bytes"]
    assert "| 64 | huge | int8 |" in kv_quant_speed.table(rows, 10.0)
