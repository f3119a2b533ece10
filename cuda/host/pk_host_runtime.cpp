// pk_host_runtime.cpp: the scheduler behind pk_host_sched.h: fibers for the threads of a block,
// block barriers, warp collectives, grid launches and launch errors.
//
// One Worker per host thread owns a pool of fibers (stacks are mmap'ed with a guard page, so a
// stack overflow is a clean SIGSEGV, not silent corruption). A launch runs the grid's blocks one
// after another; for each block the scheduler makes passes over the threads in the configured
// order, switching into every ready fiber, until no fiber is ready. Fibers block in
// `syncthreads` and `warp_exchange` and are made ready again when the barrier completes. If
// fibers remain that are not finished when nothing is ready, the block is deadlocked (e.g. a
// `__syncthreads` some threads never reach while others wait in a shuffle) and the launch fails
// with a description instead of hanging.
#include "pk_host_sched.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#if !defined(__x86_64__) && !defined(PK_HOST_USE_UCONTEXT)
#define PK_HOST_USE_UCONTEXT 1
#endif
#if defined(PK_HOST_USE_UCONTEXT)
#include <ucontext.h>
#endif

// Provided by the code host_build.py generates: the addresses (in the calling host thread) of the
// buffers that back `extern __shared__` arrays. Returns how many it wrote (at most `max`).
extern "C" int pk_host_dynamic_smem_regions(void** out, int max);
// Likewise the static __shared__ arrays other files can reach (function-local statics of
// template/inline kernels) and their sizes; returns how many there are (writes at most `max`).
extern "C" int pk_host_static_smem_regions(void** out, size_t* bytes, int max);

#if !defined(PK_HOST_USE_UCONTEXT)
// pk_host_switch(save, load): saves the callee-saved registers and the SSE/x87 control words on
// the current stack, stores the stack pointer in *save, switches to stack `load` and restores
// the same from it. pk_host_fiber_start is where a fresh fiber "returns" to: it calls r13(r12).
extern "C" void pk_host_switch(void** save, void* load);
extern "C" void pk_host_fiber_start();
asm(R"(
  .text
  .globl pk_host_switch
  .hidden pk_host_switch
  .type pk_host_switch,@function
pk_host_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size pk_host_switch, .-pk_host_switch

  .globl pk_host_fiber_start
  .hidden pk_host_fiber_start
  .type pk_host_fiber_start,@function
pk_host_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size pk_host_fiber_start, .-pk_host_fiber_start
)");
#endif

