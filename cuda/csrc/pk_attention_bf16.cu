// bf16 attention kernels: decode + the tensor-core (mma) varlen kernels.
#include "pk_launch.cuh"

template <typename T, int D>
const char* pk_launch_varlen(const PkAttnParams& p, void* stream) {
  if (p.kernel != PK_KERNEL_VARLEN_MMA) return "varlen: 16-bit types run the mma kernel only";
  switch (p.stages) {  // the cp.async ring (2) or the synchronous loads (1)
    case 2: return pk_launch_one(&pk_varlen_mma_async_kernel<T, D>, p, stream);
    case 1: return pk_launch_one(&pk_varlen_mma_kernel<T, D>, p, stream);
    default: return "varlen: the mma kernel takes stages 1 or 2";
  }
}

const char* pk_attention_bf16(const PkAttnParams& p, void* stream) {
  return pk_launch_attention<__nv_bfloat16>(p, stream);
}
