#include <immintrin.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
struct alignas(64) TileConfig { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
alignas(64) uint16_t A[16*32], B[16*32]; alignas(64) float C[16*16];
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  TileConfig c; for (int i = 0; i < 6; ++i) { c.colsb[i] = 64; c.rows[i] = 16; } _tile_loadconfig(&c);
  for (int i = 0; i < 512; ++i) { A[i] = 0x3f80; B[i] = 0x3f80; }
  _tile_loadd(2, A, 64); _tile_loadd(3, B, 64); _tile_zero(0); _tile_zero(1);
  const int N = 1000000;
  auto t = std::chrono::steady_clock::now();
  for (int i = 0; i < N; ++i) { _tile_dpbf16ps(0, 2, 3); _tile_dpbf16ps(1, 2, 3); }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  printf("tdp only: %.2f ns per tdp (%.0f GFLOP/s)\n", dt / (2.0 * N) * 1e9, 2.0 * N * 16 * 16 * 32 * 2 / dt / 1e9);
  t = std::chrono::steady_clock::now();
  for (int i = 0; i < N; ++i) { _tile_zero(0); _tile_loadd(2, A, 64); _tile_loadd(3, B, 64); _tile_dpbf16ps(0, 2, 3); _tile_stored(0, C, 64); }
  dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  printf("zero+2 loads+tdp+store: %.2f ns per block\n", dt / N * 1e9);
  t = std::chrono::steady_clock::now();
  for (int i = 0; i < N; ++i) { _tile_loadd(2, A, 64); }
  dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  printf("tileloadd: %.2f ns\n", dt / N * 1e9);
  t = std::chrono::steady_clock::now();
  for (int i = 0; i < N; ++i) { _tile_stored(0, C, 64); }
  dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  printf("tilestored: %.2f ns\n", dt / N * 1e9);
  _tile_release();
}
