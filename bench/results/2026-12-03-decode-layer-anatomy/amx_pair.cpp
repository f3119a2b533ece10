#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <thread>
#include <vector>
#include <pthread.h>
struct alignas(64) TileConfig { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
alignas(64) static uint16_t A[2][512], B[2][512];
double run(long n, int mode) {
  TileConfig c; for (int i = 0; i < 6; ++i) { c.colsb[i] = 64; c.rows[i] = 16; } _tile_loadconfig(&c);
  alignas(64) float C[256];
  auto t0 = std::chrono::steady_clock::now();
  if (mode == 0) for (long i = 0; i < n; ++i) { _tile_dpbf16ps(0, 2, 3); _tile_dpbf16ps(1, 2, 3); }
  else for (long i = 0; i < n; ++i) { _tile_zero(0); _tile_loadd(2, A[0], 64); _tile_loadd(3, B[0], 64); _tile_dpbf16ps(0, 2, 3); _tile_stored(0, C, 64); }
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return t;
}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  for (int i = 0; i < 512; ++i) { A[0][i] = B[0][i] = 0x3f80; }
  long n = 20000000;
  for (int mode = 0; mode < 2; ++mode) {
    double t1 = run(n, mode);
    double per = mode == 0 ? 2 * n : n;
    printf("mode %d 1 thread: %.2f ns/op\n", mode, t1 / per * 1e9);
    double r[2]; std::vector<std::thread> th;
    for (int k = 0; k < 2; ++k) th.emplace_back([&, k] { cpu_set_t s; CPU_ZERO(&s); CPU_SET(k, &s); pthread_setaffinity_np(pthread_self(), sizeof s, &s); syscall(SYS_arch_prctl, 0x1023, 18); r[k] = run(n, mode); });
    for (auto& t : th) t.join();
    printf("mode %d 2 threads: %.2f / %.2f ns/op\n", mode, r[0] / per * 1e9, r[1] / per * 1e9);
  }
}
