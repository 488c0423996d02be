// value_range.h — an interval that holds every value of a tensor, and the
// interval arithmetic the tracer uses to know an op's output is finite
// without reading it (see range_rules.h).
#pragma once

#include <algorithm>
#include <cmath>

namespace at {
class Tensor;
}  // namespace at

namespace nanguard::detail {

/// Every value of a tensor lies in [lo, hi]. A NaN anywhere makes both
/// bounds NaN; an infinity makes its bound infinite.
struct value_range {
  double lo = 0, hi = 0;

  static value_range of(double v) { return {v, v}; }
  static value_range symmetric(double magnitude) { return {-magnitude, magnitude}; }

  bool finite() const { return std::isfinite(lo) && std::isfinite(hi); }
  /// The largest |x|.
  double magnitude() const { return std::max(std::fabs(lo), std::fabs(hi)); }
  bool contains_zero() const { return lo <= 0 && hi >= 0; }

  /// The smallest interval holding both.
  value_range hull(const value_range& o) const { return {std::min(lo, o.lo), std::max(hi, o.hi)}; }
  /// Each bound moved away from zero by `relative` of itself: room for the
  /// rounding of the float arithmetic the op does.
  value_range widened(double relative) const {
    return {lo - std::fabs(lo) * relative, hi + std::fabs(hi) * relative};
  }
};

inline value_range operator+(const value_range& a, const value_range& b) { return {a.lo + b.lo, a.hi + b.hi}; }

inline value_range operator-(const value_range& a) { return {-a.hi, -a.lo}; }

inline value_range operator*(const value_range& a, const value_range& b) {
  const double p[] = {a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi};
  return {*std::min_element(p, p + 4), *std::max_element(p, p + 4)};
}

inline value_range operator*(const value_range& a, double s) { return a * value_range::of(s); }

/// a / b for b that excludes zero (callers check `contains_zero` first).
inline value_range operator/(const value_range& a, const value_range& b) {
  return a * value_range{1 / b.hi, 1 / b.lo};
}

/// The range of a floating-point tensor's values, read in one pass on the
/// calling thread (the tracer's scan: about as fast as has_nonfinite).
value_range value_range_on_this_thread(const at::Tensor& x);

}  // namespace nanguard::detail
