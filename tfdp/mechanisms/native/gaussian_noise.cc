// tfdp's Gaussian noise as one compiled TensorFlow op: the same values, bit
// for bit, as the graph generator of tfdp/mechanisms/gaussian.py (`_Draw`),
// which stays the reference and the fallback.
//
// The graph draws, for count = prod(shape) and half = (count + 1) / 2:
//   words = StatelessRandomUniformFullIntV2([2, half], uint32, Philox)
//   w0 = words[0], w1 = words[1]                      (pair i: words i, half + i)
//   E = 32 ln 2 - log(double(w0))                     (float64)
//   angle = (work(w1) + 0.5) * work(2 pi 2^-32)       (work: float32, or float64)
//   radius = sqrt(work(E)) * factor                   (factor = work(sqrt 2) * stddev)
//   z = concat(radius cos(angle), radius sin(angle))[:count], cast to dtype
// and, when some w0 is 0 (probability 2^-32 a pair), refines E in more rounds.
// This op reports that event (`deep`) and tfdp then takes the graph's result,
// so the rounds need no copy here.
//
// Exactness rests on three facts of TensorFlow's CPU kernels (the tests
// compare every dtype and size class with the graph):
//  * Philox4x32-10 words: word j of a draw is block (counter + j / 4)[j % 4],
//    the key and counter scrambled from the seed by one Philox block.
//  * The element-wise ops run Eigen's packet functions on whole packets (4
//    doubles, 8 floats: TensorFlow's wheel is built for AVX without FMA) and
//    the C library's scalar function on the last size % packet elements of
//    the tensor. The float64 log and the float32 sin and cos are Eigen's
//    polynomial algorithms, written out below operation by operation (a
//    multiply-add is a multiply then an add); float64 sin and cos are scalar.
//  * Casts round to nearest even; sqrt, +, -, *, / are IEEE operations.
// Built with -ffp-contract=off and without -ffast-math, so the compiler keeps
// every rounding; the hot loops are compiled for AVX-512, AVX2 and a portable
// baseline and picked at load time.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_util.h"
#include "tensorflow/core/util/work_sharder.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define TFDP_X86 1
#define TFDP_TARGET(isa) __attribute__((target(isa)))
#endif
#define TFDP_INLINE inline __attribute__((always_inline))

