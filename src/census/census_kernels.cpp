// The census loops. Each block of kBlock elements gets one vectorised pass
// that keeps shifted sums, min, max and min |x| in SIMD lanes. Non-finite
// values poison the sums, so a NaN or Inf sends the block to the exact
// scalar path; rare magnitudes are counted by a second pass after the first,
// while the data is still in cache: over the block for fp16 overflows, over
// the sub-blocks that hold them for tiny values. Healthy data pays for one
// pass and no branches per element.
//
// The pass is bound by how many vector instructions each register of data
// costs, and by which execution ports they need: on AMD Zen the adds, mins
// and maxes share two ports while the two FMA ports idle. So with FMA the
// shift and the sum are written as fused multiply-adds by 1 (same result,
// other ports), and with AVX-512 min |x| is one vrangeps (see fused_ops).
// A block centred on 0 is summed without a shift (block_shift): six
// instructions per register instead of seven. Four registers per sum hide
// the FMA's latency (two made it the bound: 2.0 cycles per register).
#include "census_kernels.h"
#include "nanguard/float_formats.h"

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

// Elements per block: large enough that a block's set-up and merge cost
// little, small enough (128 KiB of float) that a second pass over a block
// with a NaN or a huge value finds it in L2.
constexpr int64_t kBlock = 32768;
// Vectors per sub-block: the span one min |x| covers (see census_block).
constexpr int64_t kSubBlockVectors = 64;
// Vectors summed in float lanes before the sums move to double lanes, so a
// lane holds at most this many terms: a relative rounding error of at most
// 256 * 2^-24, about 1e-6 in practice. Moving them every 64 vectors made the
// pass 5% slower. A multiple of kSubBlockVectors.
constexpr int64_t kFloatLaneTerms = 256;

// The census does six vector operations per register of data, so it issues
// loads too slowly for the hardware prefetcher to keep enough cache lines
// in flight from L3 and main memory: it asks for the line 4 KiB ahead
// itself (measured on AVX2 Zen 3: 0.61-0.85 -> 0.84-0.95 of x.sum() at
// 2^22-2^26 floats). A prefetch past the end of the data is harmless.
constexpr int64_t kPrefetchBytes = 4096;

template <typename T>
NANGUARD_HOT void prefetch_ahead(const T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes);
}

// The sum of squared deviations from the mean, from the sums s1 of x - shift
// and s2 of its squares over n values: clamped at 0 against rounding, but
// NaN or Inf when the sums overflowed (census() then measures the tensor
// again, scaled), never hidden by the clamp.
inline double squared_deviations(double s1, double s2, double n) {
  const double m2 = s2 - s1 * (s1 / n);  // s1 * s1 could overflow where the result does not
  return m2 < 0 ? 0 : m2;
}

// Statistics of a finite block, from its shifted sums.
template <typename T>
NANGUARD_HOT census_partial finite_block(int64_t n, T shift, double s1, double s2, T lo, T hi) {
  census_partial p;
  p.numel = p.finite = n;
  p.min = lo;
  p.max = hi;
  p.mean = double(shift) + s1 / double(n);
  p.m2 = squared_deviations(s1, s2, double(n));
  return p;
}

// Counts the values of a finite range that become Inf once cast to float16
// or bfloat16: only called when its max |x| says there may be one.
template <typename T>
NANGUARD_HOT void count_huge(const T* x, int64_t n, census_partial& p) {
  int64_t fp16 = 0, bf16 = 0;
  for (int64_t i = 0; i < n; ++i) {
    fp16 += inf_in_fp16(double(x[i]));
    bf16 += inf_in_bf16(double(x[i]));
  }
  p.fp16_overflow += fp16;
  p.bf16_overflow += bf16;
}

