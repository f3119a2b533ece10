"""The cpu backend against the reference on the CPU, at the engine's decode shape (SmolLM2-135M:
9 query heads, 3 KV heads, head size 64, bf16, block size 16; 16 sequences x 300 tokens, and one
sequence x 300) and a 256-token prefill, at 1 and 2 threads, as a pytest-benchmark suite (one
group per shape and thread count, the two backends side by side); and a decode step of 30 layers
in the engine's cache layout, without and with the kernel's K/V read-ahead. No speed assertion
(docs/cpu.md); the engine-layout step checks its output against `paged_attention`.

    python -m pytest bench/test_bench_cpu.py --benchmark-only --benchmark-columns=min,median
    python bench/test_bench_cpu.py            # the fastest and median ms of 30 calls, as a table
    python -m bench.test_bench_cpu --against OLD.cpp   # same-process A/B of two kernel sources

`--against` compiles each given `paged_attention.cpp` beside the current one and times them in
turn in one process, 1 thread, the thread's CPU time (other processes on the cores change it
less than wall time): a decode step of 16 x 320 over 30 layers' caches laid out as the engine
lays them out (KVCache pool, prompt blocks contiguous per sequence, decode blocks interleaved),
without and with the kernel's K/V read-ahead, and a 5 x 256 causal prefill.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch

from bench.shapes import make_problem
from cpu_impl.backend import QUERY_TILE
from paged_kernels import available_backends, paged_attention

SHAPES = {  # name -> (batch, context, q_len)
    "decode-16x300": (16, 300, 1),
    "decode-16x300-cold": (16, 300, 1),  # 30 layers' caches in turn, as in an engine step
    "decode-1x300-cold": (1, 300, 1),  # single stream: 30 layers' caches (~1.8 MB) in turn
    "prefill-256": (1, 256, 256),
}
#: Distinct problems cycled through for a "-cold" shape: 30 layers of K/V (~55 MB in bf16) do not
#: fit the last-level cache, so every call reads its K/V from memory, as in the engine.
COLD_LAYERS = 30
HEADS = {"num_heads": 9, "num_kv_heads": 3, "head_size": 64, "block_size": 16}


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """`n` torch threads inside the block; the previous count is restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def attention_call(shape: str, backend: str, dtype: torch.dtype) -> Callable[[], None]:
    """A function that makes one `paged_attention` call on `shape` per invocation; a "-cold"
    shape cycles over COLD_LAYERS distinct problems, one per call."""
    batch, context, q_len = SHAPES[shape]
    layers = COLD_LAYERS if shape.endswith("-cold") else 1
    problems = [make_problem(batch, context, q_len, dtype=dtype, device="cpu", **HEADS)
                for _ in range(layers)]
    out = torch.empty_like(problems[0].query)
    calls = itertools.count()

    def call() -> None:
        p = problems[next(calls) % layers]
        paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                        cu_seqlens_q=p.cu_seqlens_q, out=out, backend=backend)
    return call


