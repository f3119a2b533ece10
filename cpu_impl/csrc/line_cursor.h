// Software prefetch paced by the reads: a work item lists the byte ranges it will read, in the
// order it reads them, and requests their 64-byte lines a fixed distance ahead of its reads, a
// few lines each time it reads a few. The requests then stay in step with the arithmetic, so
// the loads of later blocks overlap it. Requesting a whole chunk (or a unit's lines) at once
// fills the core's outstanding-miss slots and stalls it instead
// (bench/results/2026-12-03-paced-prefetch).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

// The temporal locality of the requests (__builtin_prefetch's third argument): 2 is prefetcht1,
// into L2 and the caches below it; 3 (prefetcht0) also fills L1.
#ifndef PK_PREFETCH_LOCALITY
#define PK_PREFETCH_LOCALITY 2
#endif

namespace {

// Lines requested by every LineCursor while prefetch_log_on is set (tests; with several threads
// their lines interleave).
bool prefetch_log_on = false;
std::vector<uintptr_t> prefetch_log;
std::mutex prefetch_log_mutex;

class LineCursor {
 public:
  static constexpr uintptr_t LINE = 64;

  // Forgets the ranges; the cursor is at the start.
  void clear() {
    ranges_.clear();
    next_ = 0;
    line_ = 0;
  }

  // Appends the lines of [p, p + bytes) to the read order, joined to the last range when they
  // continue it (or share its last line).
  void add(const void* p, int64_t bytes) {
    if (bytes <= 0) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t first = a & ~(LINE - 1), end = (a + bytes + LINE - 1) & ~(LINE - 1);
    if (!ranges_.empty() && first >= ranges_.back().first && first <= ranges_.back().second) {
      ranges_.back().second = std::max(ranges_.back().second, end);
      return;
    }
    ranges_.emplace_back(first, end);
  }

  // Requests the next n lines of the read order (fewer at its end).
  void advance(int64_t n) {
    while (n > 0 && next_ < ranges_.size()) {
      const auto [first, end] = ranges_[next_];
      if (line_ < first) line_ = first;
      for (; n > 0 && line_ < end; --n, line_ += LINE) {
        __builtin_prefetch(reinterpret_cast<const void*>(line_), 0, PK_PREFETCH_LOCALITY);
        if (prefetch_log_on) {
          std::lock_guard<std::mutex> lock(prefetch_log_mutex);
          prefetch_log.push_back(line_);
        }
      }
      if (line_ >= end) {
        ++next_;
        line_ = 0;
      }
    }
  }

 private:
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges_;  // [first line, end), in read order
  size_t next_ = 0;                                       // the range being requested
  uintptr_t line_ = 0;                                    // its next line (0: its first)
};

}  // namespace
