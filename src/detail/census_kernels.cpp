// The census loops. Each block of kBlock elements gets one vectorised pass
// that keeps shifted sums, min, max and min |x| in SIMD lanes. Non-finite
// values poison the sums, so a NaN or Inf sends the block to the exact
// scalar path; rare magnitudes (fp16 overflow, tiny values) are counted by a
// second pass over the block while it is still in L1. Healthy data pays for
// one pass and no branches per element.
#include "census_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__GNUC__) && defined(__x86_64__)
#define NANGUARD_X86 1
#else
#define NANGUARD_X86 0
#endif

// The loops must be inlined into each ISA's copy to be compiled for it.
#define NANGUARD_HOT inline __attribute__((always_inline))

namespace nanguard::detail {
namespace {

// Elements per block: large enough that reducing the SIMD lanes is rare,
// small enough (32 KiB of float) that a second pass finds it in L1.
constexpr int64_t kBlock = 8192;
// Elements over which min |x| is reduced (see census_block).
constexpr int64_t kSubBlock = 1024;
constexpr double kFp16Max = 65504.0;
constexpr double kFp16MinNormal = 6.103515625e-05;
constexpr double kBf16Max = 3.3895313892515355e38;

// Statistics of a finite block, from its shifted sums.
template <typename T>
NANGUARD_HOT census_partial finite_block(int64_t n, T shift, double s1, double s2, T lo, T hi) {
  census_partial p;
  p.numel = p.finite = n;
  p.min = lo;
  p.max = hi;
  p.mean = double(shift) + s1 / double(n);
  p.m2 = std::max(0.0, s2 - s1 * s1 / double(n));
  return p;
}

// Counts float16 and bfloat16 overflows of a finite range: only called when
// its max |x| says there is one.
template <typename T>
NANGUARD_HOT void count_huge(const T* x, int64_t n, census_partial& p) {
  int64_t fp16 = 0, bf16 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T a = std::fabs(x[i]);
    fp16 += a > T(kFp16Max);
    bf16 += double(a) > kBf16Max;
  }
  p.fp16_overflow += fp16;
  p.bf16_overflow += bf16;
}

// Adds the zeros, float16 underflows and subnormals of a finite range: only
// called when its min |x| says there is one.
template <typename T>
NANGUARD_HOT void count_tiny(const T* x, int64_t n, T subnormal_below, census_partial& p) {
  int64_t zeros = 0, tiny = 0, sub = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T a = std::fabs(x[i]);
    zeros += a == T(0);
    tiny += a < T(kFp16MinNormal);
    sub += a < subnormal_below;
  }
  p.zeros += zeros;
  p.fp16_underflow += tiny - zeros;
  p.subnormal += sub - zeros;
}

// Exact scalar census of a block that holds a NaN or Inf (or whose squares
// overflow T). Shifted double sums keep the mean and variance accurate.
template <typename T>
census_partial exact_block(const T* x, int64_t n, int64_t base, T subnormal_below) {
  census_partial p;
  p.numel = n;
  double shift = 0, s1 = 0, s2 = 0;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (int64_t i = 0; i < n; ++i) {
    const T v = x[i];
    if (!std::isfinite(v)) {
      if (std::isnan(v)) ++p.nan;
      else if (v > 0) ++p.pos_inf;
      else ++p.neg_inf;
      if (p.first_bad < 0) {
        p.first_bad = base + i;
        p.first_bad_value = double(v);
      }
      continue;
    }
    if (p.finite++ == 0) shift = double(v);
    const double d = double(v) - shift;
    s1 += d;
    s2 += d * d;
    lo = std::min(lo, double(v));
    hi = std::max(hi, double(v));
    const T a = std::fabs(v);
    p.zeros += a == T(0);
    p.subnormal += a != T(0) && a < subnormal_below;
    p.fp16_underflow += a != T(0) && double(a) < kFp16MinNormal;
    p.fp16_overflow += double(a) > kFp16Max;
    p.bf16_overflow += double(a) > kBf16Max;
  }
  if (p.finite > 0) {
    p.min = lo;
    p.max = hi;
    p.mean = shift + s1 / double(p.finite);
    p.m2 = std::max(0.0, s2 - s1 * s1 / double(p.finite));
  }
  return p;
}

// A GCC vector of `Bytes` bytes of E.
template <typename E, int Bytes>
struct vector_of {
  using type __attribute__((vector_size(Bytes))) = E;
};

// GCC vector extensions: one native SIMD register of `Bytes` bytes.
template <typename T, int Bytes>
struct simd {
  using value __attribute__((vector_size(Bytes))) = T;
  using wide = typename vector_of<double, Bytes * 8 / int(sizeof(T))>::type;  // a value in double lanes
  using bits __attribute__((vector_size(Bytes))) =
      std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  static constexpr int lanes = Bytes / int(sizeof(T));

