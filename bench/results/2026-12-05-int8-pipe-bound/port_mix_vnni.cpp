// Which 512-bit instructions share execution pipes with vpdpbusd (the int8 matmul's product), on
// one core: cycles per iteration of 8 independent vpdpbusd plus 2 (or a mix) of another
// instruction (register operands, no dependency between iterations but the accumulators'). 8.0
// cycles: the other instruction runs beside vpdpbusd; 10.0: it takes vpdpbusd's pipe. The clock
// is taken from a chain of dependent integer adds (one per cycle).
//
//   g++ -O2 -march=native port_mix_vnni.cpp -o port_mix_vnni && taskset -c 1 ./port_mix_vnni
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

#define VN(r) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define CV(r) "vcvtdq2ps %%zmm30, %%zmm" #r "\n\t"
#define MU(r) "vmulps %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define FM(r) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define AD(r) "vpaddd %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define SL(r) "vpsllvd %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define SI(r) "vpslld $3, %%zmm30, %%zmm" #r "\n\t"
#define FA(r) "vaddps %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define WS(r) "vpdpwssd %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define ML(r) "vpmulld %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define SC(r) "vscalefps %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define VN8 VN(0) VN(1) VN(2) VN(3) VN(4) VN(5) VN(6) VN(7)
  RUN("8 vpdpbusd", VN8)
  RUN("8 vpdpbusd + 2 cvt", VN8 CV(16) CV(17))
  RUN("8 vpdpbusd + 2 mul", VN8 MU(16) MU(17))
  RUN("8 vpdpbusd + 2 fma", VN8 FM(16) FM(17))
  RUN("8 vpdpbusd + 2 vaddps", VN8 FA(16) FA(17))
  RUN("8 vpdpbusd + 2 vpaddd", VN8 AD(16) AD(17))
  RUN("8 vpdpbusd + 2 vpsllvd", VN8 SL(16) SL(17))
  RUN("8 vpdpbusd + 2 vpslld", VN8 SI(16) SI(17))
  RUN("8 vpdpbusd + 2 vscalefps", VN8 SC(16) SC(17))
  RUN("8 vpdpbusd + 2 vpmulld", VN8 ML(16) ML(17))
  RUN("8 vpdpwssd", WS(0) WS(1) WS(2) WS(3) WS(4) WS(5) WS(6) WS(7))
  RUN("8 vpdpbusd + 1 cvt 1 mul 2 fma 1 add", VN8 CV(16) MU(17) FM(18) FM(19) AD(20))
  RUN("8 vpdpbusd + 1 cvt 2 fma 1 add", VN8 CV(16) FM(18) FM(19) AD(20))
  RUN("8 vpdpbusd + 1 cvt 1 fma 1 add", VN8 CV(16) FM(18) AD(20))
  RUN("4 cvt", CV(16) CV(17) CV(18) CV(19))
  RUN("4 vaddps", FA(16) FA(17) FA(18) FA(19))
  RUN("4 fma", FM(16) FM(17) FM(18) FM(19))
  RUN("4 vpaddd", AD(16) AD(17) AD(18) AD(19))

#define MW(r) "vpmaddwd %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define LW(r) "vpmullw %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define UB(r) "vpmaddubsw %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define UQ(r) "vpmuludq %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define CP(r) "vcvtph2ps %%ymm30, %%zmm" #r "\n\t"
#define SB(r) "vfmadd231ps (%0){1to16}, %%zmm31, %%zmm" #r "\n\t"
  RUN("8 vpdpbusd + 2 vpmaddwd", VN8 MW(16) MW(17))
  RUN("8 vpdpbusd + 2 vpmullw", VN8 LW(16) LW(17))
  RUN("8 vpdpbusd + 2 vpmaddubsw", VN8 UB(16) UB(17))
  RUN("8 vpdpbusd + 2 vpmuludq", VN8 UQ(16) UQ(17))
  RUN("8 vpdpbusd + 2 vcvtph2ps", VN8 CP(16) CP(17))
  RUN("4 vscalefps", SC(16) SC(17) SC(18) SC(19))
  std::printf("(%lu)\n", x);
}