// Exact scalar census of a block that holds a NaN or Inf (or whose squares
// overflow T). Shifted double sums keep the mean and variance accurate; for
// float64 they can overflow too, which leaves mean or m2 not finite.
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
    p.fp16_underflow += a != T(0) && double(a) < fp16_min_normal;
    p.fp16_overflow += inf_in_fp16(double(v));
    p.bf16_overflow += inf_in_bf16(double(v));
  }
  if (p.finite > 0) {
    p.min = lo;
    p.max = hi;
    p.mean = shift + s1 / double(p.finite);
    p.m2 = squared_deviations(s1, s2, double(p.finite));
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
  using doubles = typename vector_of<double, Bytes>::type;  // one register of double lanes
  /// A value's lanes in double: two registers for float, one for double.
  static constexpr int wide_registers = int(sizeof(double) / sizeof(T));
  using wide = doubles[wide_registers];
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
  /// Adds the lanes of v[0..count), in double, to `acc`'s and zeroes them.
  static NANGUARD_HOT void flush(value* v, int count, wide& acc) {
    value s = v[0];
    for (int u = 1; u < count; ++u) s += v[u];
    if constexpr (wide_registers == 1) {
      acc[0] += s;
    } else {  // each half of the float lanes, converted in its own register
      using half = typename vector_of<T, Bytes / 2>::type;
      half low, high;
      std::memcpy(&low, &s, Bytes / 2);
      std::memcpy(&high, reinterpret_cast<const char*>(&s) + Bytes / 2, Bytes / 2);
      acc[0] += to_doubles(low);
      acc[1] += to_doubles(high);
    }
    for (int u = 0; u < count; ++u) v[u] = value{};
  }
  /// Float lanes in double. One vcvtps2pd where AVX has it: GCC's generic
  /// conversion goes through memory two lanes at a time.
  template <typename Half>
  static NANGUARD_HOT doubles to_doubles(Half h) {
    if constexpr (Bytes >= 32) {  // only compiled into the AVX2 and AVX-512 kernels
      doubles d;
      asm("vcvtps2pd %1, %0" : "=v"(d) : "v"(h));
      return d;
    } else {
      return __builtin_convertvector(h, doubles);
    }
  }
  /// The sum of every lane of v[0..count), in the lanes' type (value or doubles).
  template <typename Vec>
  static NANGUARD_HOT auto sum(const Vec* v, int count) {
    Vec acc = v[0];
    for (int u = 1; u < count; ++u) acc += v[u];
    using lane = std::decay_t<decltype(acc[0])>;
    lane s = 0;
    for (size_t j = 0; j < sizeof(Vec) / sizeof(lane); ++j) s += acc[j];
    return s;
  }
  static NANGUARD_HOT T min(const value* v, int count) {
    return fold_lanes<Bytes>(fold(v, count, smaller), smaller);
  }
  static NANGUARD_HOT T max(const value* v, int count) {
    return fold_lanes<Bytes>(fold(v, count, larger), larger);
  }

 private:
  static constexpr auto smaller = [](auto a, auto b) { return a < b ? a : b; };
  static constexpr auto larger = [](auto a, auto b) { return a > b ? a : b; };

  /// pick(...pick(v[0], v[1])..., v[count - 1]), lane by lane.
  template <typename Pick>
  static NANGUARD_HOT value fold(const value* v, int count, Pick pick) {
    value acc = v[0];
    for (int u = 1; u < count; ++u) acc = pick(v[u], acc);
    return acc;
  }
  /// One lane picked from all of v's by halving the vector: log2(lanes) steps.
  template <int B, typename Pick>
  static NANGUARD_HOT T fold_lanes(typename vector_of<T, B>::type v, Pick pick) {
    if constexpr (B == 2 * int(sizeof(T))) {
      return pick(v[0], v[1]);
    } else {
      typename vector_of<T, B / 2>::type low, high;
      std::memcpy(&low, &v, B / 2);
      std::memcpy(&high, reinterpret_cast<const char*>(&v) + B / 2, B / 2);
      return fold_lanes<B / 2>(pick(low, high), pick);
    }
  }
};

