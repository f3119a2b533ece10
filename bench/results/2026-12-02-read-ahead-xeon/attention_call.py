"""Decode attention call as in the batch-16 step: 16 seqs x ~270 tokens, 9 q heads / 3 kv, d 64,
bf16, block 16; per-layer caches rotated over 30 layers (cold like a step) and hot (one layer)."""
import sys, time, torch
import paged_kernels
from paged_kernels import attention
import cpu_impl.backend as cb
torch.manual_seed(0)
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
S, H, KVH, D, BS, L = 16, 9, 3, 64, 16, 30
ctx = 270
nb_per = (ctx + BS - 1) // BS
num_blocks = S * nb_per + 8
layers = []
for l in range(L):
    k = torch.randn(num_blocks, KVH, BS, D, dtype=torch.bfloat16)
    v = torch.randn(num_blocks, KVH, BS, D, dtype=torch.bfloat16)
    layers.append((k, v))
bt = torch.randperm(num_blocks)[: S * nb_per].view(S, nb_per).int()
seq_lens = torch.full((S,), ctx, dtype=torch.int32)
q = torch.randn(S, H, D, dtype=torch.bfloat16)
def call(k, v):
    return attention.paged_attention(q, k, v, bt, seq_lens, scale=D ** -0.5, backend="cpu")
for mode in ("cold", "hot"):
    for ra in (True, False):
        cb.read_ahead = ra
        for _ in range(2):
            for k, v in layers: call(k, v)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            for i in range(L):
                k, v = layers[i] if mode == "cold" else layers[0]
                call(k, v)
            ts.append((time.perf_counter() - t) / L)
        dt = sorted(ts)[len(ts)//2]
        kv_bytes = S * ctx * KVH * D * 2 * 2
        print(f"{mode} read_ahead={ra}: {dt*1e6:.0f} us/call, {kv_bytes/dt/1e9:.1f} GB/s, x30 = {dt*30*1e3:.1f} ms")
