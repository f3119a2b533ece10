"""One decoder layer of the default model at a batch-16 decode step, hot: the layer's forward and
each of its parts, timed alone in a loop, then the forward with its matmuls, attention and KV
write replaced by outputs computed once (what is left: the fused layer ops, Python, dispatch).

    python layer_parts.py [THREADS] [BATCH]

The engine (gguf, bfloat16) prefills BATCH (default 16) random 256-token prompts, runs one
decode step that records the arguments of its sixth layer call, and times with those (best of
7 x 300 calls).
"""

from __future__ import annotations

import sys
import timeit
from typing import Any, Callable

import torch

import engine.model.decoder as dec
from bench.serve_profile import decoding_engine
from engine.llm_engine import LLMEngine
from engine.model import layer_ops
from engine.model.loader import load_model


def decode_layer_call(engine: LLMEngine, which: int = 6) -> tuple[Any, tuple, dict]:
    """(layer, args, kwargs) of the `which`-th layer call of one decode step."""
    calls: list[tuple[Any, tuple, dict]] = []
    forward = dec.DecoderLayer.forward

    def record(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((self, args, kwargs))
        return forward(self, *args, **kwargs)

    dec.DecoderLayer.forward = record
    try:
        engine.step()
    finally:
        dec.DecoderLayer.forward = forward
    return calls[which - 1]


def best_us(fn: Callable[[], Any], n: int = 300) -> float:
    return min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6


class ComputedOnce:
    """An attention plan whose `run` returns its first result and whose `write_kv` does nothing."""

    def __init__(self, plan: Any) -> None:
        self.plan, self.out = plan, None

    def write_kv(self, *args: Any) -> None:
        pass

    def run(self, query: torch.Tensor, *caches: torch.Tensor) -> torch.Tensor:
        if self.out is None:
            self.out = self.plan.run(query, *caches)
        return self.out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plan, name)


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    loaded = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    engine = decoding_engine(loaded, batch, max_tokens=64)
    layer, args, kwargs = decode_layer_call(engine)
    hidden, residual, rotary, kv_cache, plans = args[:5]
    res = residual.clone()
    plan, tokens = plans[layer.window], hidden.shape[0]
    nh, nkv = layer.num_heads, layer.num_kv_heads
    x = layer_ops.rms_norm(hidden, layer.input_layernorm, layer.eps)
    qkv = dec._linear(x, layer.qkv_proj, layer.qkv_bias).view(tokens, -1, layer.head_dim)
    key, value = qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
    gate_up = dec._linear(x, layer.gate_up_proj, None)
    act = layer_ops.silu_mul(gate_up)
    attn = plan.run(qkv[:, :nh], *kv_cache).reshape(tokens, -1)
    parts = {
        "qkv matmul": lambda: dec._linear(x, layer.qkv_proj, layer.qkv_bias),
        "o matmul": lambda: dec._linear(attn, layer.o_proj, None),
        "gate_up matmul": lambda: dec._linear(x, layer.gate_up_proj, None),
        "down matmul": lambda: dec._linear(act, layer.down_proj, None),
        "write_kv": lambda: plan.write_kv(key, value, *kv_cache),
        "attention": lambda: plan.run(qkv[:, :nh], *kv_cache),
        "add_rms_norm_ (x2)": lambda: layer_ops.add_rms_norm_(res, hidden, layer.input_layernorm,
                                                              layer.eps),
        "silu_mul": lambda: layer_ops.silu_mul(gate_up),
        "rotary_": lambda: layer_ops.rotary_(qkv, nh + nkv, *rotary[layer.layer_type]),
    }
    whole = best_us(lambda: layer.forward(hidden, res.copy_(residual), *args[2:], **kwargs))
    context = plan.seq_lens.tolist()
    print(f"{whole:8.1f} us  layer forward (context {min(context)}-{max(context)} tokens)")
    total = 0.0
    for name, fn in parts.items():
        us = best_us(fn) * (2 if "x2" in name else 1)
        total += us
        print(f"{us:8.1f} us  {name}")
    print(f"{total:8.1f} us  sum of the parts")
    linear, kept = dec._linear, {}

    def linear_once(x: torch.Tensor, weight: Any, bias: Any = None) -> torch.Tensor:
        if id(weight) not in kept:
            kept[id(weight)] = linear(x, weight, bias)
        return kept[id(weight)]

    once = {window: ComputedOnce(p) for window, p in plans.items()}
    dec._linear = linear_once
    try:
        rest = best_us(lambda: layer.forward(hidden, res.copy_(residual), rotary, kv_cache, once,
                                             *args[5:], **kwargs))
    finally:
        dec._linear = linear
    print(f"{rest:8.1f} us  layer forward, matmuls/attention/write_kv computed once")
    print(f"{best_us(lambda: res.copy_(residual)):8.1f} us  (the residual copy in each forward)")


if __name__ == "__main__":
    main()