// Adds the float16 underflows of x[0, n) to p, and its zeros and
// subnormals (those below `subnormal_below`) where the caller says there may
// be some: each kind of count costs two vector operations per register, a
// third of a census. Whole vectors go through SIMD lanes (a true compare is
// -1 in every bit).
template <typename T, int Bytes, bool Zeros, bool Subnormals>
NANGUARD_HOT void count_tiny_kinds(const T* x, int64_t n, T subnormal_below, census_partial& p) {
  using S = simd<T, Bytes>;
  using V = typename S::value;
  const V zero{}, fp16_tiny = V{} + T(fp16_min_normal), subnormal = V{} + subnormal_below;
  decltype(V{} == V{}) zeros{}, tiny{}, sub{};
  int64_t i = 0;
  for (; i + S::lanes <= n; i += S::lanes) {
    const V a = S::abs(S::load(x + i));
    if constexpr (Zeros) zeros -= a == zero;
    tiny -= a < fp16_tiny;
    if constexpr (Subnormals) sub -= a < subnormal;
  }
  int64_t z = 0, t = 0, s = 0;
  for (int j = 0; j < S::lanes; ++j) {
    z += zeros[j];
    t += tiny[j];
    s += sub[j];
  }
  for (; i < n; ++i) {
    const T a = std::fabs(x[i]);
    z += a == T(0);
    t += a < T(fp16_min_normal);
    s += Subnormals && a < subnormal_below;
  }
  p.zeros += z;
  p.fp16_underflow += t - z;
  if (Subnormals) p.subnormal += s - z;
}

// count_tiny_kinds for a finite range whose min |x| is `least`: zeros are
// counted only when it is 0 and subnormals only when it is below
// `subnormal_below`, so small gradients without zeros pay for one count.
template <typename T, int Bytes>
NANGUARD_HOT void count_tiny(const T* x, int64_t n, T least, T subnormal_below, census_partial& p) {
  if (least == T(0)) count_tiny_kinds<T, Bytes, true, true>(x, n, subnormal_below, p);
  else if (least < subnormal_below) count_tiny_kinds<T, Bytes, false, true>(x, n, subnormal_below, p);
  else count_tiny_kinds<T, Bytes, false, false>(x, n, subnormal_below, p);
}

// The per-element steps of census_block as plain vector arithmetic.
template <typename T, int Bytes>
struct plain_ops {
  using S = simd<T, Bytes>;
  using V = typename S::value;
  V shift;

  explicit plain_ops(T s) : shift(V{} + s) {}
  NANGUARD_HOT V minus_shift(V v) const { return v - shift; }
  NANGUARD_HOT V plus(V sum, V d) const { return sum + d; }
  NANGUARD_HOT V min_magnitude(V acc, V v) const {
    const V a = S::abs(v);
    return a < acc ? a : acc;
  }
};

// The same steps for CPUs with FMA, where the adds, mins and maxes share
// two ports while the FMA ports idle (AMD Zen): x - shift and sum + x become
// fused multiply-adds by 1, exact and so the same results. `one` is hidden
// from the optimiser, which would fold x * 1 back into a plain add.
template <typename T, int Bytes>
struct fused_ops : plain_ops<T, Bytes> {
  using V = typename plain_ops<T, Bytes>::V;
  V one = V{} + T(1), minus_s;

  explicit fused_ops(T s) : plain_ops<T, Bytes>(s), minus_s(V{} - s) { asm("" : "+v"(one)); }
  NANGUARD_HOT V minus_shift(V v) const { return v * one + minus_s; }
  NANGUARD_HOT V plus(V sum, V d) const { return d * one + sum; }
};

#if NANGUARD_X86
#define NANGUARD_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))

// AVX-512DQ takes min |x| in one vrangeps (|x| and a min otherwise). Inline
// assembly, because an intrinsic would need the AVX-512 target on every
// generic function it is inlined through.
template <typename T, int Bytes>
struct avx512_ops : fused_ops<T, Bytes> {
  static_assert(Bytes == 64, "zmm registers");
  using V = typename fused_ops<T, Bytes>::V;
  using fused_ops<T, Bytes>::fused_ops;

  NANGUARD_HOT V min_magnitude(V acc, V v) const {
    // imm 0x0A: the operand of smaller magnitude, sign cleared
    if constexpr (sizeof(T) == 4) asm("vrangeps $0x0A, %1, %0, %0" : "+v"(acc) : "v"(v));
    else asm("vrangepd $0x0A, %1, %0, %0" : "+v"(acc) : "v"(v));
    return acc;
  }
};
#endif