  static NANGUARD_HOT value load(const T* p) {
    value v;
    std::memcpy(&v, p, sizeof v);  // an unaligned vector load
    return v;
  }
  static NANGUARD_HOT value abs(value v) {
    const bits sign_off = bits{} + (~bits{}[0] >> 1);
    return (value)((bits)v & sign_off);
  }
  /// Adds each of `v`'s lanes, in double, to `acc`'s and zeroes `v`.
  static NANGUARD_HOT void flush(value* v, wide* acc, int count) {
    for (int u = 0; u < count; ++u) {
      acc[u] += __builtin_convertvector(v[u], wide);
      v[u] = value{};
    }
  }
  /// The sum of every lane of v[0..count), in the lanes' type (value or wide).
  template <typename Vec>
  static NANGUARD_HOT auto sum(const Vec* v, int count) {
    Vec acc = v[0];
    for (int u = 1; u < count; ++u) acc += v[u];
    std::decay_t<decltype(acc[0])> s = 0;
    for (int j = 0; j < lanes; ++j) s += acc[j];
    return s;
  }
  static NANGUARD_HOT T min(const value* v, int count) {
    value acc = v[0];
    for (int u = 1; u < count; ++u) acc = v[u] < acc ? v[u] : acc;
    T m = acc[0];
    for (int j = 1; j < lanes; ++j) m = std::min(m, acc[j]);
    return m;
  }
  static NANGUARD_HOT T max(const value* v, int count) {
    value acc = v[0];
    for (int u = 1; u < count; ++u) acc = v[u] > acc ? v[u] : acc;
    T m = acc[0];
    for (int j = 1; j < lanes; ++j) m = std::max(m, acc[j]);
    return m;
  }
};

// One vectorised pass over a block: U independent registers per statistic
// so that consecutive adds do not wait on each other. Per sub-block of
// kSubBlock elements, the sums move to double lanes (a float lane then adds
// at most kSubBlock / (lanes * U) terms, whatever the vector width) and min
// |x| is reduced, so the counting pass for tiny values (common in gradients)
// touches only the sub-blocks that hold them.
template <typename T, int Bytes, int U>
NANGUARD_HOT census_partial census_block(const T* x, int64_t n, int64_t base, T subnormal_below) {
  using S = simd<T, Bytes>;
  using V = typename S::value;
  constexpr int64_t step = int64_t(S::lanes) * U;
  static_assert(kSubBlock % step == 0, "sub-blocks hold whole steps");
  using W = typename S::wide;
  const T shift = x[0];
  const V vshift = V{} + shift;
  V s1[U] = {}, s2[U] = {}, lo[U], hi[U];
  W w1[U] = {}, w2[U] = {};
  for (int u = 0; u < U; ++u) lo[u] = hi[u] = vshift;
  census_partial tiny;  // zeros, fp16_underflow and subnormal counts
  int64_t i = 0;
  for (; i + kSubBlock <= n; i += kSubBlock) {
    V amin[U];
    for (int u = 0; u < U; ++u) amin[u] = V{} + std::fabs(shift);
    for (int64_t k = i; k < i + kSubBlock; k += step) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const V v = S::load(x + k + u * S::lanes);
        const V d = v - vshift;
        s1[u] += d;
        s2[u] += d * d;
        lo[u] = v < lo[u] ? v : lo[u];
        hi[u] = v > hi[u] ? v : hi[u];
        const V a = S::abs(v);
        amin[u] = a < amin[u] ? a : amin[u];
      }
    }
    S::flush(s1, w1, U);
    S::flush(s2, w2, U);
    if (S::min(amin, U) < T(kFp16MinNormal)) count_tiny(x + i, kSubBlock, subnormal_below, tiny);
  }
  double S1 = S::sum(w1, U), S2 = S::sum(w2, U);
  T mn = S::min(lo, U), mx = S::max(hi, U);
  const int64_t tail = i;
  for (; i < n; ++i) {  // the last partial sub-block
    const T v = x[i], d = v - shift;
    S1 += d;
    S2 += double(d) * d;
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  // NaN and Inf poison the sums (as do squares that overflow T).
  if (!std::isfinite(S1) || !std::isfinite(S2)) return exact_block(x, n, base, subnormal_below);
  census_partial p = finite_block<T>(n, shift, S1, S2, mn, mx);
  if (tail < n) count_tiny(x + tail, n - tail, subnormal_below, tiny);
  p.zeros = tiny.zeros;
  p.fp16_underflow = tiny.fp16_underflow;
  p.subnormal = tiny.subnormal;
  if (std::max(std::fabs(mn), std::fabs(mx)) > T(kFp16Max)) count_huge(x, n, p);
  return p;
}

