# ruff: noqa: E402, E501, E701, B023  (kept as it ran: a one-off measurement script)
"""Ad-hoc crossover: quantized_linear (this machine's build) vs torch dense float32 (oneDNN-packed,
as the model packs), per projection shape of the default model, 30 layers' weights cycled.
Paths alternate per sweep; medians. argv: threads clock(cpu|wall) reps."""
import statistics
import sys
import time
import torch
sys.path.insert(0, ".")
from bench.test_bench_quant import dense_linear, dense_weight
from engine.model.gguf_reader import gguf_blocks, gguf_config, gguf_metadata, open_gguf
from engine.model.loader import default_model_path
from engine.model.quant import GGUFBlocks, quantized_linear, _KERNEL

threads, clock, reps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
DT = getattr(torch, sys.argv[6]) if len(sys.argv) > 6 else torch.float32
ms = [int(v) for v in sys.argv[4].split(",")] if len(sys.argv) > 4 else [1, 2, 4, 6, 8, 10, 12, 16]
tick = time.thread_time if clock == "cpu" else time.perf_counter
torch.set_num_threads(threads)
print("kernel:", _KERNEL.get().simd_paths, "threads", threads, "clock", clock)
reader = open_gguf(default_model_path())
config = gguf_config(gguf_metadata(reader), {t.name for t in reader.tensors})
by = dict(gguf_blocks(reader, config))
L = config.num_hidden_layers
proj = {
    "q/o 576x576": [by[f"model.layers.{i}.self_attn.q_proj.weight"] for i in range(L)],
    "k/v 192x576": [by[f"model.layers.{i}.self_attn.k_proj.weight"] for i in range(L)],
    "gate/up 1536x576": [by[f"model.layers.{i}.mlp.gate_proj.weight"] for i in range(L)],
    "down 576x1536": [by[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(L)],
    "qkv fused 960x576": [GGUFBlocks.concat([by[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]) for i in range(L)],
    "gate_up fused 3072x576": [GGUFBlocks.concat([by[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")]) for i in range(L)],
    "head Q8_0 49152x576": [by["model.embed_tokens.weight"]] * 2,
}
sel = sys.argv[5].split(";") if len(sys.argv) > 5 else list(proj)
for name in sel:
    blocks = proj[name]
    rows, cols = blocks[0].shape
    dense = [dense_weight((rows, cols), DT) for _ in range(len(set(map(id, blocks))))]
    line = []
    for m in ms:
        x = torch.randn(m, cols).to(DT)
        def fq(i):
            return quantized_linear(x, blocks[i])
        def fd(i):
            return dense_linear(x, dense[i % len(dense)])
        t = {"q": [], "d": []}
        for f in (fq, fd):
            for i in range(len(blocks)): f(i)
        for _ in range(reps):
            for k, f in (("q", fq), ("d", fd)):
                s = tick()
                for i in range(len(blocks)): f(i)
                t[k].append((tick() - s) / len(blocks) * 1e6)
        q, d = statistics.median(t["q"]), statistics.median(t["d"])
        print(f"| {name} | {blocks[0].qtype} | {m} | {q:.1f} | {d:.1f} | {d/q:.2f} |", flush=True)