namespace tfdp_noise {

using std::int32_t;
using std::int64_t;
using std::uint32_t;
using std::uint64_t;

// -- Philox4x32-10 ------------------------------------------------------------

struct PhiloxKey {
  uint32_t k0, k1;
  uint64_t counter_lo, counter_hi;  // the 128-bit counter of block 0
};

constexpr uint32_t kMulA = 0xD2511F53u, kMulB = 0xCD9E8D57u;
constexpr uint32_t kWeylA = 0x9E3779B9u, kWeylB = 0xBB67AE85u;

TFDP_INLINE void PhiloxBlock(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t pa = uint64_t(kMulA) * c[0];
    const uint64_t pb = uint64_t(kMulB) * c[2];
    const uint32_t n0 = uint32_t(pb >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = uint32_t(pa >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = uint32_t(pb);
    c[2] = n2;
    c[3] = uint32_t(pa);
    k0 += kWeylA;
    k1 += kWeylB;
  }
}

// TensorFlow's seed scrambling (stateless ops, "auto_select" on CPU: Philox).
PhiloxKey KeyFromSeed(int64_t seed0, int64_t seed1) {
  const uint64_t s0 = uint64_t(seed0), s1 = uint64_t(seed1);
  uint32_t c[4] = {uint32_t(s0), uint32_t(s0 >> 32), uint32_t(s1), uint32_t(s1 >> 32)};
  PhiloxBlock(c, 0x3EC8F720u, 0x02461E29u);
  PhiloxKey key;
  key.k0 = c[0];
  key.k1 = c[1];
  key.counter_lo = 0;
  key.counter_hi = uint64_t(c[2]) | (uint64_t(c[3]) << 32);
  return key;
}

constexpr int kLanes = 16;  // Philox blocks computed side by side

// Words [4 first_block, 4 (first_block + kLanes groups)) of the stream: the
// portable version (the compiler vectorizes what it can).
TFDP_INLINE void PhiloxWordsLoop(const PhiloxKey& key, uint64_t first_block, int groups,
                                     uint32_t* out) {
  for (int g = 0; g < groups; ++g) {
    uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const uint64_t lo = key.counter_lo + first_block + uint64_t(g * kLanes + l);
      const uint64_t hi = key.counter_hi + (lo < key.counter_lo ? 1 : 0);
      c0[l] = uint32_t(lo);
      c1[l] = uint32_t(lo >> 32);
      c2[l] = uint32_t(hi);
      c3[l] = uint32_t(hi >> 32);
    }
    uint32_t k0 = key.k0, k1 = key.k1;
    for (int round = 0; round < 10; ++round) {
      for (int l = 0; l < kLanes; ++l) {
        const uint64_t pa = uint64_t(kMulA) * c0[l];
        const uint64_t pb = uint64_t(kMulB) * c2[l];
        const uint32_t n0 = uint32_t(pb >> 32) ^ c1[l] ^ k0;
        const uint32_t n2 = uint32_t(pa >> 32) ^ c3[l] ^ k1;
        c0[l] = n0;
        c1[l] = uint32_t(pb);
        c2[l] = n2;
        c3[l] = uint32_t(pa);
      }
      k0 += kWeylA;
      k1 += kWeylB;
    }
    uint32_t* o = out + 4 * kLanes * g;
    for (int l = 0; l < kLanes; ++l) {
      o[4 * l + 0] = c0[l];
      o[4 * l + 1] = c1[l];
      o[4 * l + 2] = c2[l];
      o[4 * l + 3] = c3[l];
    }
  }
}

#ifdef TFDP_X86
// The same words, 16 blocks a step in AVX-512 registers: each 64-bit lane
// holds one block's 32-bit word in its low half (the multiply reads only
// that half, so the high halves may hold anything).
TFDP_TARGET("avx512f")
TFDP_INLINE void PhiloxRounds512(__m512i& c0, __m512i& c1, __m512i& c2, __m512i& c3,
                                 uint32_t key0, uint32_t key1) {
  const __m512i mul_a = _mm512_set1_epi64(kMulA), mul_b = _mm512_set1_epi64(kMulB);
  const __m512i weyl_a = _mm512_set1_epi64(kWeylA), weyl_b = _mm512_set1_epi64(kWeylB);
  __m512i k0 = _mm512_set1_epi64(key0), k1 = _mm512_set1_epi64(key1);
  for (int round = 0; round < 10; ++round) {
    const __m512i pa = _mm512_mul_epu32(c0, mul_a);
    const __m512i pb = _mm512_mul_epu32(c2, mul_b);
    c0 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(pb, 32), c1), k0);
    c1 = pb;
    c2 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(pa, 32), c3), k1);
    c3 = pa;
    k0 = _mm512_add_epi32(k0, weyl_a);  // the low halves wrap as uint32 does
    k1 = _mm512_add_epi32(k1, weyl_b);
  }
}

