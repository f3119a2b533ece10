// The read-ahead of a decode call: before the attention, the K/V blocks each sequence will read
// are swept in order, one load per 64-byte line, so that the kernel finds them in the CPU's caches.
// In decode every layer's K/V comes from memory, and the kernel's own scattered per-head loads are
// slower than this sequential sweep: whole blocks in order stream at ~12-16 GB/s on the 2-core
// machine, where the kernel's per-head 2 KiB runs took ~4.6 GB/s (docs/cpu.md).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "problem.h"

namespace {

// Reads one byte of every 64-byte line of each listed block of both caches (a block's extent
// through its strides) on `threads` threads when there is at least 1 MiB to read. Returns the
// sum of the bytes read (the loads must not be optimised away; tests check it). Ids outside
// [0, num_blocks) are skipped; repeats are read again.
int64_t read_blocks(const at::Tensor& key_cache, const at::Tensor& value_cache,
                    const int64_t* ids, int64_t n, int64_t threads) {
  int64_t total = 0;
  for (const at::Tensor* cache : {&key_cache, &value_cache}) {
    const int64_t esize = cache->element_size();
    int64_t extent = 1;  // elements from a block's first to its last, through the strides
    for (int d = 1; d < 4; ++d) extent += (cache->size(d) - 1) * cache->stride(d);
    const int64_t bytes = extent * esize, block_stride = cache->stride(0) * esize;
    const int64_t num_blocks = cache->size(0);
    const uint8_t* base = static_cast<const uint8_t*>(cache->data_ptr());
    int64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum) num_threads(threads) \
    if (n * bytes >= (1 << 20))
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= num_blocks) continue;
      const uint8_t* p = base + ids[i] * block_stride;
      for (int64_t off = 0; off < bytes; off += 64) sum += p[off];
    }
    total += sum;
  }
  return total;
}

// The blocks sequence by sequence, each sequence's first ceil(seq_len / block_size) entries of its
// block-table row in order (what its decode attention reads), read by read_blocks.
int64_t read_ahead(const Problem& p, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   int64_t threads) {
  std::vector<int64_t> ids;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t seq_len = std::clamp<int64_t>(p.seq_lens[s], 0, p.max_blocks * p.block_size);
    const int32_t* table = p.block_tables + s * p.max_blocks;
    for (int64_t b = 0; b < (seq_len + p.block_size - 1) / p.block_size; ++b)
      ids.push_back(table[b]);
  }
  return read_blocks(key_cache, value_cache, ids.data(), static_cast<int64_t>(ids.size()),
                     threads);
}

}  // namespace
