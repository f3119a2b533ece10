// The read bandwidth a CPU's cores reach streaming one buffer (bench/ceilings.py
// `read_bandwidth`): each of `threads` OpenMP threads sums its contiguous share of the buffer's
// 64-bit words in eight independent chains (no store, no dependence between loads), so that the
// loads are bound by memory, not by the arithmetic. A plain shared library, built at first use by
// paged_kernels.cpp_build.load_library and called through ctypes.
#include <omp.h>

#include <cstdint>

extern "C" {

// Sum of the `n` words at `words` (wrapping), read by `threads` threads; the caller keeps it so
// that the compiler keeps the loads.
uint64_t read_words(const uint64_t* words, int64_t n, int threads) {
  uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t begin = n * id / nt, end = n * (id + 1) / nt;
    uint64_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
      for (int j = 0; j < 8; ++j) s[j] += words[i + j];
    for (; i < end; ++i) s[0] += words[i];
    for (int j = 0; j < 8; ++j) total += s[j];
  }
  return total;
}

}  // extern "C"