TFDP_TARGET("avx512f")
void PhiloxWordsAvx512(const PhiloxKey& key, uint64_t first_block, int groups, uint32_t* out) {
  const __m512i base_lo = _mm512_set1_epi64(int64_t(key.counter_lo));
  const __m512i base_hi = _mm512_set1_epi64(int64_t(key.counter_hi));
  const __m512i steps = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i one = _mm512_set1_epi64(1);
  // The low halves of two registers' 64-bit lanes, in order: 16 words.
  const __m512i low_halves = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  for (int g = 0; g < groups; ++g) {
    // Blocks b = first_block + 16 g + (0..7 | 8..15): the 128-bit counter base + b.
    const __m512i start = _mm512_set1_epi64(int64_t(first_block + uint64_t(16 * g)));
    const __m512i lo_a = _mm512_add_epi64(base_lo, _mm512_add_epi64(start, steps));
    const __m512i lo_b = _mm512_add_epi64(lo_a, _mm512_set1_epi64(8));
    const __m512i hi_a = _mm512_mask_add_epi64(base_hi, _mm512_cmplt_epu64_mask(lo_a, base_lo),
                                               base_hi, one);
    const __m512i hi_b = _mm512_mask_add_epi64(base_hi, _mm512_cmplt_epu64_mask(lo_b, base_lo),
                                               base_hi, one);
    __m512i a0 = lo_a, a1 = _mm512_srli_epi64(lo_a, 32), a2 = hi_a, a3 = _mm512_srli_epi64(hi_a, 32);
    __m512i b0 = lo_b, b1 = _mm512_srli_epi64(lo_b, 32), b2 = hi_b, b3 = _mm512_srli_epi64(hi_b, 32);
    PhiloxRounds512(a0, a1, a2, a3, key.k0, key.k1);
    PhiloxRounds512(b0, b1, b2, b3, key.k0, key.k1);
    const __m512i c0 = _mm512_permutex2var_epi32(a0, low_halves, b0);  // word 0 of blocks 0..15
    const __m512i c1 = _mm512_permutex2var_epi32(a1, low_halves, b1);
    const __m512i c2 = _mm512_permutex2var_epi32(a2, low_halves, b2);
    const __m512i c3 = _mm512_permutex2var_epi32(a3, low_halves, b3);
    // Transpose to words in stream order: block b's 4 words at 4 b.
    const __m512i t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
    const __m512i t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
    const __m512i u0 = _mm512_unpacklo_epi64(t0, t2);  // blocks 0, 4, 8, 12
    const __m512i u1 = _mm512_unpackhi_epi64(t0, t2);  // blocks 1, 5, 9, 13
    const __m512i u2 = _mm512_unpacklo_epi64(t1, t3);  // blocks 2, 6, 10, 14
    const __m512i u3 = _mm512_unpackhi_epi64(t1, t3);  // blocks 3, 7, 11, 15
    const __m512i v0 = _mm512_shuffle_i32x4(u0, u1, 0x44);  // 0, 4, 1, 5
    const __m512i v1 = _mm512_shuffle_i32x4(u2, u3, 0x44);  // 2, 6, 3, 7
    const __m512i v2 = _mm512_shuffle_i32x4(u0, u1, 0xEE);  // 8, 12, 9, 13
    const __m512i v3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);  // 10, 14, 11, 15
    uint32_t* o = out + 64 * g;
    _mm512_storeu_si512(o, _mm512_shuffle_i32x4(v0, v1, 0x88));
    _mm512_storeu_si512(o + 16, _mm512_shuffle_i32x4(v0, v1, 0xDD));
    _mm512_storeu_si512(o + 32, _mm512_shuffle_i32x4(v2, v3, 0x88));
    _mm512_storeu_si512(o + 48, _mm512_shuffle_i32x4(v2, v3, 0xDD));
  }
}
#endif  // TFDP_X86

// -- Eigen's float64 log (Cephes), for x >= 1 -----------------------------------

TFDP_INLINE double EigenLog(double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, 8);
  // frexp: value = m 2^e with m in [0.5, 1) (value is a normal number >= 1).
  const uint64_t biased = bits >> 52;
  const uint64_t m_bits = (bits & 0x000FFFFFFFFFFFFFull) | 0x3FE0000000000000ull;
  double m;
  std::memcpy(&m, &m_bits, 8);
  const uint64_t e_bits = biased | 0x4330000000000000ull;  // 2^52 + biased, exactly
  double e;
  std::memcpy(&e, &e_bits, 8);
  e = e - (4503599627370496.0 + 1022.0);
  const bool below = m < 0.70710678118654752440E0;
  double x = m - 1.0;
  e = e - (below ? 1.0 : 0.0);
  x = x + (below ? m : 0.0);
  const double x2 = x * x;
  const double x3 = x2 * x;
  double y = 1.01875663804580931796E-4 * x + 4.97494994976747001425E-1;
  double y1 = 1.44989225341610930846E1 * x + 1.79368678507819816313E1;
  y = y * x + 4.70579119878881725854E0;
  y1 = y1 * x + 7.70838733755885391666E0;
  double num = y * x3 + y1;
  y = 1.0 * x + 1.12873587189167450590E1;
  y1 = 8.29875266912776603211E1 * x + 7.11544750618563894466E1;
  y = y * x + 4.52279145837532221105E1;
  y1 = y1 * x + 2.31251620126765340583E1;
  double den = y * x3 + y1;
  num = num * x3;
  y = num / den;
  y = -0.5 * x2 + y;
  x = x + y;
  return e * 0.693147180559945309417232121458176568 + x;
}

