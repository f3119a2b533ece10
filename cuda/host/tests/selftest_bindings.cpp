// selftest_bindings.cpp: the Python module PK_SELFTEST_MODULE over the emulator's self-test
// kernels and (host build only) its 16-bit float conversions. Tensors arrive as raw addresses
// (data_ptr()). With PK_SELFTEST_DEVICE (the nvcc build) the conversions are left out: this file
// must not define the emulator's __half next to CUDA's in the same module.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "selftest_kernels.h"
#ifndef PK_SELFTEST_DEVICE
#include "pk_host_types.h"
#endif

namespace py = pybind11;

namespace {

template <typename T>
T* ptr(uintptr_t address) { return reinterpret_cast<T*>(address); }

void check(const char* err) {
  if (err != nullptr) throw std::runtime_error(err);
}

#ifndef PK_SELFTEST_DEVICE
// Element-wise conversions over n values, through the emulator's __half/__nv_bfloat16.
void float_to_half(uintptr_t src, uintptr_t dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    ptr<uint16_t>(dst)[i] = __half_as_ushort(__float2half_rn(ptr<const float>(src)[i]));
}
void half_to_float(uintptr_t src, uintptr_t dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    ptr<float>(dst)[i] = __half2float(__ushort_as_half(ptr<const uint16_t>(src)[i]));
}
void float_to_bf16(uintptr_t src, uintptr_t dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    ptr<uint16_t>(dst)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(ptr<const float>(src)[i]));
}
void bf16_to_float(uintptr_t src, uintptr_t dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    ptr<float>(dst)[i] = __bfloat162float(__ushort_as_bfloat16(ptr<const uint16_t>(src)[i]));
}

#endif

}  // namespace

PYBIND11_MODULE(PK_SELFTEST_MODULE, m) {
#ifndef PK_SELFTEST_DEVICE
  m.def("float_to_half", &float_to_half);
  m.def("half_to_float", &half_to_float);
  m.def("float_to_bf16", &float_to_bf16);
  m.def("bf16_to_float", &bf16_to_float);
#endif
  m.def("block_sum", [](uintptr_t x, uintptr_t out, int rows, int n, int threads) {
    check(st_block_sum(ptr<const float>(x), ptr<float>(out), rows, n, threads));
  });
  m.def("neighbour", [](uintptr_t x, uintptr_t out, int blocks, int threads, bool barrier,
                        bool dynamic) {
    check(st_neighbour(ptr<const float>(x), ptr<float>(out), blocks, threads, barrier, dynamic));
  });
  m.def("read_unwritten", [](uintptr_t out, int n, long long smem_bytes, bool opt_in) {
    check(st_read_unwritten(ptr<float>(out), n, smem_bytes, opt_in));
  });
  m.def("write_shared_byte", [](long long smem_bytes, long long offset) {
    check(st_write_shared_byte(smem_bytes, offset));
  });
  m.def("read_unwritten_static", [](uintptr_t out) {
    check(st_read_unwritten_static(ptr<float>(out)));
  });
  m.def("shuffles", [](uintptr_t in, uintptr_t out, uintptr_t out_d, uintptr_t out_i,
                       int threads) {
    check(st_shuffles(ptr<const float>(in), ptr<float>(out), ptr<double>(out_d), ptr<int>(out_i),
                      threads));
  });
  m.def("warp_block_sum", [](uintptr_t x, uintptr_t out, int blocks, int threads) {
    check(st_warp_block_sum(ptr<const float>(x), ptr<float>(out), blocks, threads));
  });
  m.def("mma", [](uintptr_t a, uintptr_t bt, uintptr_t c, uintptr_t d, int warps, bool bf16,
                  bool in_place) {
    check(st_mma(ptr<const uint16_t>(a), ptr<const uint16_t>(bt), ptr<const float>(c),
                 ptr<float>(d), warps, bf16, in_place));
  });
  m.def("ldmatrix", [](uintptr_t src, uintptr_t perm, uintptr_t out, int pitch, bool trans) {
    check(st_ldmatrix(ptr<const uint16_t>(src), ptr<const int>(perm), ptr<uint32_t>(out), pitch,
                      trans));
  });
  m.def("cp_async_ring", [](uintptr_t src, uintptr_t valid, uintptr_t out, int tiles,
                            int threads, int stages) {
    check(st_cp_async_ring(ptr<const void>(src), ptr<const int>(valid), ptr<void>(out), tiles,
                           threads, stages));
  });
  m.def("cp_async_wait", [](uintptr_t src, uintptr_t out) {
    check(st_cp_async_wait(ptr<const void>(src), ptr<void>(out)));
  });
  m.def("coords", [](uintptr_t out, int gx, int gy, int gz, int bx, int by, int bz) {
    check(st_coords(ptr<int>(out), gx, gy, gz, bx, by, bz));
  });
  m.def("vector", [](uintptr_t x, uintptr_t out, int threads) {
    check(st_vector(ptr<const void>(x), ptr<float>(out), threads));
  });
  m.def("faulty", [](const std::string& which, uintptr_t out, uintptr_t x) {
    check(st_faulty(which.c_str(), ptr<float>(out), ptr<const float>(x)));
  });
}
