// tensor_stats.h — what a census (census.h) finds in one tensor: counts of
// NaN, Inf, zeros and subnormals, the range and moments of the finite
// values, fp16/bf16 headroom, and the first non-finite element. Only the
// record: the census itself, which reads tensors, is in census.h.
//
//   nanguard::tensor_stats s = nanguard::census(x);
//   if (!s.all_finite()) std::cerr << s.nan << " NaN, first at " << s.first_nonfinite_index << "\n";
#pragma once

#include <cstdint>
#include <limits>

namespace nanguard {

/// Statistics of one tensor, gathered in one pass by `census`.
struct tensor_stats {
  int64_t numel = 0;      ///< number of elements (logical, for views too)
  int64_t nan = 0;        ///< NaN elements
  int64_t pos_inf = 0;    ///< +Inf elements
  int64_t neg_inf = 0;    ///< -Inf elements
  int64_t finite = 0;     ///< finite elements (numel - nan - pos_inf - neg_inf)
  int64_t zeros = 0;      ///< elements equal to +0 or -0
  int64_t subnormal = 0;  ///< subnormal elements in the tensor's own dtype

  // Over the finite elements; NaN when there are none.
  double min = std::numeric_limits<double>::quiet_NaN();   ///< smallest finite value
  double max = std::numeric_limits<double>::quiet_NaN();   ///< largest finite value
  double mean = std::numeric_limits<double>::quiet_NaN();  ///< mean of finite values
  double std = std::numeric_limits<double>::quiet_NaN();   ///< population std (ddof = 0)
  double l2_norm = 0;  ///< sqrt(sum x^2) over finite values
  double absmax = 0;   ///< largest |x| over finite values

  // Precision headroom of the finite values.
  // The overflow counts are of values that become Inf once cast (rounded to
  // nearest even, as torch casts: float64 through float32), not of all those
  // beyond the largest finite value: 65504 < |x| < 65520 rounds to 65504.
  int64_t fp16_overflow = 0;   ///< |x| >= 65520: Inf once cast to float16
  int64_t fp16_underflow = 0;  ///< 0 < |x| < 6.1035e-5: subnormal or zero in float16
  int64_t bf16_overflow = 0;   ///< |x| >= 3.3962e38: Inf once cast to bfloat16

  /// Flat (row-major, logical) index of the first non-finite element; -1 if none.
  int64_t first_nonfinite_index = -1;
  /// Value of that element (NaN, +Inf or -Inf); 0 if none.
  double first_nonfinite_value = 0;

  /// Number of NaN and infinite elements.
  int64_t nonfinite() const { return nan + pos_inf + neg_inf; }
  /// True when every element is finite (an empty tensor is).
  bool all_finite() const { return nonfinite() == 0; }
};

/// Calls `visit(name, field)` for each field of tensor_stats, in order;
/// `field` is a pointer to an int64_t or a double member. The one list of
/// the fields by name, for whatever writes or reads them all (a finding's
/// JSON, the Python module's TensorStats), so that a new field reaches each.
///
///   const nanguard::tensor_stats s = nanguard::census(x);
///   nanguard::for_each_stats_field([&](const char* name, auto field) { std::cout << name << '=' << s.*field; });
template <typename Visit>
void for_each_stats_field(Visit&& visit) {
  visit("numel", &tensor_stats::numel);
  visit("nan", &tensor_stats::nan);
  visit("pos_inf", &tensor_stats::pos_inf);
  visit("neg_inf", &tensor_stats::neg_inf);
  visit("finite", &tensor_stats::finite);
  visit("zeros", &tensor_stats::zeros);
  visit("subnormal", &tensor_stats::subnormal);
  visit("min", &tensor_stats::min);
  visit("max", &tensor_stats::max);
  visit("mean", &tensor_stats::mean);
  visit("std", &tensor_stats::std);
  visit("l2_norm", &tensor_stats::l2_norm);
  visit("absmax", &tensor_stats::absmax);
  visit("fp16_overflow", &tensor_stats::fp16_overflow);
  visit("fp16_underflow", &tensor_stats::fp16_underflow);
  visit("bf16_overflow", &tensor_stats::bf16_overflow);
  visit("first_nonfinite_index", &tensor_stats::first_nonfinite_index);
  visit("first_nonfinite_value", &tensor_stats::first_nonfinite_value);
}

}  // namespace nanguard