// -- Eigen's float32 sin and cos (no-FMA reduction), for |x| < 18838 ------------

TFDP_INLINE void EigenSinCos(float angle, float* sin_out, float* cos_out) {
  const float x0 = std::fabs(angle);
  float y = x0 * 0.636619746685028076171875f;
  const float y_round = y + 12582912.0f;
  int32_t y_int;
  std::memcpy(&y_int, &y_round, 4);
  y = y_round - 12582912.0f;
  float x = y * -1.5703125f + x0;
  x = y * -0.000483989715576171875f + x;
  x = y * 1.62865035235881805419921875e-07f + x;
  x = y * 5.5644315544167710640977020375430583953857421875e-11f + x;
  const float x2 = x * x;
  float p1 = 2.4372266125283204019069671630859375e-05f;
  p1 = p1 * x2 + -0.00138865201734006404876708984375f;
  p1 = p1 * x2 + 0.041666619479656219482421875f;
  p1 = p1 * x2 + -0.5f;
  p1 = p1 * x2 + 1.0f;
  float p2 = -0.0001959234114083702898469196984621021329076029360294342041015625f;
  p2 = p2 * x2 + 0.0083326873655616851693794799871284340042620897293090820312500000f;
  p2 = p2 * x2 + -0.1666666203982298255503735617821803316473960876464843750000000000f;
  p2 = p2 * x2;
  p2 = p2 * x + x;
  const bool even = (y_int & 1) == 0;
  uint32_t angle_bits, sin_bits, cos_bits;
  std::memcpy(&angle_bits, &angle, 4);
  const float s = even ? p2 : p1, c = even ? p1 : p2;
  std::memcpy(&sin_bits, &s, 4);
  std::memcpy(&cos_bits, &c, 4);
  sin_bits ^= (angle_bits ^ (uint32_t(y_int) << 30)) & 0x80000000u;
  cos_bits ^= (uint32_t(y_int + 1) << 30) & 0x80000000u;
  std::memcpy(sin_out, &sin_bits, 4);
  std::memcpy(cos_out, &cos_bits, 4);
}

// -- the hot loops, one copy an instruction set ----------------------------------

constexpr double kLnCells = 22.18070977791825;           // 32 ln 2, as Python rounds it
constexpr double kAnglePerWord = 1.4629180792671596e-09;  // 2 pi 2^-32

// Float32 work: pairs' radius * cos and radius * sin (Eigen's functions).
TFDP_INLINE void RadiusAngle32Loop(const uint32_t* w0, const uint32_t* w1, int64_t n,
                                   float factor, float* rc, float* rs, uint32_t* zero_seen) {
  uint32_t zero = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = kLnCells - EigenLog(double(w0[i]));
    zero |= (w0[i] == 0u);
    const float radius = std::sqrt(float(e)) * factor;
    const float angle = (float(w1[i]) + 0.5f) * float(kAnglePerWord);
    float s, c;
    EigenSinCos(angle, &s, &c);
    rc[i] = radius * c;
    rs[i] = radius * s;
  }
  *zero_seen |= zero;
}

// Float64 work: pairs' radii (Eigen's log).
TFDP_INLINE void Radius64Loop(const uint32_t* w0, int64_t n, double factor, double* radius,
                              uint32_t* zero_seen) {
  uint32_t zero = 0;
  for (int64_t i = 0; i < n; ++i) {
    zero |= (w0[i] == 0u);
    radius[i] = std::sqrt(kLnCells - EigenLog(double(w0[i]))) * factor;
  }
  *zero_seen |= zero;
}

// Float32 results out: `values`, or `sum` + `values` (`sum` may be `out`).
TFDP_INLINE void Store32Loop(const float* values, int64_t n, const float* sum, float* out) {
  if (sum == nullptr) {
    std::memcpy(out, values, sizeof(float) * n);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = sum[i] + values[i];
  }
}

