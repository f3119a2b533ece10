// bf16 attention kernels: decode + the tensor-core (mma) varlen kernel.
#include "pk_launch.cuh"

const char* pk_attention_bf16(const PkAttnParams& p, void* stream) {
  return pk_launch_attention<__nv_bfloat16>(p, stream);
}
