// int8_sweep with two builds alternating rounds in one process: prints per-build median ms and the
// per-round ratio B/A.
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
  Fn lin[2]; Bytes pb = nullptr;
  for (int v = 0; v < 2; ++v) { void* h = dlopen(argv[1 + v], RTLD_NOW | RTLD_LOCAL); lin[v] = (Fn)dlsym(h, "int8_linear"); pb = (Bytes)dlsym(h, "int8_packed_bytes"); }
  int threads = atoi(argv[3]); int64_t M = atoi(argv[4]); int rounds = atoi(argv[5]); int layers = atoi(argv[6]);
  struct W { int64_t N, K, off; };
  std::vector<W> ws; int64_t total = 0; double flop = 0;
  int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  for (int l = 0; l < layers; ++l) for (int j = 0; j < 4; ++j) {
    int64_t b = pb(0, shapes[j][0], shapes[j][1]);
    ws.push_back({shapes[j][0], shapes[j][1], total});
    total += (b + 63) / 64 * 64; flop += 2.0 * M * shapes[j][0] * shapes[j][1]; }
  size_t sz = total + (4 << 20);
  uint8_t* raw = (uint8_t*)mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(raw, sz, MADV_HUGEPAGE);
  uint8_t* base = (uint8_t*)(((uintptr_t)raw + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
  for (int64_t i = 0; i < total; ++i) base[i] = (uint8_t)(i * 2654435761u >> 13);
  for (auto& w : ws) for (int64_t t = 0; t < (w.N + 15) / 16 * (w.K / 32); ++t) {
    uint16_t* sc = (uint16_t*)(base + w.off + t * 320 + 256); for (int j = 0; j < 32; ++j) sc[j] = 0x2c00; }
  std::vector<uint16_t> x(M * 1536);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0x3f80 + (i * 2654435761u >> 20) % 200;
  std::vector<uint16_t> y(M * 3072);
  std::vector<double> ts[2], ratio;
  for (int r = 0; r < rounds + 1; ++r) {
    double t[2];
    for (int k = 0; k < 2; ++k) {
      int v = (r % 2) ? 1 - k : k;
      auto t0 = std::chrono::steady_clock::now();
      for (auto& w : ws) lin[v](x.data(), 1, base + w.off, 0, y.data(), M, w.N, w.K, threads);
      t[v] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    if (r == 0) continue;
    ts[0].push_back(t[0]); ts[1].push_back(t[1]); ratio.push_back(t[1] / t[0]);
  }
  for (auto* v : {&ts[0], &ts[1], &ratio}) std::sort(v->begin(), v->end());
  size_t h = ratio.size() / 2;
  printf("M %ld: A %.3f ms (%.0f GOP/s), B %.3f ms (%.0f GOP/s), B/A median %.3f [%.3f, %.3f]\n", (long)M, ts[0][h], flop / ts[0][h] / 1e6, ts[1][h], flop / ts[1][h] / 1e6, ratio[h], ratio.front(), ratio.back());
}
