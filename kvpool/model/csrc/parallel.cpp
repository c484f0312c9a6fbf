// kvp::parallel_for's own pool, for builds without OpenMP (parallel.h says when and why).
// With OpenMP this file compiles to nothing.
//
// One job at a time: the caller posts it (a new generation), runs chunk 0 itself, and
// waits until every worker has seen the generation (so no worker can still be reading a
// job when the next is posted). Worker i runs chunk i, or nothing where the job has fewer
// chunks. An idle worker spins for kSpin before it sleeps on a condition variable;
// sleepers_ lets a caller skip the wake-up call when every worker is spinning.

#include "parallel.h"

#ifndef _OPENMP

#include <c10/util/ParallelGuard.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvp {
namespace {

thread_local bool t_in_region = false;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// How long an idle worker spins for the next job before it sleeps: long enough to stay
// awake across one model step's back-to-back products (as GOMP_SPINCOUNT=10000 keeps
// OpenMP's workers, ~100 us), short enough to leave the cores alone between steps.
constexpr auto kSpin = std::chrono::microseconds(100);

using Chunk = std::function<void(int64_t, int64_t)>;

class Pool {
 public:
  // Never destroyed: a worker may still be waiting when the process exits. A child of
  // fork() has none of the parent's workers (only the forking thread is copied): it
  // starts a pool of its own, leaving the copy's state, a held mutex perhaps, unused.
  static Pool& get() {
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { current.store(nullptr); });
      return true;
    }();
    (void)registered;
    Pool* pool = current.load(std::memory_order_acquire);
    if (pool == nullptr) {  // the first call (two at once: one pool wins)
      Pool* fresh = new Pool();
      if (current.compare_exchange_strong(pool, fresh)) pool = fresh;
      else delete fresh;  // (pool holds the winner)
    }
    return *pool;
  }

  void run(int64_t begin, int64_t end, int64_t chunk, int64_t chunks, const Chunk& f) {
    std::lock_guard<std::mutex> one_job(job_mutex_);
    grow(chunks - 1);
    f_ = &f;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    chunks_ = chunks;
    error_ = nullptr;
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1);  // seq_cst: ordered before the load of sleepers_ below
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    run_chunk(0);
    for (int spins = 0; pending_.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 4096) cpu_relax();
      else std::this_thread::yield();
    }
    f_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int64_t workers) {
    while (static_cast<int64_t>(workers_.size()) < workers) {
      const int index = static_cast<int>(workers_.size()) + 1;  // chunk 0 is the caller's
      const uint64_t seen = generation_.load();
      workers_.emplace_back([this, index, seen] { work(index, seen); });
      workers_.back().detach();
    }
  }

  void run_chunk(int64_t i) {
    const int64_t from = begin_ + i * chunk_;
    if (i >= chunks_ || from >= end_) return;
    t_in_region = true;
    try {
      c10::ParallelGuard guard(true);
      (*f_)(from, std::min(end_, from + chunk_));
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    t_in_region = false;
  }

  [[noreturn]] void work(int index, uint64_t seen) {
    for (;;) {
      uint64_t now;
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; (now = generation_.load(std::memory_order_acquire)) == seen; ++spins) {
        cpu_relax();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleepers_.fetch_add(1);  // seq_cst: a caller that missed it posted before the check
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleepers_.fetch_sub(1);
        }
      }
      seen = now;
      run_chunk(index);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  static inline std::atomic<Pool*> current{nullptr};

  // the job (written by the caller before it bumps generation_, read by workers after)
  const Chunk* f_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0, chunks_ = 0;
  std::exception_ptr error_;
  std::mutex error_mutex_;

  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};  // workers yet to see the current generation
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::mutex job_mutex_;  // one caller's job at a time
  std::vector<std::thread> workers_;
};

int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

bool in_parallel_region() { return t_in_region || at::in_parallel_region(); }

void run_parallel(int64_t begin, int64_t end, int64_t grain, const Chunk& f) {
  const int64_t range = end - begin;
  const int64_t threads = at::get_num_threads();
  if (range <= grain || range <= 1 || threads <= 1 || in_parallel_region()) {
    c10::ParallelGuard guard(true);
    f(begin, end);
    return;
  }
  // torch's OpenMP build's chunks: as many as threads (at most one per grain indices),
  // of equal length, the last shorter
  const int64_t tasks = grain > 0 ? std::min(threads, divup(range, grain)) : threads;
  const int64_t chunk = divup(range, tasks);
  Pool::get().run(begin, end, chunk, divup(range, chunk), f);
}

}  // namespace kvp

#endif  // !_OPENMP
