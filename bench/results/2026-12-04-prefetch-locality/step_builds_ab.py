"""Decode steps of one engine (default model, gguf, bfloat16, batch BATCH, 2 threads) with
cpu-backend builds swapped in turns, 10 steps at a time, in one process. Each variant is
`PATH@LINES` or `PATH@LINES@ra`: a compiled extension, its `prefetch_lines`, and `ra` for the
decode read-ahead on (csrc/read_ahead.h):

    python step_builds_ab.py ROUNDS BATCH VARIANT [VARIANT ...]

Prints each variant's median and mean ms per decode step over the rounds, and the median ms per
step spent in the backend's `paged_attention` calls (30 layers)."""

from __future__ import annotations

import statistics
import sys

import torch

import cpu_impl.backend as cpu_backend
import paged_kernels as pk
from bench.build_ab import load_extension, steps_in_turns, timed_attention
from bench.serve_profile import decoding_engine
from engine.model.loader import load_model


def main() -> None:
    rounds, batch = int(sys.argv[1]), int(sys.argv[2])
    variants = [(load_extension(v.split("@")[0]), int(v.split("@")[1]), v.endswith("@ra"))
                for v in sys.argv[3:]]
    torch.set_num_threads(2)
    attention: list[float] = []
    timed_attention(cpu_backend.CpuBackend, attention)
    backend = pk.backends.get_backend("cpu")
    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    engine = decoding_engine(loaded, batch, max_tokens=900)

    def switch(ext, lines: int, read_ahead: bool) -> None:
        backend._ext = ext
        cpu_backend.prefetch_lines = lines
        cpu_backend.read_ahead = read_ahead

    times, in_attention = steps_in_turns(engine, [lambda v=v: switch(*v) for v in variants],
                                         rounds, attention)
    for name, ms, att in zip(sys.argv[3:], times, in_attention):
        print(f"{name.rsplit('/', 1)[-1]}: median {statistics.median(ms):.2f} ms, mean "
              f"{statistics.mean(ms):.2f} ms per step over {len(ms)} rounds of 10; attention "
              f"median {statistics.median(att):.2f} ms per step", flush=True)


if __name__ == "__main__":
    main()
