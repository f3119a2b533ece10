"""How long after the calling thread the second OpenMP thread starts a parallel region, after
the team sat idle for 5 us to 1 ms (libgomp as torch loads it; omp_wake.cpp built into
omp_wake.so next to this file):

    g++ -O2 -fopenmp -shared -fPIC omp_wake.cpp -o omp_wake.so && python omp_wake.py
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

torch.set_num_threads(2)
probe = ctypes.CDLL(str(Path(__file__).resolve().parent / "omp_wake.so"))
for gap_us in (5, 50, 200, 1000):
    out = (ctypes.c_double * 400)()
    probe.wake_probe(400, gap_us * 1000, out)
    delays = sorted(out[50:])
    print(f"idle {gap_us:5d} us: worker starts after median {delays[len(delays) // 2] / 1e3:5.1f}"
          f" us, p90 {delays[int(len(delays) * 0.9)] / 1e3:5.1f} us")