template <typename T, int Bytes, int U>
NANGUARD_HOT census_partial census_range(const T* x, int64_t n, int64_t base, T subnormal_below) {
  census_partial total;
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t len = std::min(kBlock, n - i);
    total.merge(census_block<T, Bytes, U>(x + i, len, base + i, subnormal_below));
  }
  return total;
}

// x - x is 0 for finite x and NaN otherwise: one subtract and one add per
// element, checked once per block so a hit stops the scan early.
template <typename T, int Bytes, int U>
NANGUARD_HOT bool any_nonfinite(const T* x, int64_t n) {
  using S = simd<T, Bytes>;
  using V = typename S::value;
  constexpr int64_t step = int64_t(S::lanes) * U, kScanBlock = 4096;
  for (int64_t start = 0; start < n; start += kScanBlock) {
    const int64_t end = std::min(n, start + kScanBlock);
    V acc[U] = {};
    int64_t i = start;
    for (; i + step <= end; i += step) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const V v = S::load(x + i + u * S::lanes);
        acc[u] += v - v;
      }
    }
    T tail = 0;
    for (; i < end; ++i) tail += x[i] - x[i];
    if (!std::isfinite(S::sum(acc, U) + tail)) return true;
  }
  return false;
}


NANGUARD_HOT bool any_exponent_saturated(const uint16_t* bits, int64_t n, uint16_t mask) {
  constexpr int64_t kScanBlock = 4096;
  for (int64_t start = 0; start < n; start += kScanBlock) {
    const int64_t end = std::min(n, start + kScanBlock);
    int hits = 0;
    for (int64_t i = start; i < end; ++i) hits |= (bits[i] & mask) == mask;
    if (hits) return true;
  }
  return false;
}

}  // namespace

void census_partial::merge(const census_partial& next) {
  if (first_bad < 0 && next.first_bad >= 0) {
    first_bad = next.first_bad;
    first_bad_value = next.first_bad_value;
  }
  numel += next.numel;
  nan += next.nan;
  pos_inf += next.pos_inf;
  neg_inf += next.neg_inf;
  zeros += next.zeros;
  subnormal += next.subnormal;
  fp16_overflow += next.fp16_overflow;
  fp16_underflow += next.fp16_underflow;
  bf16_overflow += next.bf16_overflow;
  if (next.finite == 0) return;
  if (finite == 0) {
    finite = next.finite;
    min = next.min;
    max = next.max;
    mean = next.mean;
    m2 = next.m2;
    return;
  }
  const double na = double(finite), nb = double(next.finite), nt = na + nb;
  const double delta = next.mean - mean;
  mean += delta * (nb / nt);
  m2 += next.m2 + delta * delta * (na * nb / nt);
  min = std::min(min, next.min);
  max = std::max(max, next.max);
  finite += next.finite;
}

// One copy of each kernel per instruction set: vector width in bytes, and
// registers per statistic (5 statistics must fit 32 zmm / 16 ymm / 16 xmm).
#define NANGUARD_KERNELS(isa, target, bytes, census_regs, scan_regs)                            \
  target census_partial census_f32_##isa(const float* x, int64_t n, int64_t base, float sub) {  \
    return census_range<float, bytes, census_regs>(x, n, base, sub);                            \
  }                                                                                             \
  target census_partial census_f64_##isa(const double* x, int64_t n, int64_t base, double sub) {\
    return census_range<double, bytes, census_regs>(x, n, base, sub);                           \
  }                                                                                             \
  target bool any_nonfinite_f32_##isa(const float* x, int64_t n) {                              \
    return any_nonfinite<float, bytes, scan_regs>(x, n);                                        \
  }                                                                                             \
  target bool any_nonfinite_f64_##isa(const double* x, int64_t n) {                             \
    return any_nonfinite<double, bytes, scan_regs>(x, n);                                       \
  }                                                                                             \
  target bool any_nonfinite_16bit_##isa(const uint16_t* x, int64_t n, uint16_t mask) {          \
    return any_exponent_saturated(x, n, mask);                                                  \
  }

namespace {
#if NANGUARD_X86
NANGUARD_KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma"))), 64, 4, 8)
NANGUARD_KERNELS(avx2, __attribute__((target("avx2,fma"))), 32, 2, 8)
#endif
NANGUARD_KERNELS(baseline, , 16, 2, 8)

std::atomic<kernel_isa> forced_isa{kernel_isa::best};

kernel_isa detect_isa() {
#if NANGUARD_X86
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return kernel_isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kernel_isa::avx2;
#endif
  return kernel_isa::baseline;
}

}  // namespace