def ms_per_call(shape: str, backend: str, threads: int, dtype: torch.dtype,
                repeat: int = 30) -> tuple[float, float]:
    """(fastest, median) milliseconds of one `paged_attention` call with `threads` torch threads."""
    call = attention_call(shape, backend, dtype)
    times = []
    with torch_threads(threads):
        for i in range(repeat + 3):
            start = time.perf_counter()
            call()
            if i >= 3:  # warm-up calls excluded
                times.append(time.perf_counter() - start)
    times.sort()
    return 1e3 * times[0], 1e3 * times[len(times) // 2]


@pytest.mark.skipif("cpu" not in available_backends(), reason="cpu backend unavailable")
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention(benchmark, shape: str, threads: int, backend: str) -> None:
    """One `paged_attention` call of `backend` on `shape` in bf16, 30 rounds after 3 warm-ups."""
    call = attention_call(shape, backend, torch.bfloat16)
    benchmark.group = f"{shape} bf16 threads={threads}"
    with torch_threads(threads):
        benchmark.pedantic(call, rounds=30, warmup_rounds=3, iterations=1)


class EngineDecode:
    """A decode step's attention inputs in the engine's layout: `layers` layers' caches in one
    KVCache pool (transparent huge pages where the kernel gives them, zeroed, then random), `batch`
    sequences of about `context` tokens whose first 256 tokens' blocks are contiguous per sequence
    and whose later blocks interleave (one per sequence in turn, as decode allocates them)."""

    def __init__(self, batch: int = 16, context: int = 320, layers: int = COLD_LAYERS,
                 seed: int = 0) -> None:
        from engine.kv_cache import KVCache
        h = HEADS
        bs = h["block_size"]
        torch.manual_seed(seed)
        per_seq = -(-context // bs)
        prompt = min(per_seq, 256 // bs)
        self.kv = KVCache(layers, h["num_kv_heads"], h["head_size"], batch * per_seq, bs,
                          torch.bfloat16)
        for k, v in self.kv.device_caches:
            k.normal_()
            v.normal_()
        order = [(s, b) for s in range(batch) for b in range(prompt)]
        order += [(s, b) for b in range(prompt, per_seq) for s in range(batch)]
        self.tables = torch.zeros(batch, per_seq, dtype=torch.int32)
        for block, (s, b) in enumerate(order):
            self.tables[s, b] = block
        self.lens = context - torch.arange(batch, dtype=torch.int32) % 3
        self.queries = [torch.randn(batch, h["num_heads"], h["head_size"]).to(torch.bfloat16)
                        for _ in range(layers)]
        self.out = torch.empty_like(self.queries[0])

    def step(self, ext: ModuleType, read_ahead: bool) -> None:
        """Every layer's decode attention through the compiled module `ext` (1 thread), with or
        without the kernel's K/V read-ahead."""
        scale = HEADS["head_size"] ** -0.5
        for q, (k, v) in zip(self.queries, self.kv.device_caches):
            ext.paged_attention(q, k, v, self.tables, self.lens, None, self.out, None, None, scale,
                                0, 0.0, QUERY_TILE, 1, read_ahead)


def compiled(sources: Sequence[Path]) -> dict[str, ModuleType]:
    """The current kernel ("current") and one module per other source file (by file stem)."""
    from cpu_impl import build
    from paged_kernels import cpp_build
    flags = build.compile_flags()
    mods = {"current": build.load()}
    for src in sources:
        mods[src.stem] = cpp_build.load(src, "pk_cpu_ab_" + src.stem, flags, src.stem)
    return mods


def ab_decode_ms(mods: dict[str, ModuleType], case: EngineDecode,
                 rounds: int = 12) -> dict[tuple[str, bool], float]:
    """Median thread-CPU ms of `case.step` per (module name, read-ahead), the modules in turn."""
    times: dict[tuple[str, bool], list[float]] = {(n, w): [] for n in mods for w in (False, True)}
    with torch_threads(1):
        for _ in range(rounds):
            for (name, read_ahead), taken in times.items():
                start = time.thread_time()
                case.step(mods[name], read_ahead)
                taken.append(time.thread_time() - start)
    return {key: 1e3 * statistics.median(t) for key, t in times.items()}


def ab_prefill_ms(mods: dict[str, ModuleType], seqs: int = 5, length: int = 256,
                  rounds: int = 5) -> dict[str, float]:
    """Median thread-CPU ms of one causal varlen prefill call (`seqs` x `length`), 1 thread."""
    p = make_problem(seqs, length, length, dtype=torch.bfloat16, device="cpu", **HEADS)
    out = torch.empty_like(p.query)
    scale = HEADS["head_size"] ** -0.5
    times: dict[str, list[float]] = {n: [] for n in mods}
    with torch_threads(1):
        for _ in range(rounds):
            for name, ext in mods.items():
                start = time.thread_time()
                ext.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                    p.seq_lens, p.cu_seqlens_q, out, None, None, scale, 0, 0.0,
                                    QUERY_TILE, 1, False)
                times[name].append(time.thread_time() - start)
    return {n: 1e3 * statistics.median(t) for n, t in times.items()}


@pytest.mark.skipif("cpu" not in available_backends(), reason="cpu backend unavailable")
@pytest.mark.parametrize("read_ahead", [False, True], ids=["plain", "read_ahead"])
def test_engine_decode_step(benchmark, read_ahead: bool) -> None:
    """A decode step's attention (16 x 320, 30 layers, 1 thread) in the engine's cache layout, as
    `--against` times it. The harness calls the extension as the backend does: the last layer's
    output equals `paged_attention(..., backend="cpu")` on the same inputs, and the A/B timing
    returns a time for every (module, read-ahead)."""
    case = EngineDecode()
    mods = compiled([])
    benchmark.group = "engine decode step 16x320, 30 layers, 1 thread"
    with torch_threads(1):
        benchmark.pedantic(case.step, args=(mods["current"], read_ahead), rounds=12,
                           warmup_rounds=1, iterations=1)
    k, v = case.kv.device_caches[-1]
    want = paged_attention(case.queries[-1], k, v, case.tables, case.lens, backend="cpu")
    assert torch.equal(case.out, want)
    ms = ab_decode_ms(mods, case, rounds=1)
    assert set(ms) == {("current", False), ("current", True)} and min(ms.values()) > 0


def print_ab(sources: Sequence[Path]) -> None:
    mods = compiled(sources)
    case = EngineDecode()
    decode = ab_decode_ms(mods, case)
    prefill = ab_prefill_ms(mods)
    print("| kernel | decode 16x320, 30 layers, ms a step | with read-ahead | prefill 5x256 ms |")
    print("| --- | --- | --- | --- |")
    for name in mods:
        print(f"| {name} | {decode[name, False]:.2f} | {decode[name, True]:.2f} | "
              f"{prefill[name]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", nargs="+", type=Path, metavar="SOURCE",
                        help="paged_attention.cpp versions to A/B against the current one")
    args = parser.parse_args()
    if args.against:
        print_ab(args.against)
        return
    print("| shape (bf16) | threads | cpu ms: fastest / median | reference ms: fastest / median "
          "| speed-up (fastest) |")
    print("| --- | --- | --- | --- | --- |")
    for name in SHAPES:
        for n in (1, 2):
            c = ms_per_call(name, "cpu", n, torch.bfloat16)
            r = ms_per_call(name, "reference", n, torch.bfloat16)
            print(f"| {name} | {n} | {c[0]:.3f} / {c[1]:.3f} | {r[0]:.2f} / {r[1]:.2f} | "
                  f"{r[0] / c[0]:.1f}x |")


if __name__ == "__main__":
    main()