// The same source compiled for each instruction set: the vector width
// changes nothing an IEEE operation returns.
struct Isa {
  const char* name;
  void (*philox)(const PhiloxKey&, uint64_t, int, uint32_t*);
  void (*radius_angle32)(const uint32_t*, const uint32_t*, int64_t, float, float*, float*,
                         uint32_t*);
  void (*radius64)(const uint32_t*, int64_t, double, double*, uint32_t*);
  void (*store32)(const float*, int64_t, const float*, float*);
};

#define TFDP_LOOPS(SUFFIX, ATTRIBUTE)                                                         \
  ATTRIBUTE void RadiusAngle32##SUFFIX(const uint32_t* w0, const uint32_t* w1, int64_t n,    \
                                       float factor, float* rc, float* rs, uint32_t* zero) { \
    RadiusAngle32Loop(w0, w1, n, factor, rc, rs, zero);                                      \
  }                                                                                          \
  ATTRIBUTE void Radius64##SUFFIX(const uint32_t* w0, int64_t n, double factor,              \
                                  double* radius, uint32_t* zero) {                          \
    Radius64Loop(w0, n, factor, radius, zero);                                               \
  }                                                                                          \
  ATTRIBUTE void Store32##SUFFIX(const float* values, int64_t n, const float* sum,           \
                                 float* out) {                                               \
    Store32Loop(values, n, sum, out);                                                        \
  }

void PhiloxWordsPortable(const PhiloxKey& key, uint64_t first, int groups, uint32_t* out) {
  PhiloxWordsLoop(key, first, groups, out);
}
TFDP_LOOPS(Portable, )
const Isa kPortable = {"portable", PhiloxWordsPortable, RadiusAngle32Portable, Radius64Portable,
                       Store32Portable};

#ifdef TFDP_X86
TFDP_TARGET("avx2")
void PhiloxWordsAvx2(const PhiloxKey& key, uint64_t first, int groups, uint32_t* out) {
  PhiloxWordsLoop(key, first, groups, out);
}
TFDP_LOOPS(Avx2, TFDP_TARGET("avx2"))
TFDP_LOOPS(Avx512, TFDP_TARGET("avx512f"))
const Isa kAvx2 = {"avx2", PhiloxWordsAvx2, RadiusAngle32Avx2, Radius64Avx2, Store32Avx2};
const Isa kAvx512 = {"avx512f", PhiloxWordsAvx512, RadiusAngle32Avx512, Radius64Avx512,
                     Store32Avx512};
#endif

// The instruction set `requested` ("auto": the widest this CPU runs), or
// null where this CPU does not run it.
const Isa* PickIsa(const std::string& requested) {
#ifdef TFDP_X86
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2");
  if (requested == "avx512f" || (requested == "auto" && avx512)) return avx512 ? &kAvx512 : nullptr;
  if (requested == "avx2" || (requested == "auto" && avx2)) return avx2 ? &kAvx2 : nullptr;
#else
  if (requested != "auto" && requested != "portable") return nullptr;
#endif
  return &kPortable;
}

// -- the draw ------------------------------------------------------------------

constexpr int64_t kChunk = 256;  // pairs a chunk (a multiple of 64)

struct Draw {
  const Isa* isa;
  PhiloxKey key;
  int64_t count, half;
  int64_t log_scalar_from;   // pairs from here take the C library's log (Eigen's tail)
  int64_t trig_scalar_from;  // ... and its sin and cos (float32 work only)
  double factor;
};

// sum + value, rounded to T as TensorFlow's element-wise add rounds it.
template <typename T>
TFDP_INLINE T Noised(T sum, T value) {
  return T(sum + value);
}

// The words of pairs [p, p + n) (n <= kChunk, p % 4 == 0): w0 and w1.
TFDP_INLINE void ChunkWords(const Draw& d, int64_t p, int64_t n, uint32_t* w0, uint32_t* w1,
                            uint32_t* scratch) {
  const int groups0 = int((n + 4 * kLanes - 1) / (4 * kLanes));
  d.isa->philox(d.key, uint64_t(p / 4), groups0, w0);
  const int64_t start = d.half + p;  // w1 of pair p: word half + p
  const int64_t offset = start % 4;
  const int groups1 = int((n + offset + 4 * kLanes - 1) / (4 * kLanes));
  d.isa->philox(d.key, uint64_t(start / 4), groups1, scratch);
  std::memcpy(w1, scratch + offset, sizeof(uint32_t) * n);
}

