// Random-chunk reads with a paced prefetch D lines ahead across chunk boundaries, hint H.
#include <immintrin.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
int main(int argc, char** argv) {
  size_t mb = atoi(argv[1]); size_t chunk = atoi(argv[2]); int D = atoi(argv[3]); int hint = atoi(argv[4]);
  size_t n = mb << 20;
  char* buf = (char*)aligned_alloc(2 << 20, n); madvise(buf, n, MADV_HUGEPAGE);
  for (size_t i = 0; i < n; ++i) buf[i] = i;
  size_t nc = n / chunk, lpc = chunk / 64;
  std::vector<size_t> order(nc);
  for (size_t i = 0; i < nc; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  __m512 acc = _mm512_setzero_ps();
  double best = 1e9;
  for (int r = 0; r < 6; ++r) {
    auto t = std::chrono::steady_clock::now();
    size_t pc = 0, pl = 0;  // prefetch cursor
    auto adv = [&]() { if (pc >= nc) return; const char* q = buf + order[pc] * chunk + pl * 64;
      switch (hint) { case 0: _mm_prefetch(q, _MM_HINT_T0); break; case 1: _mm_prefetch(q, _MM_HINT_T1); break;
                      case 2: _mm_prefetch(q, _MM_HINT_T2); break; default: _mm_prefetch(q, _MM_HINT_NTA); }
      if (++pl == lpc) { pl = 0; ++pc; } };
    for (int i = 0; i < D; ++i) adv();
    for (size_t c = 0; c < nc; ++c) {
      const char* p = buf + order[c] * chunk;
      for (size_t x = 0; x < chunk; x += 64) { if (D) adv(); acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(p + x))); }
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    best = std::min(best, dt);
  }
  float s[16]; _mm512_storeu_ps(s, acc);
  printf("%zu MB chunk %zu D %d hint %d: %.1f GB/s (%g)\n", mb, chunk, D, hint, n / best / 1e9, s[0]);
}
