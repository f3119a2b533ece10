"""The cpu backend against the reference on the CPU, at the engine's decode shape (SmolLM2-135M:
9 query heads, 3 KV heads, head size 64, bf16, block size 16; 16 sequences x 300 tokens, and one
sequence x 300) and a 256-token prefill, at 1 and 2 threads. Prints the fastest and the median ms per call of 30 (the
fastest is the stable figure on a shared machine); no speed assertion (docs/cpu.md).

    python -m pytest bench/test_bench_cpu.py -q -s
    python bench/test_bench_cpu.py            # the same table without pytest
    python -m bench.test_bench_cpu --against OLD.cpp   # same-process A/B of two kernel sources

`--against` compiles each given `paged_attention.cpp` beside the current one and times them in
turn in one process, 1 thread, the thread's CPU time (other processes on the cores change it
less than wall time): a decode step of 16 x 320 over 30 layers' caches laid out as the engine
lays them out (KVCache pool, prompt blocks contiguous per sequence, decode blocks interleaved),
without and with `layer_ops.warm_blocks` before each call, and a 5 x 256 causal prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from bench.shapes import make_problem
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


def ms_per_call(shape: str, backend: str, threads: int, dtype: torch.dtype,
                repeat: int = 30) -> tuple[float, float]:
    """(fastest, median) milliseconds of one `paged_attention` call with `threads` torch threads."""
    batch, context, q_len = SHAPES[shape]
    layers = COLD_LAYERS if shape.endswith("-cold") else 1
    problems = [make_problem(batch, context, q_len, dtype=dtype, device="cpu", **HEADS)
                for _ in range(layers)]
    out = torch.empty_like(problems[0].query)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    try:
        for i in range(repeat + 3):
            p = problems[i % layers]
            start = time.perf_counter()
            paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                            cu_seqlens_q=p.cu_seqlens_q, out=out, backend=backend)
            if i >= 3:  # warm-up calls excluded
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    times.sort()
    return 1e3 * times[0], 1e3 * times[len(times) // 2]


@pytest.mark.skipif("cpu" not in available_backends(), reason="cpu backend unavailable")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpu_vs_reference(shape: str, threads: int) -> None:
    cpu = ms_per_call(shape, "cpu", threads, torch.bfloat16)
    ref = ms_per_call(shape, "reference", threads, torch.bfloat16)
    print(f"\n{shape} bf16 threads={threads}: cpu {cpu[0]:.3f} ms (median {cpu[1]:.3f}), "
          f"reference {ref[0]:.3f} ms (median {ref[1]:.3f}), speed-up {ref[0] / cpu[0]:.1f}x")


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
        self.kv_blocks = self.tables.flatten().to(torch.int64)
        self.queries = [torch.randn(batch, h["num_heads"], h["head_size"]).to(torch.bfloat16)
                        for _ in range(layers)]
        self.out = torch.empty_like(self.queries[0])

    def step(self, ext: ModuleType, warm: bool) -> None:
        """Every layer's decode attention through the compiled module `ext` (1 thread)."""
        from engine.model import layer_ops
        scale = HEADS["head_size"] ** -0.5
        for q, (k, v) in zip(self.queries, self.kv.device_caches):
            if warm:
                layer_ops.warm_blocks(k, v, self.kv_blocks)
            ext.paged_attention(q, k, v, self.tables, self.lens, None, self.out, None, None, scale,
                                0, 0.0, 16, 1)


def compiled(sources: Sequence[Path]) -> dict[str, ModuleType]:
    """The current kernel ("current") and one module per other source file (by file stem)."""
    from cpu_impl import build
    from paged_kernels import cpp_build
    flags = build.compile_flags(build.cpu_flags())
    mods = {"current": build.load()}
    for src in sources:
        mods[src.stem] = cpp_build.load(src, "pk_cpu_ab_" + src.stem, flags, src.stem)
    return mods


def ab_decode_ms(mods: dict[str, ModuleType], case: EngineDecode,
                 rounds: int = 12) -> dict[tuple[str, bool], float]:
    """Median thread-CPU ms of `case.step` per (module name, warm), the modules in turn."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[tuple[str, bool], list[float]] = {(n, w): [] for n in mods for w in (False, True)}
    try:
        for _ in range(rounds):
            for (name, warm), taken in times.items():
                start = time.thread_time()
                case.step(mods[name], warm)
                taken.append(time.thread_time() - start)
    finally:
        torch.set_num_threads(previous)
    return {key: 1e3 * statistics.median(t) for key, t in times.items()}


def ab_prefill_ms(mods: dict[str, ModuleType], seqs: int = 5, length: int = 256,
                  rounds: int = 5) -> dict[str, float]:
    """Median thread-CPU ms of one causal varlen prefill call (`seqs` x `length`), 1 thread."""
    p = make_problem(seqs, length, length, dtype=torch.bfloat16, device="cpu", **HEADS)
    out = torch.empty_like(p.query)
    scale = HEADS["head_size"] ** -0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {n: [] for n in mods}
    try:
        for _ in range(rounds):
            for name, ext in mods.items():
                start = time.thread_time()
                ext.paged_attention(p.query, p.key_cache, p.value_cache, p.block_tables,
                                    p.seq_lens, p.cu_seqlens_q, out, None, None, scale, 0, 0.0,
                                    16, 1)
                times[name].append(time.thread_time() - start)
    finally:
        torch.set_num_threads(previous)
    return {n: 1e3 * statistics.median(t) for n, t in times.items()}


@pytest.mark.skipif("cpu" not in available_backends(), reason="cpu backend unavailable")
def test_engine_decode_case_matches_the_api() -> None:
    """The A/B harness calls the extension as the backend does: its output equals
    `paged_attention(..., backend="cpu")` on the same inputs, and every timing is there."""
    case = EngineDecode(batch=3, context=40, layers=2)
    mods = compiled([])
    case.step(mods["current"], warm=True)  # the last layer's output stays in case.out
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
    print("| kernel | decode 16x320, 30 layers, ms a step | with warm_blocks | prefill 5x256 ms |")
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
