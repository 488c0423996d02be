// census_kernels.h — the SIMD loops behind census() and has_nonfinite().
//
// Free of LibTorch so that it compiles fast, at -O3, with one copy per
// instruction set (AVX-512, AVX2, baseline) picked at run time.
#pragma once

#include <cstdint>

namespace nanguard::detail {

/// Instruction sets the kernels are compiled for, slowest first.
enum class kernel_isa { baseline, avx2, avx512, best };

/// The instruction set the kernels run with: the best this CPU has, or a
/// slower one chosen with `force_isa` (tests run every path that way).
kernel_isa active_isa();
/// Caps the instruction set (`kernel_isa::best` lifts the cap).
void force_isa(kernel_isa isa);
/// "baseline", "avx2", "avx512" or "best".
const char* to_string(kernel_isa isa);

/// Census of one contiguous range; ranges merge in order with `merge`.
struct census_partial {
  int64_t numel = 0;
  int64_t nan = 0, pos_inf = 0, neg_inf = 0, zeros = 0, subnormal = 0;
  int64_t fp16_overflow = 0, fp16_underflow = 0, bf16_overflow = 0;
  // Finite values: count, min, max, mean and sum of squared deviations,
  // merged with Chan et al.'s pairwise formula so 1e8 elements stay exact.
  // Float64 sums can overflow (values beyond ~1e154): mean or m2 is then NaN
  // or Inf, and census() measures the tensor again, scaled.
  int64_t finite = 0;
  double min = 0, max = 0, mean = 0, m2 = 0;
  int64_t first_bad = -1;  // global flat index
  double first_bad_value = 0;

  /// Appends the statistics of the range that follows this one.
  void merge(const census_partial& next);
};

/// Census of x[0, n); `base` is x[0]'s flat index in the whole tensor and
/// `subnormal_below` the smallest normal magnitude of the source dtype.
census_partial census_f32(const float* x, int64_t n, int64_t base, float subnormal_below);
census_partial census_f64(const double* x, int64_t n, int64_t base, double subnormal_below);

/// True when x[0, n) holds a NaN or an Inf.
bool any_nonfinite_f32(const float* x, int64_t n);
bool any_nonfinite_f64(const double* x, int64_t n);
/// True when one of the 16-bit floats in bits[0, n) has all exponent bits set
/// (`exponent_mask` 0x7C00 for float16, 0x7F80 for bfloat16): NaN or Inf.
bool any_nonfinite_16bit(const uint16_t* bits, int64_t n, uint16_t exponent_mask);

/// The largest bit patterns of a range of floats read as integers. As signed
/// integers, the largest is the largest non-negative float (or a NaN or +Inf
/// above it); as unsigned, the most negative float (or a NaN or -Inf): the
/// range's bounds from two integer maxima per element, with no float compare.
struct extreme_bits {
  uint64_t signed_max = 0;    ///< the largest pattern as a signed integer, in the float's width
  uint64_t unsigned_max = 0;  ///< the largest pattern as an unsigned integer
};
/// Extreme patterns of the float16/bfloat16, float32 or float64 bits in x[0, n).
extreme_bits extremes_16bit(const uint16_t* x, int64_t n);
extreme_bits extremes_32bit(const uint32_t* x, int64_t n);
extreme_bits extremes_64bit(const uint64_t* x, int64_t n);

}  // namespace nanguard::detail

namespace nanguard::detail {

/// Sum of squares and non-finite count of one gradient range (the sentinel's pass).
struct sumsq_partial {
  double sumsq = 0;       ///< sum of x^2 over the finite elements
  int64_t nonfinite = 0;  ///< NaN and Inf elements
};

/// Sum of squares of x[0, n) in one vectorised read; NaN/Inf counted apart.
sumsq_partial sumsq_f32(const float* x, int64_t n);
/// The same for float64.
sumsq_partial sumsq_f64(const double* x, int64_t n);

}  // namespace nanguard::detail
