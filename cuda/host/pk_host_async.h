// pk_host_async.h: cp.async (cuda/csrc/pk_cp_async.cuh) on the host, with its exact ordering
// semantics made visible.
//
// Each emulated thread keeps its issued copies: `pk_cp_async16` records one and fills the
// destination with 0xFF bytes at once (NaN in every float type), `pk_cp_async_commit` closes
// them into a group, and `pk_cp_async_wait<N>` performs the oldest groups' copies (and
// zero-fills) until at most N groups are left. So the data lands at the latest moment PTX
// allows: a kernel that reads a destination before the issuing thread's wait (or, from another
// thread, before a barrier that follows it) reads NaN, and a copy issued into a buffer another
// warp is still reading poisons what that warp reads. A thread that returns with copies it never
// waited for fails the launch (pk_host_runtime.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "pk_host_sched.h"

namespace pk_host {

inline void cp_async16(void* dst, const void* src, bool valid) {
  const bool misaligned = reinterpret_cast<uintptr_t>(dst) % 16 != 0 ||
                          (valid && reinterpret_cast<uintptr_t>(src) % 16 != 0);
  if (misaligned)
    fail("pk_cp_async16: source and destination must be 16-byte aligned");
  tls_thread->async_uncommitted.push_back(AsyncCopy{dst, valid ? src : nullptr});
  std::memset(dst, 0xff, 16);
}

// The L2 prefetch has no effect on results; the emulator checks its contract (16-byte aligned,
// a multiple of 16 bytes) and reads both ends of the range, so a wild address faults here.
inline void prefetch_l2(const void* src, int bytes) {
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0 || bytes <= 0 || bytes % 16 != 0)
    fail("pk_prefetch_l2: the source must be 16-byte aligned and the size a positive multiple "
         "of 16 bytes");
  const volatile char* p = static_cast<const char*>(src);
  (void)p[0];
  (void)p[bytes - 1];
}

inline void cp_async_commit() {
  ThreadState& ts = *tls_thread;
  ts.async_groups.push_back(std::move(ts.async_uncommitted));
  ts.async_uncommitted.clear();
}

inline void cp_async_wait(int pending) {
  ThreadState& ts = *tls_thread;
  while (static_cast<int>(ts.async_groups.size()) > pending) {
    for (const AsyncCopy& c : ts.async_groups.front()) {
      if (c.src != nullptr) std::memcpy(c.dst, c.src, 16);
      else std::memset(c.dst, 0, 16);
    }
    ts.async_groups.pop_front();
  }
  preemption_point();
}

}  // namespace pk_host

inline void pk_cp_async16(void* dst, const void* src, bool valid) {
  pk_host::cp_async16(dst, src, valid);
}
inline void pk_prefetch_l2(const void* src, int bytes) { pk_host::prefetch_l2(src, bytes); }
inline void pk_cp_async_commit() { pk_host::cp_async_commit(); }
template <int N>
inline void pk_cp_async_wait() {
  pk_host::cp_async_wait(N);
}
