"""One decode attention call as in the batch-16 step (16 sequences x 270 tokens, 9 query heads
over 3 KV heads of 64, bf16, block size 16, a random block table), with and without the cpu
backend's read-ahead: "cold" rotates 30 layers' caches (as a step reads them), "hot" reuses one.
Usage: python attention_call.py THREADS"""

import sys
import time

import torch

import cpu_impl.backend as cpu_backend
from paged_kernels import attention

SEQS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK, LAYERS, CONTEXT = 16, 9, 3, 64, 16, 30, 270


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    per_seq = (CONTEXT + BLOCK - 1) // BLOCK
    num_blocks = SEQS * per_seq + 8
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_SIZE)
    layers = [(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks)[: SEQS * per_seq].view(SEQS, per_seq).int()
    seq_lens = torch.full((SEQS,), CONTEXT, dtype=torch.int32)
    q = torch.randn(SEQS, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    kv_bytes = SEQS * CONTEXT * KV_HEADS * HEAD_SIZE * 2 * 2
    for mode in ("cold", "hot"):
        for on in (True, False):
            cpu_backend.read_ahead = on
            times = []
            for sweep in range(7):
                t = time.perf_counter()
                for i in range(LAYERS):
                    k, v = layers[i] if mode == "cold" else layers[0]
                    attention.paged_attention(q, k, v, tables, seq_lens, scale=HEAD_SIZE ** -0.5,
                                              backend="cpu")
                if sweep >= 2:  # two warm-up sweeps
                    times.append((time.perf_counter() - t) / LAYERS)
            s = sorted(times)[len(times) // 2]
            print(f"{mode} read_ahead={on}: {s * 1e6:.0f} us/call, {kv_bytes / s / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
