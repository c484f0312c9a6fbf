// How the native ops share work among threads: kvp::parallel_for, with or without OpenMP.
//
// Built with OpenMP (GCC and Linux clang with libomp: the usual build), these are torch's
// own at::parallel_for, at::in_parallel_region and at::get_num_threads: the ops run on
// torch's OpenMP pool (one pool in the process, one spin setting).
//
// Built without it (Apple's clang has no -fopenmp; kvpool.model.native decides),
// at::parallel_for would run every range on the calling thread. parallel_for then runs
// on a pool of its own (parallel.cpp):
// at::get_num_threads() threads, the caller one of them, the range cut into the same
// chunks as torch's OpenMP build cuts it (so each chunk computes what it computes there),
// idle workers spinning briefly before they sleep. Nested calls (a parallel_for inside a
// chunk) run on the calling thread, as OpenMP's do.
//
// Invariant either way: every index of [begin, end) is passed to f exactly once, in
// chunks of consecutive indices, each chunk under the calling thread's floating-point
// control state (float_control.h: flushing subnormals or not), and a thread it starts
// begins in the caller's own state (outside its FlushDenormals scopes); the first
// exception a chunk throws is rethrown to the caller once every chunk has ended.

#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <functional>

#include "float_control.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvp {

#ifdef _OPENMP

constexpr bool kOpenMP = true;

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const uint64_t control = float_control();
  const OwnFloatControl own;  // (threads the region starts inherit the caller's own state)
  at::parallel_for(begin, end, grain, [&](int64_t from, int64_t to) {
    const ScopedFloatControl same(control);
    f(from, to);
  });
}
inline bool in_parallel_region() { return at::in_parallel_region(); }

#else

constexpr bool kOpenMP = false;

// Whether this thread is running a chunk of kvp::parallel_for (or torch's region).
bool in_parallel_region();
// [begin, end) in at most at::get_num_threads() chunks of at least grain indices, on the
// pool's threads and the caller's (parallel.cpp).
void run_parallel(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f);

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const uint64_t control = float_control();
  const auto chunk = [&](int64_t from, int64_t to) {
    const ScopedFloatControl same(control);
    f(from, to);
  };
  const OwnFloatControl own;  // (threads the pool starts inherit the caller's own state)
  run_parallel(begin, end, grain, std::function<void(int64_t, int64_t)>(std::cref(chunk)));
}

#endif

// The number of threads a parallel_for shares its range among, outside one.
inline int64_t num_threads() { return at::get_num_threads(); }

// For its lifetime, a library called from a work item (torch's at::mm: MKL, oneDNN)
// plans for and runs on the one thread it is called on, whatever the thread count, so
// its order of sums is the same on any number of threads. Inside an OpenMP region
// omp_get_max_threads() still answers the team's size, and oneDNN's bf16 matmul plans by
// it before running the plan on its one thread (on an AMX Xeon a 130-row tile planned for
// 3 or 4 threads summed in another order than for 1 or 2: other last bits); outside an
// active region (a product of one work item) MKL's sgemm runs on MKL's own count of
// threads, in another order (K = 2,048: other bits than on one thread). Both counts set
// here are the calling thread's own (OpenMP's per task, MKL's thread-local one) and are
// restored on exit. Without OpenMP nothing: no tile goes to such a library there.
#ifdef _OPENMP
// MKL's, where torch's build has it (its x86 builds export it); null elsewhere. The C
// function (mkl_service.h maps mkl_set_num_threads_local to it): the lower-case symbol
// is the Fortran interface, which takes a pointer.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
#endif

class OneThreadForLibraries {
 public:
#ifdef _OPENMP
  OneThreadForLibraries() {
    // torch's own per-thread start first: the first torch call on a thread (an OpenMP
    // worker's first tile) sets the thread's OpenMP count to torch's, which inside at::mm
    // would undo the count set below (at::get_num_threads runs it, once per thread)
    at::get_num_threads();
    saved_omp_ = omp_get_max_threads();
    omp_set_num_threads(1);
    if (MKL_Set_Num_Threads_Local) saved_mkl_ = MKL_Set_Num_Threads_Local(1);
  }
  ~OneThreadForLibraries() {
    omp_set_num_threads(saved_omp_);
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(saved_mkl_);  // 0: MKL's global
  }
  OneThreadForLibraries(const OneThreadForLibraries&) = delete;
  OneThreadForLibraries& operator=(const OneThreadForLibraries&) = delete;

 private:
  int saved_omp_ = 1;
  int saved_mkl_ = 0;
#endif
};

}  // namespace kvp
