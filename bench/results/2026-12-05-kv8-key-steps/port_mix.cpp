// Throughput of the 512-bit instructions of the 8-bit decode path, alone and in pairs, on one
// core: cycles per iteration of a block of independent instructions (register operands, no
// dependency between iterations but the accumulators'). The clock is taken from a chain of
// dependent integer adds (one per cycle).
//
//   g++ -O2 -march=native port_mix.cpp -o port_mix && taskset -c 1 ./port_mix
#include <chrono>
#include <cstdint>
#include <cstdio>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

alignas(64) static int32_t buf[64];

int main() {
  const long n = 100000000;
  double t0 = now();
  uint64_t x = 1;
  for (long i = 0; i < n; ++i)
    asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double ghz = 4.0 * n / (now() - t0) / 1e9;
  std::printf("clock ~ %.2f GHz\n", ghz);
  const long m = n / 4;
  int32_t* p = buf;
#define RUN(name, ins)                                                              \
  t0 = now();                                                                       \
  for (long i = 0; i < m; ++i) asm volatile(ins ::"r"(p) : CLOBBER);                \
  std::printf("%-32s %6.2f cycles\n", name, (now() - t0) / m * ghz * 1e9);
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
    "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19",  \
    "xmm20", "xmm21", "xmm22", "xmm23"
#define DP(r) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define PB(r) "vpermi2b %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define UP(r) "vpunpcklbw %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define SH(r) "vshufi64x2 $0x88, %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define TL(r) "vpternlogd $0xf8, %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define BC(r, o) "vpbroadcastd " #o "(%0), %%zmm" #r "\n\t"
#define DP8 DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7)
  RUN("8 vdpbf16ps", DP8)
  RUN("8 vpermi2b", PB(16) PB(17) PB(18) PB(19) PB(20) PB(21) PB(22) PB(23))
  RUN("8 vpunpcklbw", UP(16) UP(17) UP(18) UP(19) UP(20) UP(21) UP(22) UP(23))
  RUN("8 vshufi64x2", SH(16) SH(17) SH(18) SH(19) SH(20) SH(21) SH(22) SH(23))
  RUN("8 vpbroadcastd (memory)", BC(16, 0) BC(17, 4) BC(18, 8) BC(19, 12) BC(20, 16) BC(21, 20)
                                 BC(22, 24) BC(23, 28))
  RUN("8 vdpbf16ps + 8 vpbroadcastd", DP(0) BC(16, 0) DP(1) BC(17, 4) DP(2) BC(18, 8) DP(3)
                                      BC(19, 12) DP(4) BC(20, 16) DP(5) BC(21, 20) DP(6)
                                      BC(22, 24) DP(7) BC(23, 28))
  RUN("8 vdpbf16ps + 8 vpermi2b", DP(0) PB(16) DP(1) PB(17) DP(2) PB(18) DP(3) PB(19) DP(4)
                                  PB(20) DP(5) PB(21) DP(6) PB(22) DP(7) PB(23))
  RUN("8 vdpbf16ps + 8 vshufi64x2", DP(0) SH(16) DP(1) SH(17) DP(2) SH(18) DP(3) SH(19) DP(4)
                                    SH(20) DP(5) SH(21) DP(6) SH(22) DP(7) SH(23))
  RUN("8 vdpbf16ps + 8 vpunpcklbw", DP(0) UP(16) DP(1) UP(17) DP(2) UP(18) DP(3) UP(19) DP(4)
                                    UP(20) DP(5) UP(21) DP(6) UP(22) DP(7) UP(23))
  RUN("8 vdpbf16ps + 8 vpternlogd", DP(0) TL(16) DP(1) TL(17) DP(2) TL(18) DP(3) TL(19) DP(4)
                                    TL(20) DP(5) TL(21) DP(6) TL(22) DP(7) TL(23))
  std::printf("(%lu)\n", x);
}