namespace pk_host {
namespace {

enum class State : unsigned char { kReady, kRunning, kWaitBlock, kWaitWarp, kDone, kFailed };

struct Fiber {
  ThreadState ts{};
  State state = State::kDone;
  char* stack_base = nullptr;  // lowest mapped address (the guard page)
  size_t stack_bytes = 0;      // usable bytes above the guard page
#if defined(PK_HOST_USE_UCONTEXT)
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
  ~Fiber() {
    if (stack_base) munmap(stack_base, stack_bytes + static_cast<size_t>(getpagesize()));
  }
};

struct Warp {
  unsigned existing = 0;  // bit per lane that exists in the block
  int size = 0;
  int arrived = 0;
  int kind[2][kWarpSize];
  alignas(16) unsigned char slots[2][kWarpSize][kExchangeBytes];
};

// Thread orders (PK_HOST_SCHEDULE): lock-step passes (forward, reverse, random with preemption),
// or warp-serial: the warps in a random priority order, the first ready thread of the best warp
// runs, so one warp runs as far as it can before the next moves (priorities are drawn again
// whenever a __syncthreads completes).
enum class Order { kForward, kReverse, kRandom, kWarpSerial };

struct Worker {
  std::vector<std::unique_ptr<Fiber>> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned> order;
  Fiber* current = nullptr;
#if defined(PK_HOST_USE_UCONTEXT)
  ucontext_t sched_uc;
#else
  void* sched_sp = nullptr;
#endif
  unsigned n_threads = 0;
  unsigned n_done = 0;
  unsigned block_arrived = 0;
  bool reorder = false;  // a block barrier completed (warp-serial: draw new priorities)
  KernelBody body{nullptr, nullptr};
  bool failed = false;
  std::string error;
  Order policy = Order::kForward;
  uint64_t rng = 0;
  // Last launch error (reported through PK_LAST_LAUNCH_ERROR / cudaGetLastError).
  cudaError_t last_code = cudaSuccess;
  std::string last_error;
  std::string reported;
};

thread_local Worker tls_worker;

std::mutex g_attr_mutex;
std::unordered_map<const void*, long long> g_max_dynamic_smem;

size_t stack_bytes_setting() {
  const char* env = std::getenv("PK_HOST_STACK_KB");
  long kb = env ? std::atol(env) : 256;
  if (kb < 16) kb = 16;
  size_t page = static_cast<size_t>(getpagesize());
  return (static_cast<size_t>(kb) * 1024 + page - 1) / page * page;
}

void fiber_entry(void*);

void map_stack(Fiber& f) {
  size_t page = static_cast<size_t>(getpagesize());
  f.stack_bytes = stack_bytes_setting();
  void* mem = mmap(nullptr, f.stack_bytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    std::fprintf(stderr, "pk_host: cannot map a %zu-byte fiber stack\n", f.stack_bytes);
    std::abort();
  }
  mprotect(mem, page, PROT_NONE);  // guard page below the stack
  f.stack_base = static_cast<char*>(mem);
}

// Prepares `f` to start the kernel body from the beginning when it is next switched to.
void reset_context(Fiber& f) {
  if (!f.stack_base) map_stack(f);
  f.ts.async_uncommitted.clear();  // a failed block may have left copies in flight
  f.ts.async_groups.clear();
  char* lo = f.stack_base + getpagesize();
#if defined(PK_HOST_USE_UCONTEXT)
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = lo;
  f.uc.uc_stack.ss_size = f.stack_bytes;
  f.uc.uc_link = nullptr;
  makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_entry), 0);
#else
  uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + f.stack_bytes) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 16 - 64);
  uint32_t csr[2];
  csr[0] = __builtin_ia32_stmxcsr();
  unsigned short cw;
  asm volatile("fnstcw %0" : "=m"(cw));
  csr[1] = cw;
  std::memcpy(&sp[0], csr, 8);                                  // mxcsr, x87 control word
  sp[1] = 0;                                                    // r15
  sp[2] = 0;                                                    // r14
  sp[3] = reinterpret_cast<uint64_t>(&fiber_entry);             // r13: function to call
  sp[4] = 0;                                                    // r12: its argument
  sp[5] = 0;                                                    // rbx
  sp[6] = 0;                                                    // rbp
  sp[7] = reinterpret_cast<uint64_t>(&pk_host_fiber_start);     // return address
  reinterpret_cast<uint64_t*>(top - 16)[0] = 0;
  reinterpret_cast<uint64_t*>(top - 16)[1] = 0;
  f.sp = sp;
#endif
}

void switch_into(Worker& w, Fiber& f) {
#if defined(PK_HOST_USE_UCONTEXT)
  swapcontext(&w.sched_uc, &f.uc);
#else
  pk_host_switch(&w.sched_sp, f.sp);
#endif
}

// Gives control back to the scheduler; returns when the scheduler switches into `f` again.
void yield_to_scheduler(Worker& w, Fiber& f) {
#if defined(PK_HOST_USE_UCONTEXT)
  swapcontext(&f.uc, &w.sched_uc);
#else
  pk_host_switch(&f.sp, w.sched_sp);
#endif
}

void release_block_barrier(Worker& w) {
  w.block_arrived = 0;
  w.reorder = true;
  for (unsigned i = 0; i < w.n_threads; ++i)
    if (w.fibers[i]->state == State::kWaitBlock) w.fibers[i]->state = State::kReady;
}

void fiber_entry(void*) {
  Worker& w = tls_worker;
  w.body.call(w.body.ctx);
  Fiber& f = *w.current;
  if (!f.ts.async_uncommitted.empty() || !f.ts.async_groups.empty())
    fail("returned with cp.async copies it never waited for (pk_cp_async_wait<0>)");
  f.state = State::kDone;
  ++w.n_done;
  if (w.block_arrived > 0 && w.block_arrived + w.n_done == w.n_threads) release_block_barrier(w);
  yield_to_scheduler(w, f);
  std::abort();  // a finished fiber is never resumed
}

Fiber& running_fiber(const char* what) {
  Worker& w = tls_worker;
  if (w.current == nullptr) {
    std::fprintf(stderr, "pk_host: %s called outside a kernel launched with PK_LAUNCH\n", what);
    std::abort();
  }
  return *w.current;
}

