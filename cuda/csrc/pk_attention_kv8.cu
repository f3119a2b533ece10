// Attention over an 8-bit KV cache (every query dtype): the SIMT decode and varlen kernels.
#include "pk_launch.cuh"

const char* pk_attention_kv8(const PkAttnParams& p, void* stream) {
  return pk_launch_attention<PkKv8>(p, stream);
}
