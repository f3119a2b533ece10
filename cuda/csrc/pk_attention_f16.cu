// f16 attention kernels: decode + the tensor-core (mma) varlen kernels.
#include "pk_launch.cuh"

template <typename T, int D>
const char* pk_launch_varlen(const PkAttnParams& p, void* stream) {
  if (p.kernel != PK_KERNEL_VARLEN_MMA) return "varlen: 16-bit types run the mma kernel only";
  // The cp.async ring (stages 2; 4 or 8 warps) or the synchronous loads (stages 1, 4 warps).
  if (p.stages == 2 && p.threads == 128)
    return pk_launch_one(&pk_varlen_mma_async_kernel<T, D, 4>, p, stream);
  if (p.stages == 2 && p.threads == 256)
    return pk_launch_one(&pk_varlen_mma_async_kernel<T, D, 8>, p, stream);
  if (p.stages == 1 && p.threads == 128)
    return pk_launch_one(&pk_varlen_mma_kernel<T, D>, p, stream);
  return "varlen: the mma kernels take stages 2 with 128 or 256 threads, or stages 1 with 128";
}

const char* pk_attention_f16(const PkAttnParams& p, void* stream) {
  return pk_launch_attention<__half>(p, stream);
}
