// The calling thread's floating-point control state, and scopes that change it.
//
// kvpool's native float ops run with subnormal floats flushed to zero (FlushDenormals,
// which bindings.cpp puts around each such op): a subnormal operand counts as zero and a
// subnormal result becomes zero (x86: MXCSR's DAZ and FTZ, or FTZ alone where DAZ would
// break half-float conversions, flush_denormals_control; aarch64: FPCR's FZ). Why: an
// x86 core takes a microcode assist, ~100 cycles, for each vector operation with a
// subnormal operand or result, and attention makes them by the thousand where scores
// spread wide: a softmax weight near exp(-87) times a value of 0.01 is subnormal, and a
// running sum of such terms stays so until the row's largest weight comes (a 1B-class
// file's prefill spent a third of its time so: docs/performance.md, thirty-ninth
// session). What is lost is below 2^-126 (~1.2e-38) in size, next to terms of order one.
//
// kvp::parallel_for runs each chunk under the state of the thread that called it
// (ScopedFloatControl): OpenMP's workers keep their own state otherwise, so a chunk
// would compute differently by which thread took it. It starts its region in the
// caller's own state (OwnFloatControl): threads the region creates inherit that, never a
// scope's, so no thread flushes outside kvpool's ops.
//
// Invariant: a scope restores the thread's state as it found it (x86: its sticky
// exception flags are left as the work set them).

#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvp {

#if defined(__x86_64__)
// MXCSR without its sticky exception flags (bits 0-5): DAZ (bit 6), the exception masks,
// the rounding mode and FTZ (bit 15).
constexpr uint64_t kFlushToZero = 0x8000, kDenormalsAreZero = 0x0040;
inline uint64_t float_control() { return _mm_getcsr() & ~0x3Fu; }
inline void set_float_control(uint64_t control) {
  _mm_setcsr(static_cast<unsigned>((_mm_getcsr() & 0x3Fu) | (control & ~0x3Fu)));
}

// Whether this CPU's VCVTPH2PS (F16C) reads a subnormal half float as zero under DAZ. No
// x86 core does (DAZ leaves that conversion's inputs alone: a K-quant block's fp16 scale
// d is often subnormal, ~1e-5, and the kernels read it so); qemu's emulated x86 (7.2's
// TCG, as an amd64 container on an ARM Mac may run) does, and every such block's
// products would come out as zeros. (The conversion in asm, between the MXCSR writes:
// the compiler neither folds it nor moves it past them.)
__attribute__((target("f16c"))) inline bool half_inputs_flushed_under_daz() {
  const uint64_t saved = float_control();
  set_float_control(saved | kFlushToZero | kDenormalsAreZero);
  __m128i half = _mm_cvtsi32_si128(1);  // the smallest subnormal half, 2^-24
  __m128 single;
  __asm__ volatile("vcvtph2ps %1, %0" : "=x"(single) : "x"(half));
  set_float_control(saved);
  return _mm_cvtss_f32(single) == 0.f;
}

// The MXCSR bits kvpool's ops flush under: FTZ and DAZ, or FTZ alone on a CPU whose
// half-float conversions DAZ would break (half_inputs_flushed_under_daz; asked once).
inline uint64_t flush_denormals_control() {
  static const uint64_t control =
      __builtin_cpu_supports("f16c") && half_inputs_flushed_under_daz()
          ? kFlushToZero
          : kFlushToZero | kDenormalsAreZero;
  return control;
}
#elif defined(__aarch64__)
inline uint64_t flush_denormals_control() { return uint64_t{1} << 24; }  // FPCR.FZ
inline uint64_t float_control() {
  uint64_t fpcr;
  __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
  return fpcr;
}
inline void set_float_control(uint64_t control) {
  __asm__ volatile("msr fpcr, %0" : : "r"(control));
}
#else
inline uint64_t flush_denormals_control() { return 0; }  // (no such control known here)
inline uint64_t float_control() { return 0; }
inline void set_float_control(uint64_t) {}
#endif

// Whether this thread flushes subnormal floats to zero now.
inline bool flushing_denormals() {
  const uint64_t control = flush_denormals_control();
  return control != 0 && (float_control() & control) == control;
}

// For its lifetime, the thread computes under `control` (float_control's form).
class ScopedFloatControl {
 public:
  explicit ScopedFloatControl(uint64_t control) : saved_(float_control()) {
    if (control != saved_) set_float_control(control);
  }
  ~ScopedFloatControl() {
    if (float_control() != saved_) set_float_control(saved_);
  }
  ScopedFloatControl(const ScopedFloatControl&) = delete;
  ScopedFloatControl& operator=(const ScopedFloatControl&) = delete;

 private:
  uint64_t saved_;
};

// The calling thread's FlushDenormals scopes open now, and its state before the
// outermost of them (its own, as its code set it).
struct FlushScopes {
  int depth = 0;
  uint64_t own = 0;
};
inline FlushScopes& flush_scopes() {
  thread_local FlushScopes scopes;
  return scopes;
}

// For its lifetime, subnormal floats are flushed to zero on this thread (and, through
// parallel_for, in the chunks other threads take from it).
class FlushDenormals {
 public:
  FlushDenormals() : scope_(enter()) {}
  ~FlushDenormals() { --flush_scopes().depth; }

 private:
  static uint64_t enter() {
    FlushScopes& scopes = flush_scopes();
    const uint64_t now = float_control();
    if (scopes.depth++ == 0) scopes.own = now;
    return now | flush_denormals_control();
  }
  ScopedFloatControl scope_;
};

// For its lifetime, the thread is back in its own state (outside its FlushDenormals
// scopes; as it is where none is open): a thread starts with its creator's state, and a
// parallel region may start its pool's threads, which outlive the scope (OpenMP's
// workers) and would flush in all their later work, torch's own ops' included.
class OwnFloatControl : public ScopedFloatControl {
 public:
  OwnFloatControl() : ScopedFloatControl(own()) {}

 private:
  static uint64_t own() {
    const FlushScopes& scopes = flush_scopes();
    return scopes.depth > 0 ? scopes.own : float_control();
  }
};

}  // namespace kvp
