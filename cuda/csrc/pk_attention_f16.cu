// f16 attention kernels: decode + the tensor-core (mma) varlen kernel.
#include "pk_launch.cuh"

const char* pk_attention_f16(const PkAttnParams& p, void* stream) {
  return pk_launch_attention<__half>(p, stream);
}
