// dtype_limits.h — the limits of each floating dtype: its largest finite
// value, its smallest normal value and its epsilon.
#pragma once

#include "nanguard/float_formats.h"

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <limits>

namespace nanguard::detail {

/// The largest finite value of float64, float32, float16 or bfloat16; 0 for
/// any other dtype.
inline double largest_finite(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return std::numeric_limits<double>::max();
    case at::kFloat: return double(std::numeric_limits<float>::max());
    case at::kHalf: return fp16_max;
    case at::kBFloat16: return bf16_max;
    default: return 0;
  }
}

/// The smallest normal value of float64, float32, float16 or bfloat16 (below
/// it, values are subnormal or flushed to 0); 0 for any other dtype.
inline double smallest_normal(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return std::numeric_limits<double>::min();
    case at::kFloat: return double(std::numeric_limits<float>::min());
    case at::kHalf: return fp16_min_normal;
    case at::kBFloat16: return double(std::numeric_limits<c10::BFloat16>::min());
    default: return 0;
  }
}

/// The gap between 1 and the next value of float64, float32, float16 or
/// bfloat16 (1 - 1e-6 is 1 in float16); 0 for any other dtype.
inline double epsilon(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return std::numeric_limits<double>::epsilon();
    case at::kFloat: return double(std::numeric_limits<float>::epsilon());
    case at::kHalf: return double(std::numeric_limits<c10::Half>::epsilon());
    case at::kBFloat16: return double(std::numeric_limits<c10::BFloat16>::epsilon());
    default: return 0;
  }
}

}  // namespace nanguard::detail