template <typename T, bool kAdd>
void RunPairs32(const Draw& d, int64_t begin, int64_t end, const T* sum, T* out, bool* deep) {
  alignas(64) uint32_t w0[kChunk], w1[kChunk], scratch[kChunk + 4 * kLanes];
  alignas(64) float rc[kChunk], rs[kChunk];
  uint32_t zero_seen = 0;
  const float factor = float(d.factor);
  for (int64_t p = begin; p < end; p += kChunk) {
    const int64_t n = std::min(kChunk, end - p);
    ChunkWords(d, p, n, w0, w1, scratch);
    d.isa->radius_angle32(w0, w1, n, factor, rc, rs, &zero_seen);
    // Eigen's tails: the last half % 4 logs and half % 8 sin/cos are scalar.
    for (int64_t i = std::max(p, std::min(d.log_scalar_from, d.trig_scalar_from)); i < p + n; ++i) {
      const int64_t k = i - p;
      const double e = kLnCells - (i >= d.log_scalar_from ? std::log(double(w0[k]))
                                                          : EigenLog(double(w0[k])));
      const float radius = std::sqrt(float(e)) * factor;
      const float angle = (float(w1[k]) + 0.5f) * float(kAnglePerWord);
      float s, c;
      if (i >= d.trig_scalar_from) {
        s = std::sin(angle);
        c = std::cos(angle);
      } else {
        EigenSinCos(angle, &s, &c);
      }
      rc[k] = radius * c;
      rs[k] = radius * s;
    }
    const int64_t sin_end = std::min(n, d.count - d.half - p);  // the last sin may be cut
    if constexpr (std::is_same<T, float>::value) {
      d.isa->store32(rc, n, kAdd ? sum + p : nullptr, out + p);
      d.isa->store32(rs, sin_end, kAdd ? sum + d.half + p : nullptr, out + d.half + p);
    } else {
      for (int64_t k = 0; k < n; ++k) {
        const T v = static_cast<T>(rc[k]);
        out[p + k] = kAdd ? Noised(sum[p + k], v) : v;
      }
      for (int64_t k = 0; k < sin_end; ++k) {
        const T v = static_cast<T>(rs[k]);
        const int64_t j = d.half + p + k;
        out[j] = kAdd ? Noised(sum[j], v) : v;
      }
    }
  }
  if (zero_seen) *deep = true;
}

template <bool kAdd>
void RunPairs64(const Draw& d, int64_t begin, int64_t end, const double* sum, double* out,
                bool* deep) {
  alignas(64) uint32_t w0[kChunk], w1[kChunk], scratch[kChunk + 4 * kLanes];
  alignas(64) double radius[kChunk];
  uint32_t zero_seen = 0;
  for (int64_t p = begin; p < end; p += kChunk) {
    const int64_t n = std::min(kChunk, end - p);
    ChunkWords(d, p, n, w0, w1, scratch);
    d.isa->radius64(w0, n, d.factor, radius, &zero_seen);
    for (int64_t i = std::max(p, d.log_scalar_from); i < p + n; ++i) {  // Eigen's scalar tail
      radius[i - p] = std::sqrt(kLnCells - std::log(double(w0[i - p]))) * d.factor;
    }
    const int64_t sin_end = std::min(n, d.count - d.half - p);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = p + k;
      const double angle = (double(w1[k]) + 0.5) * kAnglePerWord;
      const double c = radius[k] * std::cos(angle);
      out[i] = kAdd ? Noised(sum[i], c) : c;
      if (k < sin_end) {
        const double s = radius[k] * std::sin(angle);
        out[d.half + i] = kAdd ? Noised(sum[d.half + i], s) : s;
      }
    }
  }
  if (zero_seen) *deep = true;
}

}  // namespace tfdp_noise

