#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
#include <sys/mman.h>
int main(int argc, char** argv) {
  size_t mb = atoi(argv[1]); size_t chunk = atoi(argv[2]); int pf = atoi(argv[3]);
  size_t n = mb << 20;
  char* buf = (char*)aligned_alloc(2 << 20, n); if (getenv("HUGE")) madvise(buf, n, MADV_HUGEPAGE);
  for (size_t i = 0; i < n; ++i) buf[i] = i;
  size_t nc = n / chunk;
  std::vector<size_t> order(nc);
  for (size_t i = 0; i < nc; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  __m512 acc = _mm512_setzero_ps();
  double best = 1e9;
  for (int r = 0; r < 10; ++r) {
    auto t = std::chrono::steady_clock::now();
    for (size_t c = 0; c < nc; ++c) {
      const char* p = buf + order[c] * chunk;
      if (pf) { const char* q = buf + order[std::min(c + pf, nc - 1)] * chunk; for (size_t x = 0; x < chunk; x += 64) _mm_prefetch(q + x, _MM_HINT_T0); }
      for (size_t x = 0; x < chunk; x += 64) acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(p + x)));
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    best = std::min(best, dt);
  }
  float s[16]; _mm512_storeu_ps(s, acc);
  printf("%zu MB chunk %zu pf %d: %.1f GB/s (%g)\n", mb, chunk, pf, n / best / 1e9, s[0]);
}