uint64_t next_random(uint64_t& state) {  // splitmix64
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void make_order(Worker& w) {
  unsigned n = w.n_threads;
  w.order.resize(n);
  if (w.policy == Order::kWarpSerial) {
    std::vector<unsigned> warps(w.warps.size());
    for (unsigned i = 0; i < warps.size(); ++i) warps[i] = i;
    for (unsigned i = static_cast<unsigned>(warps.size()); i > 1; --i)
      std::swap(warps[i - 1], warps[next_random(w.rng) % i]);
    unsigned k = 0;
    for (unsigned wi : warps)
      for (int l = 0; l < w.warps[wi].size; ++l) w.order[k++] = wi * kWarpSize + l;
    return;
  }
  for (unsigned i = 0; i < n; ++i)
    w.order[i] = w.policy == Order::kReverse ? n - 1 - i : i;
  if (w.policy == Order::kRandom) {
    for (unsigned i = n; i > 1; --i) {
      unsigned j = static_cast<unsigned>(next_random(w.rng) % i);
      std::swap(w.order[i - 1], w.order[j]);
    }
  }
}

const char* state_name(State s) {
  switch (s) {
    case State::kWaitBlock: return "__syncthreads";
    case State::kWaitWarp: return "a warp collective";
    case State::kDone: return "returned";
    default: return "running";
  }
}

std::string describe_deadlock(const Worker& w) {
  std::string msg = "deadlock: no thread can proceed;";
  for (size_t wi = 0; wi < w.warps.size(); ++wi) {
    std::string line;
    State first = w.fibers[wi * kWarpSize]->state;
    bool uniform = true;
    for (int l = 0; l < w.warps[wi].size; ++l)
      uniform &= w.fibers[wi * kWarpSize + l]->state == first;
    if (uniform) {
      line = std::string(" warp ") + std::to_string(wi) + ": all lanes at " + state_name(first);
    } else {
      line = std::string(" warp ") + std::to_string(wi) + ": lanes";
      for (int l = 0; l < w.warps[wi].size; ++l)
        line += " " + std::to_string(l) + "@" + state_name(w.fibers[wi * kWarpSize + l]->state);
    }
    msg += line + ";";
  }
  return msg;
}

// Preemption points between two preemptions under the random schedule: 1..kPreemptSpan.
constexpr unsigned kPreemptSpan = 24;

void arm_preemption(Worker& w) {
  tls_preempt_countdown =
      w.policy == Order::kRandom ? 1 + static_cast<unsigned>(next_random(w.rng) % kPreemptSpan)
                                 : 0;
}

// Runs the current block to completion; false (with w.error set) if it failed.
bool run_block(Worker& w) {
  for (unsigned i = 0; i < w.n_threads; ++i) {
    Fiber& f = *w.fibers[i];
    reset_context(f);
    f.state = State::kReady;
    f.ts.collective_seq = 0;
  }
  for (Warp& wp : w.warps) wp.arrived = 0;
  w.n_done = 0;
  w.block_arrived = 0;
  arm_preemption(w);
  for (;;) {
    bool ran = false;
    make_order(w);
    for (unsigned k = 0; k < w.n_threads; ++k) {
      Fiber& f = *w.fibers[w.order[k]];
      if (f.state != State::kReady) continue;
      ran = true;
      f.state = State::kRunning;
      w.current = &f;
      tls_thread = &f.ts;
      switch_into(w, f);
      w.current = nullptr;
      tls_thread = nullptr;
      if (w.failed) {
        tls_preempt_countdown = 0;
        return false;
      }
      if (w.policy == Order::kWarpSerial) {  // rescan from the best priority
        if (w.reorder) make_order(w);
        w.reorder = false;
        k = static_cast<unsigned>(-1);
      }
    }
    if (!ran) break;
  }
  tls_preempt_countdown = 0;
  if (w.n_done != w.n_threads) {
    w.error = describe_deadlock(w);
    return false;
  }
  return true;
}

void set_threads(Worker& w, dim3 block) {
  unsigned n = block.x * block.y * block.z;
  while (w.fibers.size() < n) w.fibers.push_back(std::make_unique<Fiber>());
  w.n_threads = n;
  for (unsigned i = 0; i < n; ++i) {
    ThreadState& ts = w.fibers[i]->ts;
    ts.idx = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
    ts.linear = i;
    ts.warp = i / kWarpSize;
    ts.lane = i % kWarpSize;
  }
  unsigned n_warps = (n + kWarpSize - 1) / kWarpSize;
  w.warps.resize(n_warps);
  for (unsigned wi = 0; wi < n_warps; ++wi) {
    unsigned lanes = std::min<unsigned>(kWarpSize, n - wi * kWarpSize);
    w.warps[wi].size = static_cast<int>(lanes);
    w.warps[wi].existing = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  }
}

void read_schedule(Worker& w) {
  const char* order = std::getenv("PK_HOST_SCHEDULE");
  std::string o = order ? order : "forward";
  w.policy = o == "reverse"  ? Order::kReverse
             : o == "random" ? Order::kRandom
             : o == "warps"  ? Order::kWarpSerial
                             : Order::kForward;
  const char* seed = std::getenv("PK_HOST_SEED");
  w.rng = seed ? std::strtoull(seed, nullptr, 10) : 0x5eedull;
}

cudaError_t record_error(Worker& w, cudaError_t code, const std::string& message) {
  w.last_code = code;
  w.last_error = message;
  return code;
}

std::string dims(uint3 d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

cudaError_t check_config(Worker& w, const void* kernel, dim3 grid, dim3 block, size_t smem) {
  unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64)
    return record_error(w, cudaErrorInvalidConfiguration,
                        "launch: block " + dims(block) + " must have 1 to 1024 threads (z <= 64)");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 ||
      grid.x > 0x7fffffffu)
    return record_error(w, cudaErrorInvalidConfiguration,
                        "launch: grid " + dims(grid) + " must be >= 1 in every dimension, "
                        "y and z <= 65535");
  long long allowed = static_cast<long long>(kDefaultDynamicSmem);
  {
    std::lock_guard<std::mutex> lock(g_attr_mutex);
    auto it = g_max_dynamic_smem.find(kernel);
    if (it != g_max_dynamic_smem.end()) allowed = std::max(allowed, it->second);
  }
  if (static_cast<long long>(smem) > allowed)
    return record_error(w, cudaErrorInvalidValue,
                        "launch: " + std::to_string(smem) + " bytes of dynamic shared memory "
                        "exceed the kernel's limit of " + std::to_string(allowed) +
                        " (above 48 KiB needs PK_SET_MAX_DYNAMIC_SMEM first)");
  return cudaSuccess;
}

