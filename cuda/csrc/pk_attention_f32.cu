// float32 attention kernels: decode + the SIMT varlen kernel (no float32 tensor-core path).
#include "pk_launch.cuh"

const char* pk_attention_f32(const PkAttnParams& p, void* stream) {
  return pk_launch_attention<float>(p, stream);
}