// Elements whose mean and spread choose a block's shift (see block_shift).
constexpr int64_t kShiftProbe = 64;

// What census_block subtracts from each element before summing it and its
// square: 0 when the block's first elements are centred on 0 (|mean| within
// two standard deviations), which saves an operation per register of data;
// their mean otherwise (weights near 1, Adam's second moments), so the sum
// of squares never holds much more than the spread, and the variance keeps
// its digits. NaN when they are not finite: the block goes to exact_block.
template <typename T>
NANGUARD_HOT T block_shift(const T* x, int64_t n) {
  const int64_t m = std::min(n, kShiftProbe);
  double s1 = 0, s2 = 0;
  for (int64_t i = 0; i < m; ++i) {
    s1 += double(x[i]);
    s2 += double(x[i]) * double(x[i]);
  }
  const double mean = s1 / double(m), variance = s2 / double(m) - mean * mean;
  if (!std::isfinite(s2)) return std::numeric_limits<T>::quiet_NaN();
  return mean * mean <= 4 * variance ? T(0) : T(mean);
}

// One vectorised pass over a block: U independent registers per sum so
// that consecutive fused multiply-adds do not wait on each other (min and
// max take one cycle, one register each). The block is read in sub-blocks
// of kSubBlockVectors vectors, each with its own min |x|, so that the
// counting pass for tiny values (common in gradients) touches only the
// sub-blocks that hold them; it runs after the pass, once the block is known
// to be finite. Every kFloatLaneTerms vectors the sums move to double lanes.
// Shifted: the sums are of x - shift.
template <typename T, int Bytes, int U, typename Ops, bool Shifted>
NANGUARD_HOT census_partial census_block(const T* x, int64_t n, int64_t base, T subnormal_below, T shift) {
  using S = simd<T, Bytes>;
  using V = typename S::value;
  constexpr int64_t step = int64_t(S::lanes) * U, sub_block = kSubBlockVectors * S::lanes;
  constexpr int64_t sub_blocks_per_flush = kFloatLaneTerms / kSubBlockVectors;
  static_assert(kBlock % sub_block == 0 && sub_block % step == 0, "blocks hold whole sub-blocks");
  const Ops ops(shift);
  V s1[U] = {}, s2[U] = {}, lo = V{} + x[0], hi = lo;
  typename S::wide w1 = {}, w2 = {};
  V smallest[kBlock / sub_block];  // min |x| of each sub-block
  const V first_magnitude = V{} + std::fabs(x[0]);
  const int64_t sub_blocks = n / sub_block;
  for (int64_t b = 0; b < sub_blocks; ++b) {
    const T* p = x + b * sub_block;
    V amin = first_magnitude;
    for (int64_t k = 0; k < sub_block; k += step) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        if ((u * Bytes) % 64 == 0) prefetch_ahead(p + k + u * S::lanes);
        const V v = S::load(p + k + u * S::lanes);
        V d = v;
        if constexpr (Shifted) d = ops.minus_shift(v);
        s1[u] = ops.plus(s1[u], d);
        s2[u] += d * d;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        amin = ops.min_magnitude(amin, v);
      }
    }
    smallest[b] = amin;
    if ((b + 1) % sub_blocks_per_flush == 0) {
      S::flush(s1, U, w1);
      S::flush(s2, U, w2);
    }
  }
  S::flush(s1, U, w1);
  S::flush(s2, U, w2);
  double S1 = S::sum(w1, S::wide_registers), S2 = S::sum(w2, S::wide_registers);
  T mn = S::min(&lo, 1), mx = S::max(&hi, 1);
  const int64_t tail = sub_blocks * sub_block;
  for (int64_t i = tail; i < n; ++i) {  // the last partial sub-block
    const T v = x[i], d = v - shift;
    S1 += d;
    S2 += double(d) * d;
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  // NaN and Inf poison the sums (as do squares that overflow T).
  if (!std::isfinite(S1) || !std::isfinite(S2)) return exact_block(x, n, base, subnormal_below);
  census_partial p = finite_block<T>(n, shift, S1, S2, mn, mx);
  for (int64_t b = 0; b < sub_blocks; ++b) {
    const T least = S::min(&smallest[b], 1);
    if (least < T(fp16_min_normal)) count_tiny<T, Bytes>(x + b * sub_block, sub_block, least, subnormal_below, p);
  }
  if (tail < n) count_tiny<T, Bytes>(x + tail, n - tail, T(0), subnormal_below, p);  // min |x| unknown: 0
  if (std::max(std::fabs(mn), std::fabs(mx)) > T(fp16_max)) count_huge(x, n, p);  // none up to fp16_max rounds to Inf
  return p;
}

