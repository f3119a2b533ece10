"""The cost of structured outputs: decode throughput of `--batch` concurrent requests (one
engine batch), every one constrained by a JSON schema vs none, and the per-step cost of the
token mask (`engine.structured_output.apply_grammar_masks`: filling the bitmask of each
constrained row, then the masked write) at several batch sizes.

Both runs generate exactly `--max-tokens` tokens per request: the schema asks for a longer
array than fits (so constrained requests end by length) and the unconstrained ones ignore EOS.
Greedy, so both runs are deterministic.

    python -m bench.structured_output --out bench/results/<date>-structured-output/result.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import engine.sampler
from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output import GrammarState, apply_grammar_masks

SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 100,
    "items": {"type": "object", "properties": {"name": {"type": "string"},
                                               "qty": {"type": "integer"}},
              "required": ["name", "qty"]}}}, "required": ["items"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.structured_output")
    p.add_argument("--batch", type=int, default=16, help="concurrent requests (16)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (64)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode; best kept (3)")
    p.add_argument("--mask-batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=None, help="torch threads (torch's)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    return p.parse_args(argv)


class MaskTimer:
    """Wraps the sampler's `apply_grammar_masks` and adds up the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = engine.sampler.apply_grammar_masks

    def __call__(self, *args: Any) -> None:
        start = time.perf_counter()
        self._inner(*args)
        self.seconds += time.perf_counter() - start


def run(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict[str, Any]:
    """Output tokens per second of generating all `prompts` at once, and the share of that
    time spent in the mask."""
    timer = MaskTimer()
    engine.sampler.apply_grammar_masks = timer
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        engine.sampler.apply_grammar_masks = timer._inner
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "mask_share": timer.seconds / seconds}


def throughput(llm: LLM, prompts: list[dict], modes: dict[str, SamplingParams], repeats: int
               ) -> dict[str, dict[str, Any]]:
    """Per mode, the fastest of `repeats` runs; the modes alternate, so that a machine shared
    with other work slows both alike."""
    best: dict[str, dict[str, Any]] = {}
    for _ in range(repeats):
        for name, params in modes.items():
            result = run(llm, prompts, params)
            if name not in best or result["seconds"] < best[name]["seconds"]:
                best[name] = result
    return best


def mask_cost(llm: LLM, batch: int, steps: int = 50) -> dict[str, float]:
    """Milliseconds per step of the mask for `batch` matchers inside the schema's array."""
    engine = llm.llm_engine
    compiled = engine.structured_output.compile(StructuredOutputsParams(json=SCHEMA))
    prefix = engine.tokenizer.encode('{"items": [{"name": "a", "qty": 1}, ')
    grammars = [GrammarState(compiled, prefix) for _ in range(batch)]
    logits = torch.randn(batch, engine.model_config.vocab_size)
    rows = list(range(batch))
    apply_grammar_masks(logits.clone(), rows, grammars)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        apply_grammar_masks(logits.clone(), rows, grammars)
    masked = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for _ in range(steps):
        logits.clone()
    copy = (time.perf_counter() - start) / steps
    return {"batch": batch, "mask_ms": 1e3 * (masked - copy)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(max_num_seqs=max(args.batch, 16))
    tok = llm.llm_engine.tokenizer
    prompts = [{"prompt_token_ids": tok.encode(f"Inventory list number {i} as JSON:")}
               for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    modes = {"unconstrained": free, "json_schema": constrained}
    throughput(llm, prompts[:2], modes, 1)  # warm-up (kernels, compile cache)
    result: dict[str, Any] = {
        "batch": args.batch, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
        **throughput(llm, prompts, modes, args.repeats),
        "mask": [mask_cost(llm, b) for b in args.mask_batches]}
    result["ratio"] = (result["json_schema"]["tokens_per_s"]
                       / result["unconstrained"]["tokens_per_s"])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
