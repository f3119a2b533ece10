// selftest_kernels.h: launchers of the emulator's self-test kernels (selftest_kernels.cu); each
// returns nullptr on success or the launch error message.
#pragma once
#include <cstdint>

const char* st_block_sum(const float* x, float* out, int rows, int n, int threads);
const char* st_neighbour(const float* x, float* out, int blocks, int threads, int barrier,
                         int dynamic);
const char* st_read_unwritten(float* out, int n, long long smem_bytes, int opt_in);
const char* st_write_shared_byte(long long smem_bytes, long long offset);
const char* st_shuffles(const float* in, float* out, double* out_d, int* out_i, int threads);
const char* st_warp_block_sum(const float* x, float* out, int blocks, int threads);
const char* st_mma(const uint16_t* a, const uint16_t* bt, const float* c, float* d, int warps,
                   int bf16, int in_place);
const char* st_ldmatrix(const uint16_t* src, const int* perm, uint32_t* out, int pitch,
                        int trans);
const char* st_cp_async_ring(const void* src, const int* valid, void* out, int tiles,
                             int threads, int stages);
const char* st_cp_async_wait(const void* src, void* out);
const char* st_coords(int* out, int gx, int gy, int gz, int bx, int by, int bz);
const char* st_vector(const void* x, float* out, int threads);
const char* st_faulty(const char* which, float* out, const float* x);
const char* st_read_unwritten_static(float* out);
