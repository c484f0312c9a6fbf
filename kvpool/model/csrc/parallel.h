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
// chunks of consecutive indices; the first exception a chunk throws is rethrown to the
// caller once every chunk has ended.

#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <functional>

namespace kvp {

#ifdef _OPENMP

constexpr bool kOpenMP = true;

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
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
  run_parallel(begin, end, grain, std::function<void(int64_t, int64_t)>(std::cref(f)));
}

#endif

// The number of threads a parallel_for shares its range among, outside one.
inline int64_t num_threads() { return at::get_num_threads(); }

}  // namespace kvp