// Bytes past a launch's dynamic shared memory that are poisoned as well and must be unchanged
// when a block ends: a kernel whose layout outgrows the size planner.py gave reads NaN
// there, and a write there fails the launch (on a GPU it would touch another block's memory or
// fault).
constexpr size_t kSmemGuard = 4096;

size_t poisoned_bytes(size_t smem) { return std::min(smem + kSmemGuard, kMaxDynamicSmem); }

// Fills shared memory with 0xFF bytes (NaN in every float type) before a block runs.
void poison_shared_memory(size_t smem) {
  {
    void* regions[64];
    int n = pk_host_dynamic_smem_regions(regions, 64);
    for (int i = 0; i < n; ++i) std::memset(regions[i], 0xff, poisoned_bytes(smem));
  }
  thread_local std::vector<void*> statics;
  thread_local std::vector<size_t> sizes;
  if (statics.empty()) {
    int n = pk_host_static_smem_regions(nullptr, nullptr, 0);
    statics.resize(n);
    sizes.resize(n);
    pk_host_static_smem_regions(statics.data(), sizes.data(), n);
  }
  for (size_t i = 0; i < statics.size(); ++i) std::memset(statics[i], 0xff, sizes[i]);
}

// The first byte of the guard after `smem` bytes that a block changed, or -1.
long long guard_written(size_t smem) {
  void* regions[64];
  int n = pk_host_dynamic_smem_regions(regions, 64);
  for (int i = 0; i < n; ++i) {
    const unsigned char* bytes = static_cast<const unsigned char*>(regions[i]);
    for (size_t b = smem; b < poisoned_bytes(smem); ++b)
      if (bytes[b] != 0xff) return static_cast<long long>(b);
  }
  return -1;
}

}  // namespace

void syncthreads() {
  Worker& w = tls_worker;
  Fiber& f = running_fiber("__syncthreads");
  if (++w.block_arrived + w.n_done == w.n_threads) {
    release_block_barrier(w);
    return;
  }
  f.state = State::kWaitBlock;
  yield_to_scheduler(w, f);
}

