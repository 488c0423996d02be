// support.h — what the C++ test files share.
#pragma once

#include <nanguard/events.h>
#include <nanguard/policy.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

namespace nanguard {

// gtest prints nanguard's enums by their names.
inline void PrintTo(policy p, std::ostream* os) { *os << to_string(p); }
inline void PrintTo(action a, std::ostream* os) { *os << to_string(a); }
inline void PrintTo(verdict v, std::ostream* os) { *os << '"' << to_string(v) << '"'; }

}  // namespace nanguard

namespace nanguard::test {

/// The warnings (TORCH_WARN) raised on this thread while it lives, a line each.
class captured_warnings : public c10::WarningHandler {
 public:
  captured_warnings() : guard_(this) {}
  void process(const c10::Warning& w) override { text_ += w.msg() + "\n"; }
  const std::string& text() const { return text_; }

 private:
  std::string text_;
  c10::WarningUtils::WarningHandlerGuard guard_;
};

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

/// The message of the c10::Error that `fn` throws, without its backtrace;
/// "" when it throws none. Tests check the message, not only that it threw.
template <typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

/// True when `a` and `b` have the same dtype, shape and values, a NaN
/// matching a NaN (at::equal says NaN != NaN).
inline bool same_values(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) return false;
  if (!a.is_floating_point()) return at::equal(a, b);
  return at::equal(a.isnan(), b.isnan()) && at::equal(a.nan_to_num(0, 0, 0), b.nan_to_num(0, 0, 0)) &&
         at::equal(a.isinf() & (a > 0), b.isinf() & (b > 0)) && at::equal(a.isinf() & (a < 0), b.isinf() & (b < 0));
}

/// The finite values of column `j` of a [rows, features] tensor, sorted.
inline std::vector<double> finite_sorted(const at::Tensor& x, int64_t j) {
  const at::Tensor c = x.select(1, j).to(at::kDouble).contiguous();
  std::vector<double> v;
  for (int64_t i = 0; i < c.numel(); ++i) {
    const double e = c.data_ptr<double>()[i];
    if (std::isfinite(e)) v.push_back(e);
  }
  std::sort(v.begin(), v.end());
  return v;
}

/// numpy.quantile(sorted, q) with linear interpolation: the reference.
inline double np_quantile(const std::vector<double>& sorted, double q) {
  const double pos = q * double(sorted.size() - 1);
  const size_t lo = size_t(std::floor(pos)), hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - double(lo));
}

}  // namespace nanguard::test
