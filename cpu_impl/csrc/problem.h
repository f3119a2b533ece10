// The attention problem of one call, flattened to sizes, strides and pointers (the fields of
// paged_kernels.abi.AttentionProblem), its content check, and the work items it splits into.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

struct Problem {
  int64_t num_tokens, num_heads, head_size, num_kv_heads, block_size, num_blocks;
  int64_t num_seqs, max_blocks;
  int64_t q_s0, q_s1, o_s0, o_s1;           // strides of query/out (tokens, heads)
  int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;  // strides of the caches (block, head, slot)
  const int32_t* block_tables;              // contiguous [num_seqs, max_blocks]
  const int32_t* seq_lens;
  const int32_t* cu_seqlens_q;              // nullptr in decode
  const float* alibi;                       // nullptr when absent
  float* lse;                               // nullptr when absent; contiguous [tokens, heads]
  const float* k_scale;                     // [num_kv_heads] for an 8-bit cache, else nullptr
  const float* v_scale;                     // as k_scale
  float scale, soft_cap;                    // soft_cap <= 0: none
  int64_t window;                           // <= 0: none
  int64_t prefetch_lines = 0;               // the paced prefetch's distance (kernel.h); 0: off
  int group() const { return static_cast<int>(num_heads / num_kv_heads); }
};

struct Item {
  int32_t seq, kv_head, kv_heads;  // KV heads [kv_head, kv_head + kv_heads)
  int64_t row0, rows;     // query rows [row0, row0 + rows) of the sequence (token index = q0 + row)
  int64_t q0, q_len, seq_len;
};

// Clamped query range and length of sequence s (memory safety on unchecked contents).
void seq_extent(const Problem& p, int64_t s, int64_t& q0, int64_t& q_len, int64_t& seq_len) {
  if (p.cu_seqlens_q == nullptr) {
    q0 = s;
    q_len = 1;
  } else {
    q0 = std::clamp<int64_t>(p.cu_seqlens_q[s], 0, p.num_tokens);
    int64_t q1 = std::clamp<int64_t>(p.cu_seqlens_q[s + 1], q0, p.num_tokens);
    q_len = q1 - q0;
  }
  seq_len = std::clamp<int64_t>(p.seq_lens[s], 0, p.max_blocks * p.block_size);
}

// The ABI's content rules (paged_kernels.abi.check_attention_contents), as one cheap scan.
bool contents_valid(const Problem& p) {
  const int64_t capacity = p.max_blocks * p.block_size;
  if (p.cu_seqlens_q != nullptr &&
      (p.cu_seqlens_q[0] != 0 || p.cu_seqlens_q[p.num_seqs] != p.num_tokens))
    return false;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t seq_len = p.seq_lens[s];
    if (seq_len < 0 || seq_len > capacity) return false;
    if (p.cu_seqlens_q != nullptr) {
      const int64_t q_len = int64_t{p.cu_seqlens_q[s + 1]} - p.cu_seqlens_q[s];
      if (q_len < 0 || q_len > seq_len) return false;
    } else if (seq_len < 1) {
      return false;
    }
    const int32_t* table = p.block_tables + s * p.max_blocks;
    for (int64_t b = 0; b < (seq_len + p.block_size - 1) / p.block_size; ++b)
      if (table[b] < 0 || table[b] >= p.num_blocks) return false;
  }
  return true;
}

// KV heads per item: all of them in a decode batch of at least MIN_SEQS_ALL_HEADS sequences (each
// block's K and V are then read as whole [num_kv_heads, block_size, head_size] runs, and there are
// still enough items for the threads); one otherwise (prefill tiles, small decode batches). The
// choice depends on the problem only, never on the thread count.
constexpr int64_t MIN_SEQS_ALL_HEADS = 4;

int64_t heads_per_item(const Problem& p) {
  return p.cu_seqlens_q == nullptr && p.num_seqs >= MIN_SEQS_ALL_HEADS ? p.num_kv_heads : 1;
}

std::vector<Item> plan(const Problem& p, int64_t tile) {
  std::vector<Item> items;
  const int64_t nh = heads_per_item(p);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    int64_t q0, q_len, seq_len;
    seq_extent(p, s, q0, q_len, seq_len);
    for (int64_t r = 0; r < q_len; r += tile)
      for (int64_t h = 0; h < p.num_kv_heads; h += nh)
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h),
                         static_cast<int32_t>(nh), r, std::min(tile, q_len - r), q0, q_len,
                         seq_len});
  }
  // Longest causal tiles first, so the dynamic schedule ends balanced.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.seq_len - a.q_len + a.row0 + a.rows > b.seq_len - b.q_len + b.row0 + b.rows;
  });
  return items;
}

}  // namespace
