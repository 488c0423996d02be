/// @file float_formats.h
/// The limits of the 16-bit float formats: where float16 and bfloat16
/// overflow and where float16 loses precision. Plain constants, for host
/// and device code alike (this header includes nothing).
#pragma once

namespace nanguard {

/// Largest finite float16 value, (2 - 2^-10) * 2^15.
constexpr double fp16_max = 65504.0;
/// Smallest normal float16 value (2^-14); below it values are subnormal or zero.
constexpr double fp16_min_normal = 6.103515625e-05;
/// Largest finite bfloat16 value, (2 - 2^-7) * 2^127.
constexpr double bf16_max = 3.3895313892515355e38;

}  // namespace nanguard
