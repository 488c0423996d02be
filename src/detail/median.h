// median.h — the median of a series of values (the upper one of an even
// count), as the diagnosis and the guard read a run's losses; and the
// interpolation between two values that medians and quantiles use, which
// stays finite for finite values up to DBL_MAX.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace nanguard::detail {

/// The median of `v` (of an even count, the upper middle value); NaN when empty.
inline double median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

/// a + (b - a) * t for t in [0, 1], as numpy's linear quantile computes it
/// (bit for bit); finite for finite a and b, where b - a overflows
/// (-1.7e308 and 1.7e308).
inline double lerp(double a, double b, double t) {
  const double d = b - a;
  if (std::isfinite(d)) return a + d * t;
  return a * (1 - t) + b * t;  // a and b have opposite signs: neither product nor sum can overflow
}

/// (a + b) / 2, finite for finite a and b, where a + b overflows (1.7e308
/// and 1.75e308).
inline double midpoint(double a, double b) {
  const double sum = a + b;
  if (std::isfinite(sum)) return sum / 2;
  return a / 2 + b / 2;  // halving a value this large is exact
}

}  // namespace nanguard::detail
