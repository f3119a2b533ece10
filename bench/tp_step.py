"""Step time under tensor parallelism on the CPU: N = 2 ranks (one thread each) against N = 1
(two threads), for decode batches and a prefill; with the driver's time inside collectives
(all-reduce, all-gather of the logits, the step broadcast) and the bytes it all-reduces per step.

The model: random float32 weights in the layer shapes of the default model (SmolLM2-135M: 30
layers, hidden 576, MLP 1536, head size 64) but 8 query heads over 4 KV heads, which split over
2 ranks (the default model's 9 heads do not), and tests/family_case.py's 300-token vocabulary.

    python -m bench.tp_step [--out DIR] [--steps 10] [--device cpu|cuda]

Prints a markdown table and writes `tp_step.json` into `--out` when given; first each engine
generates greedily for a few prompts, and `greedy_equal` says whether N = 2 gave N = 1's tokens.
On `--device cuda` the ranks use NCCL, one GPU each (`bench.gpu_check` runs it when it sees two
GPUs). The collective time is
measured on the driver around each `torch.distributed` call, so it includes waiting for the
slower rank (skew), not only the bytes on the wire.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

#: Collectives timed on the driver (the model's and the executor's).
COLLECTIVES = ("all_reduce", "all_gather", "broadcast_object_list")


class CollectiveClock:
    """Wraps `torch.distributed`'s collectives: seconds spent in them and bytes all-reduced."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.all_reduce_bytes = 0
        self._originals: dict[str, Callable] = {}

    def install(self) -> None:
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self._originals[name] = original
            setattr(dist, name, self._timed(name, original))

    def _timed(self, name: str, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "all_reduce":
                self.all_reduce_bytes += args[0].numel() * args[0].element_size()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return call

    def reset(self) -> None:
        self.seconds, self.all_reduce_bytes = 0.0, 0


def timed_steps(engine: LLMEngine, clock: CollectiveClock, steps: int) -> dict[str, float]:
    """Median step seconds over `steps` steps, the mean collective share, all-reduce bytes."""
    times, shares, nbytes = [], [], []
    for _ in range(steps):
        clock.reset()
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        times.append(dt)
        shares.append(clock.seconds / dt)
        nbytes.append(clock.all_reduce_bytes)
    return {"step_ms": 1e3 * statistics.median(times),
            "comm_share": statistics.mean(shares), "all_reduce_bytes": max(nbytes)}


def decode(engine: LLMEngine, clock: CollectiveClock, batch: int, steps: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", [1] + [3 + (i * 7 + j) % 290 for j in range(31)],
                           params)
    engine.step()  # the prefill of every prompt (one step: 512 tokens at most)
    engine.step()  # a first decode step, not timed
    result = timed_steps(engine, clock, steps)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def prefill(engine: LLMEngine, clock: CollectiveClock, tokens: int, steps: int) -> dict:
    runs = []
    for k in range(steps):
        ids = [1] + [3 + (k * 97 + j * 13) % 290 for j in range(tokens - 1)]
        engine.add_request(f"p{k}", ids, SamplingParams(max_tokens=1, temperature=0.0))
        runs.append(timed_steps(engine, clock, 1))
        while engine.has_unfinished_requests():
            engine.step()
    return {"step_ms": statistics.median(r["step_ms"] for r in runs),
            "comm_share": statistics.mean(r["comm_share"] for r in runs),
            "all_reduce_bytes": runs[0]["all_reduce_bytes"]}


def write_model(path: str) -> str:
    """The benchmark's random-weight Llama checkpoint (see the module docstring) in `path`."""
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
    from family_case import write_checkpoint

    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    return write_checkpoint(path, config)


def greedy_tokens(engine: LLMEngine, new_tokens: int = 16) -> list[list[int]]:
    """Greedy continuations of 4 fixed prompts (the N = 1 / N = 2 equality check)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"g{i}", [1] + [3 + (i * 31 + j * 7) % 290 for j in range(9 + i)],
                           params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"g{i}"] for i in range(4)]


def measure(model: str, size: int, threads: int, steps: int,
            device: str = "cpu") -> dict[str, Any]:
    torch.set_num_threads(threads)
    config = EngineConfig(num_kv_blocks=512, enable_prefix_caching=False,
                          max_num_batched_tokens=1024, tensor_parallel_size=size,
                          tensor_parallel_threads=threads)
    engine = LLMEngine(model, torch.float32, config, device=device)
    mc = engine.model_config
    clock = CollectiveClock()
    try:
        greedy = greedy_tokens(engine)
        clock.install()
        return {"greedy": greedy,
                "decode_1": decode(engine, clock, 1, steps),
                "decode_16": decode(engine, clock, 16, steps),
                "prefill_512": prefill(engine, clock, 512, max(3, steps // 3)),
                "model": {"num_layers": mc.num_hidden_layers, "hidden_size": mc.hidden_size}}
    finally:
        engine.shutdown()
        for name, fn in clock._originals.items():
            setattr(dist, name, fn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for tp_step.json")
    p.add_argument("--steps", type=int, default=10, help="timed steps per decode case")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tp-step-") as folder:
        model = write_model(folder)
        results: dict[str, Any] = {
            "N=1 (2 threads)": measure(model, 1, 2, args.steps, args.device),
            "N=2 (1 thread each)": measure(model, 2, 1, args.steps, args.device)}
    results["greedy_equal"] = (results["N=1 (2 threads)"]["greedy"]
                               == results["N=2 (1 thread each)"]["greedy"])
    results["device"] = args.device
    tokens = {"decode_1": 1, "decode_16": 16, "prefill_512": 512}
    model = results["N=1 (2 threads)"]["model"]
    layers, hidden = model["num_layers"], model["hidden_size"]
    print(f"greedy outputs of N = 2 equal N = 1's: {results['greedy_equal']}")
    print(f"model: {layers} layers, hidden {hidden}; all-reduce bytes "
          "expected per step = 2 x layers x tokens x hidden x 4 (float32)\n")
    print("| case | N=1 step ms | N=2 step ms | N=2/N=1 | N=2 comm share | all-reduce bytes "
          "| 2*L*T*H*4 |")
    print("|---|---|---|---|---|---|---|")
    one, two = results["N=1 (2 threads)"], results["N=2 (1 thread each)"]
    for case, t in tokens.items():
        expect = 2 * layers * t * hidden * 4
        print(f"| {case} | {one[case]['step_ms']:.1f} | {two[case]['step_ms']:.1f} | "
              f"{two[case]['step_ms'] / one[case]['step_ms']:.2f} | "
              f"{100 * two[case]['comm_share']:.0f}% | {two[case]['all_reduce_bytes']} | "
              f"{expect} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tp_step.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