namespace tensorflow {

using shape_inference::InferenceContext;

REGISTER_OP("TfdpGaussianNoise")
    .Input("shape: Tshape")
    .Input("seed: int64")
    .Input("factor: float64")
    .Output("noise: dtype")
    .Output("deep: bool")
    .Attr("dtype: {half, bfloat16, float, double}")
    .Attr("Tshape: {int32, int64}")
    .Attr("isa: {'auto', 'avx512f', 'avx2', 'portable'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(0, &out));
      c->set_output(0, out);
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("tfdp's Gaussian noise of `shape` (the graph generator's values); "
         "`deep`: some radius word was 0 (the graph refines those). `isa`: the "
         "instruction set of the loops (tests compare them; 'auto': the widest).");

REGISTER_OP("TfdpGaussianNoiseAdd")
    .Input("sum: dtype")
    .Input("seed: int64")
    .Input("factor: float64")
    .Output("noised: dtype")
    .Output("deep: bool")
    .Attr("dtype: {half, bfloat16, float, double}")
    .Attr("isa: {'auto', 'avx512f', 'avx2', 'portable'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("`sum` plus TfdpGaussianNoise of its shape, in one pass.");

// The draw `d` into `data` (plus `sum` for kAdd), sharded over the
// CPU threads in whole chunks (each starts at a multiple of 4 pairs).
// Returns whether some radius word was 0.
template <typename T, bool kAdd>
bool RunDraw(OpKernelContext* ctx, const tfdp_noise::Draw& d, const T* sum, T* data) {
  const int64_t chunks = (d.half + tfdp_noise::kChunk - 1) / tfdp_noise::kChunk;
  std::vector<char> deep(std::max<int64_t>(chunks, 1), 0);  // a flag a shard
  auto work = [&](int64_t first_chunk, int64_t last_chunk) {
    const int64_t begin = first_chunk * tfdp_noise::kChunk;
    const int64_t end = std::min(d.half, last_chunk * tfdp_noise::kChunk);
    bool seen = false;
    if constexpr (std::is_same<T, double>::value) {
      tfdp_noise::RunPairs64<kAdd>(d, begin, end, sum, data, &seen);
    } else {
      tfdp_noise::RunPairs32<T, kAdd>(d, begin, end, sum, data, &seen);
    }
    if (seen) deep[first_chunk] = 1;
  };
  const auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  // A chunk's cycles: about 10 a pair in float32 (Philox and the transform
  // vectorized), about 100 in float64 (the C library's sin and cos).
  const int64_t cost = std::is_same<T, double>::value ? 25600 : 2560;
  Shard(threads->num_threads, threads->workers, chunks, cost, work);
  return std::any_of(deep.begin(), deep.end(), [](char flag) { return flag != 0; });
}

// The draw of `count` entries keyed by `seed`, scaled by `factor`.
Status MakeDraw(const tfdp_noise::Isa* isa, const Tensor& seed, const Tensor& factor,
                int64_t count, tfdp_noise::Draw* d) {
  if (seed.dims() != 1 || seed.NumElements() != 2) {
    return errors::InvalidArgument("seed must be an int64 vector of 2, got shape ",
                                   seed.shape().DebugString());
  }
  if (factor.dims() != 0) {
    return errors::InvalidArgument("factor must be a scalar, got shape ",
                                   factor.shape().DebugString());
  }
  const auto seeds = seed.flat<int64_t>();
  d->isa = isa;
  d->key = tfdp_noise::KeyFromSeed(seeds(0), seeds(1));
  d->count = count;
  d->half = (count + 1) / 2;
  d->log_scalar_from = d->half - d->half % 4;
  d->trig_scalar_from = d->half - d->half % 8;
  d->factor = factor.scalar<double>()();
  return absl::OkStatus();
}

// The instruction set the op's `isa` attribute asks for.
Status IsaAttr(OpKernelConstruction* ctx, const tfdp_noise::Isa** isa) {
  std::string requested;
  TF_RETURN_IF_ERROR(ctx->GetAttr("isa", &requested));
  *isa = tfdp_noise::PickIsa(requested);
  if (*isa == nullptr) {
    return errors::InvalidArgument("isa='", requested, "' does not run on this CPU; use isa='auto'");
  }
  return absl::OkStatus();
}

REGISTER_OP("TfdpGaussianNoiseAddGroup")
    .Input("sums: N * dtype")
    .Input("seed: int64")
    .Input("factor: float64")
    .Output("noised: N * dtype")
    .Output("deep: bool")
    .Attr("N: int >= 1")
    .Attr("dtype: {half, bfloat16, float, double}")
    .Attr("isa: {'auto', 'avx512f', 'avx2', 'portable'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() - 2;
      for (int k = 0; k < n; ++k) c->set_output(k, c->input(k));
      c->set_output(n, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Each of `sums` plus its piece of one TfdpGaussianNoise draw of their total "
         "size (cut in order).");

template <typename T, bool kAdd>
class GaussianNoiseOp : public OpKernel {
 public:
  explicit GaussianNoiseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, IsaAttr(ctx, &isa_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& first = ctx->input(0);
    TensorShape shape;
    if (kAdd) {
      shape = first.shape();
    } else {
      OP_REQUIRES_OK(ctx, tensor::MakeShape(first, &shape));
    }
    tfdp_noise::Draw d;
    OP_REQUIRES_OK(ctx, MakeDraw(isa_, ctx->input(1), ctx->input(2), shape.num_elements(), &d));
    Tensor* out = nullptr;
    if (kAdd) {  // in place where TensorFlow lets the sum go: one buffer, one pass
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, shape, &out));
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    }
    Tensor* deep = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &deep));
    const T* sum = kAdd ? first.flat<T>().data() : nullptr;  // may be `out` itself
    deep->scalar<bool>()() = RunDraw<T, kAdd>(ctx, d, sum, out->flat<T>().data());
  }

