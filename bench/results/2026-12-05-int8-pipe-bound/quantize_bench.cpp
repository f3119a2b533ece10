#include <dlfcn.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
using Q = int (*)(const void*, int, int64_t, int64_t, int8_t*, float*, float*, int);
using Fn = int (*)(const void*, int, const uint8_t*, int, void*, int64_t, int64_t, int64_t, int);
int main(int argc, char** argv) {
  void* h = dlopen(argv[1], RTLD_NOW);
  Q q = (Q)dlsym(h, "int8_quantize");
  int64_t M = atoi(argv[2]), K = atoi(argv[3]); int threads = atoi(argv[4]);
  std::vector<uint16_t> x(M * K);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0x3f80 + (i * 2654435761u >> 20) % 200;
  std::vector<int8_t> xq(M * K); std::vector<float> xd(M * K / 32), xs(M * K / 32);
  std::vector<double> ts;
  for (int r = 0; r < 2000; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    q(x.data(), 1, M, K, xq.data(), xd.data(), xs.data(), threads);
    ts.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  printf("M %ld K %ld: median %.0f ns, %.1f ns/block\n", (long)M, (long)K, ts[1000], ts[1000] / (M * K / 32));
}
