// dtype_limits.h — the largest finite value of each floating dtype.
#pragma once

#include "nanguard/float_formats.h"

#include <c10/core/ScalarType.h>

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

}  // namespace nanguard::detail