 private:
  const tfdp_noise::Isa* isa_ = nullptr;
};

// Small tensors sharing one draw (the graph's grouping): the draw of their
// total size, cut in their order, each piece added to its tensor.
template <typename T>
class GaussianNoiseAddGroupOp : public OpKernel {
 public:
  explicit GaussianNoiseAddGroupOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, IsaAttr(ctx, &isa_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList sums;
    OP_REQUIRES_OK(ctx, ctx->input_list("sums", &sums));
    int64_t total = 0;
    for (const Tensor& sum : sums) total += sum.NumElements();
    tfdp_noise::Draw d;
    OP_REQUIRES_OK(ctx, MakeDraw(isa_, ctx->input(sums.size()), ctx->input(sums.size() + 1),
                                 total, &d));
    Tensor noise;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<T>::value, TensorShape({total}),
                                           &noise));
    const T* drawn = noise.flat<T>().data();
    Tensor* deep = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(sums.size(), TensorShape({}), &deep));
    deep->scalar<bool>()() = RunDraw<T, false>(ctx, d, nullptr, noise.flat<T>().data());
    int64_t offset = 0;
    for (int k = 0; k < sums.size(); ++k) {
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({k}, k, sums[k].shape(), &out));
      const T* sum = sums[k].flat<T>().data();
      T* data = out->flat<T>().data();
      for (int64_t i = 0; i < sums[k].NumElements(); ++i) {
        data[i] = tfdp_noise::Noised(sum[i], drawn[offset + i]);
      }
      offset += sums[k].NumElements();
    }
  }

 private:
  const tfdp_noise::Isa* isa_ = nullptr;
};

#define TFDP_REGISTER(T)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("TfdpGaussianNoiseAddGroup").Device(DEVICE_CPU).TypeConstraint<T>("dtype"),    \
      GaussianNoiseAddGroupOp<T>);                                                        \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("TfdpGaussianNoise").Device(DEVICE_CPU).TypeConstraint<T>("dtype").HostMemory( \
          "shape"),                                                                       \
      GaussianNoiseOp<T, false>);                                                         \
  REGISTER_KERNEL_BUILDER(Name("TfdpGaussianNoiseAdd").Device(DEVICE_CPU).TypeConstraint<T>("dtype"), \
                          GaussianNoiseOp<T, true>);

TFDP_REGISTER(Eigen::half)
TFDP_REGISTER(Eigen::bfloat16)
TFDP_REGISTER(float)
TFDP_REGISTER(double)

}  // namespace tensorflow
