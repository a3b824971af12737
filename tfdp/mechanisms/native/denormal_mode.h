// The calling thread's handling of subnormal numbers, for the workers of
// tfdp's compiled ops (embedding_rows.cc, row_squares.cc): TensorFlow's
// reference ops flush subnormal results to zero or not as the thread that
// runs them does, so every worker of a compiled op runs under its caller's
// flush-to-zero and denormals-are-zero bits (x86-64; elsewhere the workers
// keep their own mode, and the ops' self-checks at load refuse them if that
// changes a value).

#ifndef TFDP_NATIVE_DENORMAL_MODE_H_
#define TFDP_NATIVE_DENORMAL_MODE_H_

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace tfdp_native {

// This thread's floating-point control word (x86: MXCSR; elsewhere 0).
inline unsigned ControlWord() {
#if defined(__x86_64__)
  return _mm_getcsr();
#else
  return 0;
#endif
}

// While alive, this thread flushes subnormal results to zero (FTZ) and
// reads subnormal inputs as zero (DAZ) exactly as `caller` does.
class CallersDenormalMode {
 public:
  explicit CallersDenormalMode(unsigned caller) : saved_(ControlWord()) {
#if defined(__x86_64__)
    _mm_setcsr((saved_ & ~kBits) | (caller & kBits));
#endif
  }
  ~CallersDenormalMode() {
#if defined(__x86_64__)
    _mm_setcsr(saved_);
#endif
  }

 private:
  static constexpr unsigned kBits = 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
  unsigned saved_;
};

}  // namespace tfdp_native

#endif  // TFDP_NATIVE_DENORMAL_MODE_H_
