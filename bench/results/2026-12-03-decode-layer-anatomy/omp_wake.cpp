#include <omp.h>
#include <x86intrin.h>
#include <cstdint>
#include <chrono>
#include <time.h>
static inline uint64_t now_ns() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000ull + t.tv_nsec; }
extern "C" void wake_probe(int reps, int64_t gap_ns, double* out) {
  for (int r = 0; r < reps; ++r) {
    uint64_t t0 = now_ns();
    while (now_ns() - t0 < (uint64_t)gap_ns) {}
    uint64_t start = now_ns(), worker = 0;
#pragma omp parallel num_threads(2)
    {
      if (omp_get_thread_num() == 1) worker = now_ns();
    }
    out[r] = (double)(worker - start);
  }
}
