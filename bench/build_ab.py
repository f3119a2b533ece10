"""Helpers of the in-process A/B runs of native builds (the scripts under bench/results that
compare compiled extensions or settings in one process, so that every variant sees the same
machine load): the extension at a path, the engine's attention shape with random caches, its
cold and hot calls in turns, decode steps in turns with the attention's share, and random packed
GGUF tiles for the engine's matmul kernels."""

from __future__ import annotations

import importlib.util
import statistics
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

import torch

from bench.timing import seconds_in_turns

#: The default model's attention (SmolLM2-135M): query heads, KV heads, head size; the engine's
#: block size and layer count.
HEADS, KV_HEADS, HEAD_SIZE, BLOCK, LAYERS = 9, 3, 64, 16, 30


def load_extension(path: str) -> ModuleType:
    """The compiled extension module at `path` (a .so under ~/.cache/torch_extensions)."""
    name = path.rsplit("/", 1)[1].split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class EngineAttentionCase:
    """`seqs` sequences of `context` tokens each at the engine's attention shape: `layers` pairs
    of random bf16 K/V caches, one random non-contiguous block table for all of them."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def engine_attention_case(seqs: int, context: int, layers: int, *,
                          seed: int = 0) -> EngineAttentionCase:
    torch.manual_seed(seed)
    per_seq = (context + BLOCK - 1) // BLOCK
    num_blocks = seqs * per_seq + 8
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_SIZE)
    caches = [(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16))
              for _ in range(layers)]
    tables = torch.randperm(num_blocks)[: seqs * per_seq].view(seqs, per_seq).int().contiguous()
    return EngineAttentionCase(caches, tables, torch.full((seqs,), context, dtype=torch.int32))


def cold_and_hot_in_turns(call: Callable[[int, int], None], variants: int, rounds: int
                          ) -> dict[str, list[float]]:
    """{"cold": ..., "hot": ...}: each variant's median seconds per call of `call(variant,
    layer)`, LAYERS calls per variant and round, the variants in turns. "cold" rotates the
    layers (as a decode step reads them), "hot" calls layer 0 each time; one warm-up call per
    variant before each mode."""
    def layers(i: int, mode: str) -> None:
        for layer in range(LAYERS):
            call(i, layer if mode == "cold" else 0)

    out = {}
    for mode in ("cold", "hot"):
        for i in range(variants):
            call(i, 0)
        times = seconds_in_turns([lambda i=i, m=mode: layers(i, m) for i in range(variants)],
                                 rounds)
        out[mode] = [statistics.median(t) / LAYERS for t in times]
    return out


def print_cold_and_hot(label: str, per_call: dict[str, list[float]],
                       outs: Sequence[torch.Tensor]) -> None:
    """One line per mode of `cold_and_hot_in_turns`' result: `label`, the mode, each variant's
    microseconds per call, and whether the variants' outputs `outs` are equal bit for bit."""
    equal = all(torch.equal(outs[0], o) for o in outs[1:])
    for mode, seconds in per_call.items():
        cells = " ".join(f"{t * 1e6:8.1f}" for t in seconds)
        print(f"{label} {mode}: {cells} us/call ({'equal' if equal else 'DIFFERENT'} outputs)",
              flush=True)


def timed_attention(backend_class: Any, sink: list[float]) -> None:
    """Wraps `backend_class.paged_attention` so that each call appends its seconds to `sink`."""
    original = backend_class.paged_attention

    def call(self: Any, problem: Any) -> None:
        t = time.perf_counter()
        original(self, problem)
        sink.append(time.perf_counter() - t)

    backend_class.paged_attention = call


def steps_in_turns(engine: Any, switches: Sequence[Callable[[], None]], rounds: int,
                   attention: list[float]) -> tuple[list[list[float]], list[list[float]]]:
    """Decode steps of `engine` under each switch in turn: per round and switch, the switch,
    one untimed step, then 10 timed ones. Returns (ms per step, ms in attention per step) per
    switch and round; `attention` is the sink `timed_attention` fills."""
    times: list[list[float]] = [[] for _ in switches]
    in_attention: list[list[float]] = [[] for _ in switches]
    for _ in range(rounds):
        for i, switch in enumerate(switches):
            switch()
            engine.step()
            attention.clear()
            t = time.perf_counter()
            for _ in range(10):
                engine.step()
            times[i].append((time.perf_counter() - t) / 10 * 1e3)
            in_attention[i].append(sum(attention) / 10 * 1e3)
    return times, in_attention


#: The engine's GGUF tile-blocks (16 features x 32 inputs): bytes per kernel and format, and where
#: the f16 scales start (engine/csrc/tiled_matmul.cpp, int8_matmul.cpp).
TILE_BLOCK = {"tiled": {"Q4_1": 320, "Q8_0": 544}, "int8": {"Q4_1": 320, "Q8_0": 576}}
SCALES_AT = {"Q4_1": 256, "Q8_0": 512}


def packed_tiles(n: int, k: int, qtype: str, kernel: str = "tiled") -> torch.Tensor:
    """Random packed tiles of an `n` x `k` matrix for `kernel` ("tiled" or "int8"), 64-byte
    aligned, their f16 scales drawn from [0, 0.01) (then rounded to float16)."""
    tb = TILE_BLOCK[kernel][qtype]
    nbytes = (n + 15) // 16 * (k // 32) * tb
    raw = torch.randint(0, 255, (nbytes + 64,), dtype=torch.uint8)
    w = raw[-raw.data_ptr() % 64:][:nbytes]
    blocks = w.view(-1, tb)
    scales = torch.rand(blocks.shape[0], (tb - SCALES_AT[qtype]) // 2) * 0.01
    blocks[:, SCALES_AT[qtype]:] = scales.to(torch.float16).view(torch.uint8)
    return w


def cpu_decode_builds_in_turns(exts: Sequence[ModuleType], p: Any, caches: tuple, threads: int,
                               rounds: int, prefetch_lines: Optional[int] = None
                               ) -> tuple[list[list[float]], bool]:
    """Seconds per decode call of each cpu-backend build in `exts` over `rounds` turns (after one
    call each), with the backend's query tile and read-ahead and `prefetch_lines` (None: the
    backend's default paced prefetch), and whether their outputs are equal. `p`: a bench.shapes
    problem; `caches`: (key_cache, value_cache, k_scale, v_scale)."""
    import cpu_impl.backend as cpu_backend
    k, v, ks, vs = caches
    outs = [torch.empty_like(p.query) for _ in exts]
    lines = cpu_backend.PREFETCH_LINES if prefetch_lines is None else prefetch_lines

    def call(i: int) -> None:
        exts[i].paged_attention(
            p.query, k, v, p.block_tables.contiguous(), p.seq_lens.contiguous(), None, outs[i],
            None, None, p.query.shape[-1] ** -0.5, 0, 0.0, cpu_backend.QUERY_TILE, threads,
            cpu_backend.read_ahead, ks, vs, lines)

    times: list[list[float]] = [[] for _ in exts]
    for i in range(len(exts)):
        call(i)
    for _ in range(rounds):
        for i in range(len(exts)):
            t0 = time.perf_counter()
            call(i)
            times[i].append(time.perf_counter() - t0)
    return times, all(torch.equal(outs[0], o) for o in outs[1:])