template <typename T, int Bytes, int U, template <typename, int> class Ops>
NANGUARD_HOT census_partial census_range(const T* x, int64_t n, int64_t base, T subnormal_below) {
  census_partial total;
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t len = std::min(kBlock, n - i);
    const T* block = x + i;
    const T shift = block_shift(block, len);
    using O = Ops<T, Bytes>;
    if (std::isnan(shift))
      total.merge(exact_block(block, len, base + i, subnormal_below));
    else if (shift == T(0))
      total.merge(census_block<T, Bytes, U, O, false>(block, len, base + i, subnormal_below, shift));
    else
      total.merge(census_block<T, Bytes, U, O, true>(block, len, base + i, subnormal_below, shift));
  }
  return total;
}

constexpr int64_t kScanBlock = 4096;

// x - x is 0 for finite x and NaN otherwise: one subtract and one add per
// element, checked once per block so a hit stops the scan early.
template <typename T, int Bytes, int U>
NANGUARD_HOT bool any_nonfinite_in_one_stream(const T* x, int64_t n) {
  using S = simd<T, Bytes>;
  using V = typename S::value;
  constexpr int64_t step = int64_t(S::lanes) * U;
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

// The same with the two halves of the range read side by side: from main
// memory, two streams keep more reads in flight than one (~10% faster).
template <typename T, int Bytes, int U>
NANGUARD_HOT bool any_nonfinite(const T* x, int64_t n) {
  using S = simd<T, Bytes>;
  using V = typename S::value;
  constexpr int64_t half_step = int64_t(S::lanes) * (U / 2);
  static_assert(U % 2 == 0 && kScanBlock % half_step == 0, "whole steps per stream");
  const int64_t half = n / (2 * kScanBlock) * kScanBlock;  // whole blocks per stream
  const T* second = x + half;
  for (int64_t start = 0; start < half; start += kScanBlock) {
    V acc[U] = {};
    for (int64_t i = start; i < start + kScanBlock; i += half_step) {
#pragma GCC unroll 8
      for (int u = 0; u < U / 2; ++u) {
        const V v = S::load(x + i + u * S::lanes), w = S::load(second + i + u * S::lanes);
        acc[u] += v - v;
        acc[U / 2 + u] += w - w;
      }
    }
    if (!std::isfinite(S::sum(acc, U))) return true;
  }
  return any_nonfinite_in_one_stream<T, Bytes, U>(x + 2 * half, n - 2 * half);
}


NANGUARD_HOT bool any_exponent_saturated(const uint16_t* bits, int64_t n, uint16_t mask) {
  for (int64_t start = 0; start < n; start += kScanBlock) {
    const int64_t end = std::min(n, start + kScanBlock);
    int hits = 0;
    for (int64_t i = start; i < end; ++i) hits |= (bits[i] & mask) == mask;
    if (hits) return true;
  }
  return false;
}

// Integer maxima of the bit patterns, signed and unsigned, R registers of
// each: one load and two integer max instructions per vector.
template <typename U, int Bytes, int R>
NANGUARD_HOT extreme_bits extremes(const U* x, int64_t n) {
  using S = std::make_signed_t<U>;
  typedef S VS __attribute__((vector_size(Bytes)));
  typedef U VU __attribute__((vector_size(Bytes)));
  constexpr int lanes = Bytes / int(sizeof(U));
  VS smax[R];
  VU umax[R];
  for (int r = 0; r < R; ++r) {
    smax[r] = VS{} + std::numeric_limits<S>::min();
    umax[r] = VU{};
  }
  int64_t i = 0;
  for (; i + lanes * R <= n; i += lanes * R) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      VU v;
      std::memcpy(&v, x + i + r * lanes, Bytes);
#if NANGUARD_X86
      asm("" : "+x"(v));  // one load for both maxima, not a memory operand each
#endif
      const VS s = reinterpret_cast<VS>(v);
      smax[r] = smax[r] > s ? smax[r] : s;
      umax[r] = umax[r] > v ? umax[r] : v;
    }
  }
  S sm = std::numeric_limits<S>::min();
  U um = 0;
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < lanes; ++l) {
      sm = std::max(sm, S(smax[r][l]));
      um = std::max(um, U(umax[r][l]));
    }
  for (; i < n; ++i) {
    sm = std::max(sm, S(x[i]));
    um = std::max(um, x[i]);
  }
  return {uint64_t(U(sm)), uint64_t(um)};
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

