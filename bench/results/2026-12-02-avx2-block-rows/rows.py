# ruff: noqa: E402, E501, E701, B023  (kept as it ran: a one-off measurement script)
"""The float32 block matmul before and after the AVX2 buffered row tile, and torch's dense
float32 matmul (oneDNN-packed, as the model packs), per projection shape of the default model
(30 layers' blocks cycled; the head: its one weight, twice). The three alternate within every
sweep; medians of sweeps (one thread: its CPU time; two: wall clock). argv: threads reps M-list old-source-dir [shapes ;-joined].
The old source dir holds the kernel before the change (quant_matmul.cpp + gguf_scalars.h)."""
import statistics
import sys
import time
from pathlib import Path
import torch
sys.path.insert(0, ".")
from bench.test_bench_quant import dense_linear, dense_weight
from engine.model.gguf_reader import gguf_blocks, gguf_config, gguf_metadata, open_gguf
from engine.model.loader import default_model_path
from engine.model.quant import quantized_linear
from engine.native_build import TIERS, QuantKernel, load_quant
from paged_kernels.cpp_build import compile_flags, load_library

threads, reps = int(sys.argv[1]), int(sys.argv[2])
#: one thread: the calling thread's CPU time (a shared machine); two: wall clock.
tick = time.thread_time if threads == 1 else time.perf_counter
ms = [int(v) for v in sys.argv[3].split(",")]
old = QuantKernel(load_library(Path(sys.argv[4]) / "quant_matmul.cpp", "old_quant",
                               compile_flags(TIERS), "old quant"))
new = load_quant()
torch.set_num_threads(threads)
print("kernels:", old.simd_paths, new.simd_paths, "threads", threads)
reader = open_gguf(default_model_path())
config = gguf_config(gguf_metadata(reader), {t.name for t in reader.tensors})
by = dict(gguf_blocks(reader, config))
L = config.num_hidden_layers
proj = {
    "q/o 576x576": [by[f"model.layers.{i}.self_attn.q_proj.weight"] for i in range(L)],
    "k/v 192x576": [by[f"model.layers.{i}.self_attn.k_proj.weight"] for i in range(L)],
    "gate/up 1536x576": [by[f"model.layers.{i}.mlp.gate_proj.weight"] for i in range(L)],
    "down 576x1536": [by[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(L)],
    "head 49152x576": [by["model.embed_tokens.weight"]] * 2,
}
sel = sys.argv[5].split(";") if len(sys.argv) > 5 else list(proj)
print("| shape | M | old µs | new µs | dense µs | old/new | dense/new |")
print("|---|---|---|---|---|---|---|")
for name in sel:
    blocks = proj[name]
    rows, cols = blocks[0].shape
    dense = [dense_weight((rows, cols), torch.float32) for _ in range(len(set(map(id, blocks))))]
    for m in ms:
        x = torch.randn(m, cols)
        fns = {"old": lambda i: quantized_linear(x, blocks[i], kernel=old),
               "new": lambda i: quantized_linear(x, blocks[i], kernel=new),
               "dense": lambda i: dense_linear(x, dense[i % len(dense)])}
        assert torch.equal(fns["old"](0), fns["new"](0)), "old and new bits differ"
        t = {k: [] for k in fns}
        for _ in range(reps):
            for k, f in fns.items():
                s = tick()
                for i in range(len(blocks)): f(i)
                t[k].append((tick() - s) / len(blocks) * 1e6)
        o, n, d = (statistics.median(t[k]) for k in ("old", "new", "dense"))
        print(f"| {name} | {m} | {o:.1f} | {n:.1f} | {d:.1f} | {o/n:.2f} | {d/n:.2f} |", flush=True)
