// float32 attention kernels: decode + the SIMT varlen kernel (no float32 tensor-core path).
#include "pk_launch.cuh"

template <typename T, int D>
const char* pk_launch_varlen(const PkAttnParams& p, void* stream) {
  if (p.kernel != PK_KERNEL_VARLEN_SIMT) return "varlen: float32 runs the SIMT kernel only";
  return pk_launch_one(&pk_varlen_simt_kernel<T, D>, p, stream);
}

const char* pk_attention_f32(const PkAttnParams& p, void* stream) {
  return pk_launch_attention<float>(p, stream);
}
