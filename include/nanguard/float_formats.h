/// @file float_formats.h
/// The limits of the 16-bit float formats: where float16 and bfloat16
/// overflow and where float16 loses precision. Plain constants and
/// functions, for host and device code alike (this header includes nothing).
#pragma once

// The functions below are compiled for the GPU too when nvcc reads them.
#ifdef __CUDACC__
#define NANGUARD_HOST_DEVICE __host__ __device__
#else
#define NANGUARD_HOST_DEVICE
#endif

namespace nanguard {

/// Largest finite float16 value, (2 - 2^-10) * 2^15.
constexpr double fp16_max = 65504.0;
/// Smallest normal float16 value (2^-14); below it values are subnormal or zero.
constexpr double fp16_min_normal = 6.103515625e-05;
/// Largest finite bfloat16 value, (2 - 2^-7) * 2^127.
constexpr double bf16_max = 3.3895313892515355e38;

/// Smallest magnitude that becomes Inf when cast to float16: the midpoint
/// between fp16_max and 2^16, which round to nearest even takes up to 2^16
/// (65504 < |x| < 65520 rounds down to 65504).
constexpr double fp16_rounds_to_inf = 65520.0;
/// Smallest magnitude that becomes Inf when cast to bfloat16: the midpoint
/// between bf16_max and 2^128, (2 - 2^-8) * 2^127 (a float32 value).
constexpr double bf16_rounds_to_inf = 3.3961775292304459e38;

/// True when `x` becomes Inf (or stays infinite) once cast to float16 as
/// torch casts: float64 through float32, whose rounding can reach the
/// threshold first. For the census's fp16_overflow count.
NANGUARD_HOST_DEVICE constexpr bool inf_in_fp16(double x) {
  const float a = float(x < 0 ? -x : x);
  return a >= float(fp16_rounds_to_inf);
}
/// The same for bfloat16 (bf16_overflow).
NANGUARD_HOST_DEVICE constexpr bool inf_in_bf16(double x) {
  const float a = float(x < 0 ? -x : x);
  return a >= float(bf16_rounds_to_inf);
}

}  // namespace nanguard

#undef NANGUARD_HOST_DEVICE