kernel_isa active_isa() {
  static const kernel_isa detected = detect_isa();
  const kernel_isa forced = forced_isa.load(std::memory_order_relaxed);
  return forced == kernel_isa::best || forced > detected ? detected : forced;
}

void force_isa(kernel_isa isa) { forced_isa.store(isa); }

const char* to_string(kernel_isa isa) {
  switch (isa) {
    case kernel_isa::baseline: return "baseline";
    case kernel_isa::avx2: return "avx2";
    case kernel_isa::avx512: return "avx512";
    default: return "best";
  }
}

#if NANGUARD_X86
#define NANGUARD_DISPATCH(fn, ...)                                     \
  switch (active_isa()) {                                              \
    case kernel_isa::avx512: return fn##_avx512(__VA_ARGS__);          \
    case kernel_isa::avx2: return fn##_avx2(__VA_ARGS__);              \
    default: return fn##_baseline(__VA_ARGS__);                        \
  }
#else
#define NANGUARD_DISPATCH(fn, ...) return fn##_baseline(__VA_ARGS__);
#endif

census_partial census_f32(const float* x, int64_t n, int64_t base, float subnormal_below) {
  NANGUARD_DISPATCH(census_f32, x, n, base, subnormal_below)
}

census_partial census_f64(const double* x, int64_t n, int64_t base, double subnormal_below) {
  NANGUARD_DISPATCH(census_f64, x, n, base, subnormal_below)
}

bool any_nonfinite_f32(const float* x, int64_t n) { NANGUARD_DISPATCH(any_nonfinite_f32, x, n) }

bool any_nonfinite_f64(const double* x, int64_t n) { NANGUARD_DISPATCH(any_nonfinite_f64, x, n) }

bool any_nonfinite_16bit(const uint16_t* bits, int64_t n, uint16_t exponent_mask) {
  NANGUARD_DISPATCH(any_nonfinite_16bit, bits, n, exponent_mask)
}

}  // namespace nanguard::detail

// ---------------------------------------------------------------- sentinel
// Sum of squares for the sentinel's gradient pass: float lanes per block of
// kSumsqBlock elements, widened to double per block. A non-finite sum sends
// the block to an exact scalar loop (NaN/Inf, or squares beyond float range).
namespace nanguard::detail {
namespace {

constexpr int64_t kSumsqBlock = 4096;

template <typename T>
sumsq_partial sumsq_exact(const T* x, int64_t n) {
  sumsq_partial p;
  for (int64_t i = 0; i < n; ++i) {
    const double v = double(x[i]);
    if (std::isfinite(v)) p.sumsq += v * v;
    else ++p.nonfinite;
  }
  return p;
}

template <typename T, int Bytes, int U>
NANGUARD_HOT sumsq_partial sumsq_range(const T* x, int64_t n) {
  using S = simd<T, Bytes>;
  using V = typename S::value;
  constexpr int64_t step = int64_t(S::lanes) * U;
  sumsq_partial total;
  for (int64_t start = 0; start < n; start += kSumsqBlock) {
    const int64_t end = std::min(n, start + kSumsqBlock);
    V acc[U] = {};
    int64_t i = start;
    for (; i + step <= end; i += step) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const V v = S::load(x + i + u * S::lanes);
        acc[u] += v * v;
      }
    }
    T s = S::sum(acc, U);
    for (; i < end; ++i) s += x[i] * x[i];
    if (std::isfinite(s)) {
      total.sumsq += double(s);
    } else {
      const sumsq_partial e = sumsq_exact(x + start, end - start);
      total.sumsq += e.sumsq;
      total.nonfinite += e.nonfinite;
    }
  }
  return total;
}

#define NANGUARD_SUMSQ_KERNELS(isa, target, bytes, regs)                 \
  target sumsq_partial sumsq_f32_##isa(const float* x, int64_t n) {      \
    return sumsq_range<float, bytes, regs>(x, n);                        \
  }                                                                      \
  target sumsq_partial sumsq_f64_##isa(const double* x, int64_t n) {     \
    return sumsq_range<double, bytes, regs>(x, n);                       \
  }

#if NANGUARD_X86
NANGUARD_SUMSQ_KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma"))), 64, 8)
NANGUARD_SUMSQ_KERNELS(avx2, __attribute__((target("avx2,fma"))), 32, 8)
#endif
NANGUARD_SUMSQ_KERNELS(baseline, , 16, 8)

}  // namespace

sumsq_partial sumsq_f32(const float* x, int64_t n) { NANGUARD_DISPATCH(sumsq_f32, x, n) }

sumsq_partial sumsq_f64(const double* x, int64_t n) { NANGUARD_DISPATCH(sumsq_f64, x, n) }

}  // namespace nanguard::detail
