"""In-process A/B of the engine's decode step with the native layer loop off and on
(engine/model/layer_loop.py): one engine, `BATCH` greedy requests of 256 random prompt tokens
prefilled, then `ROUNDS` rounds in which each setting runs `STEPS` decode steps in turn (the
order alternating by round), so that both see the same machine load and nearly the same context.
Prints the median step of each round and setting, then the median of the rounds' medians.

    python loop_ab.py QUANTIZATION BATCH ROUNDS [STEPS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.serve_profile import decoding_engine
from engine.model import layer_loop
from engine.model.loader import load_model


def main() -> None:
    quantization, batch, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    torch.set_num_threads(2)
    loaded = load_model(None, dtype=torch.bfloat16, quantization=quantization)
    engine = decoding_engine(loaded, batch, max_tokens=4000, max_model_len=4096)
    medians: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            layer_loop.use_loop = on
            loaded.model.weights_changed()
            engine.step()  # (re)builds the loop
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            medians[on].append(statistics.median(times) * 1e3)
    print(f"{quantization}, batch {batch}, {rounds} rounds of {steps} steps, 2 threads")
    for on, ms in medians.items():
        print(f"loop {'on ' if on else 'off'}: " + " ".join(f"{m:.2f}" for m in ms)
              + f" | median {statistics.median(ms):.2f} ms")


if __name__ == "__main__":
    main()