const unsigned char* warp_exchange(const void* mine, size_t n, unsigned mask, int kind) {
  Worker& w = tls_worker;
  Fiber& f = running_fiber("a warp collective");
  ThreadState& ts = f.ts;
  Warp& wp = w.warps[ts.warp];
  if ((mask & wp.existing) != wp.existing) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "warp collective with mask 0x%08x in warp %u: the emulator "
                  "needs every existing lane (0x%08x) in the mask", mask, ts.warp, wp.existing);
    fail(buf);
  }
  unsigned b = ts.collective_seq++ & 1u;
  if (n) std::memcpy(wp.slots[b][ts.lane], mine, n);
  wp.kind[b][ts.lane] = kind;
  if (++wp.arrived == wp.size) {
    for (int l = 1; l < wp.size; ++l) {
      if (wp.kind[b][l] != wp.kind[b][0]) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "divergent warp collectives in warp %u: lane 0 in kind %d, "
                      "lane %d in kind %d (1 shuffle, 2 __syncwarp, 3 vote, 4 mma, 5 ldmatrix)", ts.warp,
                      wp.kind[b][0], l, wp.kind[b][l]);
        fail(buf);
      }
    }
    wp.arrived = 0;
    unsigned first = ts.warp * kWarpSize;
    for (int l = 0; l < wp.size; ++l) {
      Fiber& other = *w.fibers[first + l];
      if (other.state == State::kWaitWarp) other.state = State::kReady;
    }
    return &wp.slots[b][0][0];
  }
  f.state = State::kWaitWarp;
  yield_to_scheduler(w, f);
  return &wp.slots[b][0][0];
}

void preempt() {
  Worker& w = tls_worker;
  if (w.current == nullptr) {  // a conversion outside a kernel: nothing to preempt
    tls_preempt_countdown = 0;
    return;
  }
  Fiber& f = *w.current;
  arm_preemption(w);
  f.state = State::kReady;
  yield_to_scheduler(w, f);
}

unsigned warp_existing_lanes() {
  Worker& w = tls_worker;
  Fiber& f = running_fiber("a warp collective");
  return w.warps[f.ts.warp].existing;
}

void fail(const char* message) {
  Worker& w = tls_worker;
  Fiber& f = running_fiber(message);
  w.failed = true;
  w.error = std::string("thread ") + dims(f.ts.idx) + ": " + message;
  f.state = State::kFailed;
  yield_to_scheduler(w, f);
  std::abort();  // a failed fiber is never resumed
}

cudaError_t launch_grid(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes,
                        KernelBody body) {
  Worker& w = tls_worker;
  if (w.current != nullptr) {
    std::fprintf(stderr, "pk_host: a kernel launched another kernel (not supported)\n");
    std::abort();
  }
  cudaError_t err = check_config(w, kernel, grid, block, smem_bytes);
  if (err != cudaSuccess) return err;
  set_threads(w, block);
  read_schedule(w);
  w.body = body;
  w.failed = false;
  w.error.clear();
  tls_grid_dim = grid;
  tls_block_dim = block;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        tls_block_idx = uint3{x, y, z};
        poison_shared_memory(smem_bytes);
        if (!run_block(w)) {
          return record_error(w, cudaErrorLaunchFailure,
                              "kernel launch failed in block " + dims(tls_block_idx) + ": " +
                                  w.error);
        }
        const long long written = guard_written(smem_bytes);
        if (written >= 0) {
          return record_error(w, cudaErrorLaunchFailure,
                              "kernel launch failed in block " + dims(tls_block_idx) +
                                  ": wrote shared memory byte " + std::to_string(written) +
                                  ", past the launch's " + std::to_string(smem_bytes) +
                                  " bytes of dynamic shared memory");
        }
      }
    }
  }
  return cudaSuccess;
}

cudaError_t set_max_dynamic_smem(const void* kernel, long long bytes) {
  if (bytes < 0 || bytes > static_cast<long long>(kMaxDynamicSmem)) {
    return record_error(tls_worker, cudaErrorInvalidValue,
                        "PK_SET_MAX_DYNAMIC_SMEM: " + std::to_string(bytes) +
                            " bytes is over the 227 KiB a block can have");
  }
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  g_max_dynamic_smem[kernel] = bytes;
  return cudaSuccess;
}

const char* peek_last_error() {
  Worker& w = tls_worker;
  if (w.last_code == cudaSuccess) return nullptr;
  w.reported = w.last_error;
  return w.reported.c_str();
}

const char* take_last_error() {
  const char* msg = peek_last_error();
  tls_worker.last_code = cudaSuccess;
  return msg;
}

cudaError_t peek_last_error_code() { return tls_worker.last_code; }

cudaError_t take_last_error_code() {
  Worker& w = tls_worker;
  cudaError_t code = w.last_code;
  if (code != cudaSuccess) w.reported = w.last_error;
  w.last_code = cudaSuccess;
  return code;
}

}  // namespace pk_host

const char* cudaGetErrorString(cudaError_t err) {
  pk_host::Worker& w = pk_host::tls_worker;
  if (err == cudaSuccess) return "no error";
  if (!w.reported.empty()) return w.reported.c_str();
  switch (err) {
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "unspecified launch failure";
  }
}
