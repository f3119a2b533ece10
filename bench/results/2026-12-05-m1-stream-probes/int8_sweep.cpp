// The int8 kernel's `int8_linear` (dlopen'ed from its built .so) from C over the default model's
// projection shapes (per layer: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, Q4_1),
// weights back to back in one huge-page buffer (random codes, f16 scales 2^-4), M rows of bf16
// activations; prints the median sweep time, GOP/s and packed bytes per second. SAME=1: every
// layer reuses layer 0's weights (cache-hot).
//
//   g++ -O2 -fopenmp int8_sweep.cpp -o int8_sweep -ldl
//   ./int8_sweep INT8_SO THREADS M ROUNDS LAYERS KINDS        (KINDS: e.g. 0123)
#include <dlfcn.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
using Fn = int (*)(const void*, int, const uint8_t*, int, void*, int64_t, int64_t, int64_t, int);
using Bytes = int64_t (*)(int, int64_t, int64_t);
int main(int argc, char** argv) {
  void* h = dlopen(argv[1], RTLD_NOW);
  Fn lin = (Fn)dlsym(h, "int8_linear");
  Bytes pb = (Bytes)dlsym(h, "int8_packed_bytes");
  int threads = atoi(argv[2]); int64_t M = atoi(argv[3]); int rounds = atoi(argv[4]);
  int layers = atoi(argv[5]); const char* kinds = argv[6];
  struct W { int64_t N, K, off; };
  std::vector<W> ws; int64_t total = 0; double flop = 0;
  int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  int same = getenv("SAME") != nullptr;  // the layers' calls reuse layer 0's weights (cache-hot)
  for (int l = 0; l < layers; ++l) for (const char* c = kinds; *c; ++c) { int j = *c - '0';
    int64_t b = pb(0, shapes[j][0], shapes[j][1]);
    if (same && l > 0) { ws.push_back(ws[c - kinds]); flop += 2.0 * M * shapes[j][0] * shapes[j][1]; continue; }
    ws.push_back({shapes[j][0], shapes[j][1], total});
    total += (b + 63) / 64 * 64; flop += 2.0 * M * shapes[j][0] * shapes[j][1]; }
  size_t sz = total + (4 << 20);
  uint8_t* raw = (uint8_t*)mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(raw, sz, MADV_HUGEPAGE);
  uint8_t* base = (uint8_t*)(((uintptr_t)raw + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
  for (int64_t i = 0; i < total; ++i) base[i] = (uint8_t)(i * 2654435761u >> 13);
  for (auto& w : ws) for (int64_t t = 0; t < (w.N + 15) / 16 * (w.K / 32); ++t) {  // sane f16 scales
    uint16_t* sc = (uint16_t*)(base + w.off + t * 320 + 256); for (int j = 0; j < 32; ++j) sc[j] = 0x2c00; }
  std::vector<uint16_t> x(M * 1536, 0x3f80), y(M * 3072);
  std::vector<double> ts;
  for (int r = 0; r < rounds + 3; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (auto& w : ws) lin(x.data(), 1, base + w.off, 0, y.data(), M, w.N, w.K, threads);
    auto t1 = std::chrono::steady_clock::now();
    if (r >= 3) ts.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ts.begin(), ts.end()); double med = ts[ts.size() / 2];
  printf("M %ld calls %zu (%s x%d): median %.3f ms min %.3f  %.0f GOP/s  %.1f GB/s\n", (long)M, ws.size(), kinds, layers, med, ts[0], flop / med / 1e6, total / med / 1e6);
}
