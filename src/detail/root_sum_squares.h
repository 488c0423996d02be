// root_sum_squares.h — sqrt(Σ w·x²) of a few values that may lie near
// float64's limits: a norm of norms (the sentinel's total gradient norm),
// merge_census's L2 norm and pooled standard deviation.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace nanguard::detail {

/// sqrt(Σ weights[i] · values[i]²) (every weight 1 when none are given),
/// scaled by the largest |value| so that no square overflows or underflows
/// on the way, as std::hypot does for two: finite wherever the result is.
/// A NaN among the values gives NaN, an Inf (and no NaN) Inf.
inline double root_sum_squares(const std::vector<double>& values, const std::vector<double>& weights = {}) {
  double largest = 0;
  for (const double v : values) {
    if (std::isnan(v)) return v;
    largest = std::max(largest, std::fabs(v));
  }
  if (largest == 0 || std::isinf(largest)) return largest;
  double sum = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const double r = values[i] / largest;
    sum += (weights.empty() ? 1.0 : weights[i]) * r * r;
  }
  return largest * std::sqrt(sum);
}

}  // namespace nanguard::detail
