// pk_host_hooks.h: preemption points for the "random" schedule (see pk_host_sched.h).
//
// Fibers normally switch only at barriers and warp collectives, so a race between two warps
// that touch shared memory with no barrier in between can hide behind that coarse interleaving.
// Under PK_HOST_SCHEDULE=random the scheduler also preempts the running thread at a random one
// of the next few "preemption points": every __ldg, 16-bit float conversion, __expf and __logf
// (the operations every kernel here performs between barriers). Outside a random-schedule launch
// the countdown is 0 and a preemption point is one thread-local load and a branch.
#pragma once

namespace pk_host {

// Preemption points left before the running thread is preempted; 0 = never.
inline thread_local unsigned tls_preempt_countdown = 0;

// Yields the running thread (it stays ready) and re-arms the countdown (pk_host_runtime.cpp).
void preempt();

inline void preemption_point() {
  if (tls_preempt_countdown != 0 && --tls_preempt_countdown == 0) preempt();
}

}  // namespace pk_host