// One copy of each kernel per instruction set: vector width in bytes,
// registers per statistic (5 statistics must fit 32 zmm / 16 ymm / 16 xmm)
// and the census steps' forms.
#define NANGUARD_KERNELS(isa, target, bytes, census_regs, ops, scan_regs)                       \
  target census_partial census_f32_##isa(const float* x, int64_t n, int64_t base, float sub) {  \
    return census_range<float, bytes, census_regs, ops>(x, n, base, sub);                       \
  }                                                                                             \
  target census_partial census_f64_##isa(const double* x, int64_t n, int64_t base, double sub) {\
    return census_range<double, bytes, census_regs, ops>(x, n, base, sub);                      \
  }                                                                                             \
  target bool any_nonfinite_f32_##isa(const float* x, int64_t n) {                              \
    return any_nonfinite<float, bytes, scan_regs>(x, n);                                        \
  }                                                                                             \
  target bool any_nonfinite_f64_##isa(const double* x, int64_t n) {                             \
    return any_nonfinite<double, bytes, scan_regs>(x, n);                                       \
  }                                                                                             \
  target bool any_nonfinite_16bit_##isa(const uint16_t* x, int64_t n, uint16_t mask) {          \
    return any_exponent_saturated(x, n, mask);                                                  \
  }                                                                                             \
  target extreme_bits extremes_16bit_##isa(const uint16_t* x, int64_t n) {                      \
    return extremes<uint16_t, bytes, 4>(x, n);                                                  \
  }                                                                                             \
  target extreme_bits extremes_32bit_##isa(const uint32_t* x, int64_t n) {                      \
    return extremes<uint32_t, bytes, 4>(x, n);                                                  \
  }                                                                                             \
  target extreme_bits extremes_64bit_##isa(const uint64_t* x, int64_t n) {                      \
    return extremes<uint64_t, bytes, 4>(x, n);                                                  \
  }

namespace {
#if NANGUARD_X86
NANGUARD_KERNELS(avx512, NANGUARD_AVX512, 64, 4, avx512_ops, 8)
NANGUARD_KERNELS(avx2, __attribute__((target("avx2,fma"))), 32, 4, fused_ops, 8)
#endif
NANGUARD_KERNELS(baseline, , 16, 2, plain_ops, 8)

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

extreme_bits extremes_16bit(const uint16_t* x, int64_t n) { NANGUARD_DISPATCH(extremes_16bit, x, n) }

extreme_bits extremes_32bit(const uint32_t* x, int64_t n) { NANGUARD_DISPATCH(extremes_32bit, x, n) }

extreme_bits extremes_64bit(const uint64_t* x, int64_t n) { NANGUARD_DISPATCH(extremes_64bit, x, n) }

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
NANGUARD_SUMSQ_KERNELS(avx512, NANGUARD_AVX512, 64, 8)
NANGUARD_SUMSQ_KERNELS(avx2, __attribute__((target("avx2,fma"))), 32, 8)
#endif
NANGUARD_SUMSQ_KERNELS(baseline, , 16, 8)

}  // namespace

sumsq_partial sumsq_f32(const float* x, int64_t n) { NANGUARD_DISPATCH(sumsq_f32, x, n) }

sumsq_partial sumsq_f64(const double* x, int64_t n) { NANGUARD_DISPATCH(sumsq_f64, x, n) }

}  // namespace nanguard::detail
