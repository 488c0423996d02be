// census.h — one-pass statistics of a floating-point tensor.
//
// The census is what every other part of nanguard looks at a tensor with: the
// tracer, the sentinel, the precision advisor and the data firewall. It reads
// each element once, vectorised and in parallel, and is cheap enough to run
// on every op output (see bench/census_bench.cpp for the figures).
//
//   at::Tensor g = model->weight.grad();
//   if (nanguard::has_nonfinite(g)) {
//     nanguard::tensor_stats s = nanguard::census(g);
//     std::cerr << s << "\n";  // nan=3 +inf=0 -inf=0 ... first bad [17] = nan
//   }
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <iosfwd>
#include <limits>
#include <string>
#include <vector>

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

/// Gathers `tensor_stats` of `x` in one vectorised, parallel pass.
///
/// REQUIRES: `x` is float32, float64, float16 or bfloat16; it may be any
/// view (strided, expanded, zero-stride) and empty. Tensors not on the CPU
/// are measured with ATen ops on their device.
/// Throws c10::Error for integer, bool or complex tensors, and for undefined,
/// sparse or meta tensors (no values to read), with what to pass instead.
///
///   auto s = nanguard::census(logits);
///   if (s.fp16_overflow) { /* keep this layer in fp32 */ }
tensor_stats census(const at::Tensor& x);

/// True when `x` holds a NaN or an Inf. Stops at the first one it finds.
///
/// Cheaper than `census`: use it as the fast check, then take a census of
/// the tensors it flags. Integer and bool tensors are always finite (false);
/// a complex tensor is checked through its real and imaginary parts; an
/// undefined, sparse or meta tensor throws.
bool has_nonfinite(const at::Tensor& x);

/// The census of a tensor made of `parts` (the shards of a sharded tensor),
/// from the census of each part: counts summed, min/max/absmax over the
/// parts, mean and std pooled over their finite elements, the L2 norm of
/// their norms (summed scaled where their squares pass float64's range, as
/// census does), and the first non-finite element the one with the smallest
/// index.
///
/// REQUIRES: each part's first_nonfinite_index is already an index into the
/// whole tensor (a shard's own index plus where the shard starts).
///
///   auto whole = nanguard::merge_census({nanguard::census(x0), nanguard::census(x1)});
tensor_stats merge_census(const std::vector<tensor_stats>& parts);

/// One line, e.g. `n=1024 nan=1 +inf=0 -inf=0 zero=3 min=-2.1 max=3.3 ...`.
std::string to_string(const tensor_stats& s);

/// Writes `to_string(s)`.
std::ostream& operator<<(std::ostream& os, const tensor_stats& s);

}  // namespace nanguard
