#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
#include <pthread.h>
double run(long n) {
  auto t0 = std::chrono::steady_clock::now();
  asm volatile(
    "vxorps %%zmm0,%%zmm0,%%zmm0\n vxorps %%zmm1,%%zmm1,%%zmm1\n vxorps %%zmm2,%%zmm2,%%zmm2\n vxorps %%zmm3,%%zmm3,%%zmm3\n"
    "vxorps %%zmm4,%%zmm4,%%zmm4\n vxorps %%zmm5,%%zmm5,%%zmm5\n vxorps %%zmm6,%%zmm6,%%zmm6\n vxorps %%zmm7,%%zmm7,%%zmm7\n"
    "vxorps %%zmm8,%%zmm8,%%zmm8\n vxorps %%zmm9,%%zmm9,%%zmm9\n vxorps %%zmm10,%%zmm10,%%zmm10\n vxorps %%zmm11,%%zmm11,%%zmm11\n"
    "1:\n"
    "vfmadd231ps %%zmm14,%%zmm15,%%zmm0\n vfmadd231ps %%zmm14,%%zmm15,%%zmm1\n vfmadd231ps %%zmm14,%%zmm15,%%zmm2\n vfmadd231ps %%zmm14,%%zmm15,%%zmm3\n"
    "vfmadd231ps %%zmm14,%%zmm15,%%zmm4\n vfmadd231ps %%zmm14,%%zmm15,%%zmm5\n vfmadd231ps %%zmm14,%%zmm15,%%zmm6\n vfmadd231ps %%zmm14,%%zmm15,%%zmm7\n"
    "vfmadd231ps %%zmm14,%%zmm15,%%zmm8\n vfmadd231ps %%zmm14,%%zmm15,%%zmm9\n vfmadd231ps %%zmm14,%%zmm15,%%zmm10\n vfmadd231ps %%zmm14,%%zmm15,%%zmm11\n"
    "dec %0\n jnz 1b\n" : "+r"(n) :: "zmm0","zmm1","zmm2","zmm3","zmm4","zmm5","zmm6","zmm7","zmm8","zmm9","zmm10","zmm11","cc");
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
int main() {
  long n = 300000000;
  for (int rep = 0; rep < 2; ++rep) {
    double t1 = run(n);
    printf("1 thread: %.3f s  (%.2f fma/ns)\n", t1, 12.0 * n / t1 / 1e9);
    double r[2]; std::vector<std::thread> th;
    for (int k = 0; k < 2; ++k) th.emplace_back([&, k] { cpu_set_t s; CPU_ZERO(&s); CPU_SET(k, &s); pthread_setaffinity_np(pthread_self(), sizeof s, &s); r[k] = run(n); });
    for (auto& t : th) t.join();
    printf("2 threads: %.3f s, %.3f s each (%.2f fma/ns each)\n", r[0], r[1], 12.0 * n / r[0] / 1e9);
  }
}
