// A decode step's projection matmuls from C, without Python between the calls: the tiled bf16
// kernel's `tiled_linear` (dlopen'ed from its built .so) over the default model's shapes (per layer:
// qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, all Q4_1), weights back to back in one
// huge-page buffer as a WeightArena lays them out (random bytes: the time does not depend on them),
// M rows of activations; prints the median sweep time and the packed bytes per second.
// With TOUCH=1 in the environment, each call only sums its weight's bytes, split over the threads
// as tiled_linear splits its tiles (contiguous halves): the memory ceiling of the same calls.
//
//   g++ -O2 -march=native -fopenmp stream_sweep.cpp -o stream_sweep -ldl
//   ./stream_sweep TILED_SO THREADS M ROUNDS LAYERS KINDS     (KINDS: the projections swept per
//                                                            layer, e.g. 0123 or 2)
#include <dlfcn.h>
#include <sys/mman.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <immintrin.h>
// the same bytes, the same split over threads, only summed: the call pattern's memory ceiling
int touch(const uint16_t*, const uint8_t* w, int, uint16_t* y, int64_t, int64_t N, int64_t K, int threads) {
  const int64_t bytes = (N + 15) / 16 * (K / 32) * 320;
  __m512i tot = _mm512_setzero_si512();
#pragma omp parallel num_threads(threads)
  {
    const int n = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t lines = bytes / 64, l0 = lines * id / n, l1 = lines * (id + 1) / n;
    __m512i s0 = _mm512_setzero_si512(), s1 = s0;
    for (int64_t l = l0; l + 1 < l1; l += 2) {
      _mm_prefetch((const char*)(w + (l + 160) * 64), _MM_HINT_T1);
      _mm_prefetch((const char*)(w + (l + 161) * 64), _MM_HINT_T1);
      s0 = _mm512_add_epi32(s0, _mm512_loadu_si512(w + l * 64));
      s1 = _mm512_add_epi32(s1, _mm512_loadu_si512(w + (l + 1) * 64));
    }
#pragma omp critical
    tot = _mm512_add_epi32(tot, _mm512_add_epi32(s0, s1));
  }
  y[0] = (uint16_t)_mm512_reduce_add_epi32(tot);
  return 0;
}
using Fn = int (*)(const uint16_t*, const uint8_t*, int, uint16_t*, int64_t, int64_t, int64_t, int);
using Bytes = int64_t (*)(int, int64_t, int64_t);
int main(int argc, char** argv) {
  void* h = dlopen(argv[1], RTLD_NOW);
  if (!h) { printf("%s\n", dlerror()); return 1; }
  Fn lin = getenv("TOUCH") ? touch : (Fn)dlsym(h, "tiled_linear");
  Bytes pb = (Bytes)dlsym(h, "tiled_packed_bytes");
  int threads = atoi(argv[2]); int64_t M = atoi(argv[3]); int rounds = atoi(argv[4]);
  int layers = argc > 5 ? atoi(argv[5]) : 30;
  const char* kinds = argc > 6 ? argv[6] : "0123";  // projection kinds swept, in order
  struct W { int64_t N, K; int64_t off; };
  std::vector<W> ws; int64_t total = 0;
  int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  for (int l = 0; l < layers; ++l) for (const char* c = kinds; *c; ++c) { int j = *c - '0';
    int64_t b = pb(0, shapes[j][0], shapes[j][1]);
    ws.push_back({shapes[j][0], shapes[j][1], total}); total += (b + 63) / 64 * 64; }
  size_t sz = (total + (4 << 20)); uint8_t* raw = (uint8_t*)mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(raw, sz, MADV_HUGEPAGE);
  uint8_t* base = (uint8_t*)(((uintptr_t)raw + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
  for (int64_t i = 0; i < total; ++i) base[i] = (uint8_t)(i * 2654435761u >> 13);
  // valid f16 scales everywhere is not needed for timing
  std::vector<uint16_t> x(M * 1536, 0x3f80), y(M * 3072);
  std::vector<double> ts;
  for (int r = 0; r < rounds + 3; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (auto& w : ws) lin(x.data(), base + w.off, 0, y.data(), M, w.N, w.K, threads);
    auto t1 = std::chrono::steady_clock::now();
    if (r >= 3) ts.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  double med = ts[ts.size() / 2];
  printf("threads %d M %ld calls %zu: median %.3f ms min %.3f ms  %.1f GB/s  %.2f us/call\n", threads, (long)M, ws.size(), med, ts[0], total / med / 1e6, med * 1e3 / ws.size());
}
