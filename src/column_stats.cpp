#include "nanguard/column_stats.h"

#include "nanguard/spelling.h"

#include "detail/median.h"
#include "detail/random.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace nanguard {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

at::Tensor to_tensor(const std::vector<double>& v) {
  at::Tensor t = at::empty({int64_t(v.size())}, at::kDouble);
  if (!v.empty()) std::memcpy(t.data_ptr<double>(), v.data(), v.size() * sizeof(double));
  return t;
}

at::Tensor to_tensor(const std::vector<int64_t>& v) {
  at::Tensor t = at::empty({int64_t(v.size())}, at::kLong);
  if (!v.empty()) std::memcpy(t.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
  return t;
}

// numpy's default ("linear") quantile of sorted values.
double sorted_quantile(const std::vector<double>& s, double q) {
  if (s.empty()) return kNaN;
  const double pos = q * double(s.size() - 1);
  const size_t lo = size_t(std::floor(pos));
  const size_t hi = std::min(lo + 1, s.size() - 1);
  return detail::lerp(s[lo], s[hi], pos - double(lo));
}

// Column j's sum and its sum of squared deviations from `mean`, in long
// double, for the rare column whose double sums overflow: squares of
// deviations past about 1e154, sums of values near 1e308. An inf m2 made
// std() 0 (the merge's inf * 0 is NaN) and an inf sum made mean() inf.
long double wide_sum(const double* x, int64_t n, int64_t f, int64_t j) {
  long double s = 0;
  for (int64_t i = 0; i < n; ++i)
    if (std::isfinite(x[i * f + j])) s += x[i * f + j];
  return s;
}
long double wide_squared_deviations(const double* x, int64_t n, int64_t f, int64_t j, long double mean) {
  long double s = 0;
  for (int64_t i = 0; i < n; ++i)
    if (std::isfinite(x[i * f + j])) s += (x[i * f + j] - mean) * (x[i * f + j] - mean);
  return s;
}

at::Tensor as_matrix(const at::Tensor& batch) {
  at::Tensor b = batch.dim() == 1 ? batch.unsqueeze(1) : batch;
  return b.to(at::kCPU, at::kDouble).contiguous();
}

}  // namespace

column_stats::column_stats(column_stats_options options)
    : options_(options), rng_state_(detail::splitmix64(options.seed() ^ 0x6e616e6775617264ULL)) {
  TORCH_CHECK(options_.reservoir_rows() >= 1, "nanguard::column_stats: reservoir_rows must be at "
              "least 1 but is ", options_.reservoir_rows(), "; the default is 32768");
}

void column_stats::check_batch(const at::Tensor& batch, const char* fn) const {
  TORCH_CHECK(batch.defined(), "nanguard::column_stats::", fn, ": the batch is undefined");
  TORCH_CHECK(batch.dim() == 2 || batch.dim() == 1, "nanguard::column_stats::", fn,
              ": expected a [rows, features] (or 1-D) tensor but got shape ", batch.sizes(),
              "; flatten each sample to one row first (x.flatten(1))");
  TORCH_CHECK_TYPE(batch.is_floating_point(), "nanguard::column_stats::", fn,
                   ": expected a floating-point tensor but got ", batch.scalar_type(),
                   "; convert it with ", spelled("x.to(at::kFloat)", "x.float()"));
  const int64_t f = batch.dim() == 1 ? 1 : batch.size(1);
  TORCH_CHECK(features() == 0 || f == features(), "nanguard::column_stats::", fn,
              ": the batch has ", f, " features but the statistics were fitted on ", features(),
              "; every batch must have the same columns");
}

void column_stats::update(const at::Tensor& batch) {
  check_batch(batch, "update");
  const at::Tensor b = as_matrix(batch);
  const int64_t n = b.size(0), f = b.size(1);
  if (features() == 0) {
    count_.assign(f, 0);
    nan_.assign(f, 0);
    posinf_.assign(f, 0);
    neginf_.assign(f, 0);
    mean_.assign(f, 0.0);
    m2_.assign(f, 0.0);
    min_.assign(f, std::numeric_limits<double>::infinity());
    max_.assign(f, -std::numeric_limits<double>::infinity());
  }
  if (n == 0) return;
  const double* x = b.data_ptr<double>();
  // Per-batch count and sum, then the deviations from the batch mean (two
  // passes, accurate), merged into the running moments with Chan's formula.
  std::vector<int64_t> cnt(f, 0);
  std::vector<double> sum(f, 0.0), dev2(f, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const double* row = x + i * f;
    for (int64_t j = 0; j < f; ++j) {
      const double v = row[j];
      if (std::isfinite(v)) {
        ++cnt[j];
        sum[j] += v;
        min_[j] = std::min(min_[j], v);
        max_[j] = std::max(max_[j], v);
      } else if (std::isnan(v)) {
        ++nan_[j];
      } else {
        ++(v > 0 ? posinf_ : neginf_)[j];
      }
    }
  }
  std::vector<double> bmean(f);  // finite: a mean of finite values
  for (int64_t j = 0; j < f; ++j)
    if (cnt[j]) bmean[j] = std::isfinite(sum[j]) ? sum[j] / double(cnt[j]) : double(wide_sum(x, n, f, j) / cnt[j]);
  for (int64_t i = 0; i < n; ++i) {
    const double* row = x + i * f;
    for (int64_t j = 0; j < f; ++j) {
      const double v = row[j];
      if (std::isfinite(v)) {
        const double d = v - bmean[j];
        dev2[j] += d * d;
      }
    }
  }
  for (int64_t j = 0; j < f; ++j) {
    if (cnt[j] == 0) continue;
    const long double na = count_[j], nb = cnt[j], nt = na + nb;
    const long double delta = static_cast<long double>(bmean[j]) - mean_[j];
    const long double batch_m2 =
        std::isfinite(dev2[j]) ? dev2[j] : wide_squared_deviations(x, n, f, j, bmean[j]);
    mean_[j] = double(mean_[j] + delta * nb / nt);
    m2_[j] += batch_m2 + delta * delta * (na * nb / nt);
    count_[j] += cnt[j];
  }
  // Reservoir sampling of rows (Vitter's algorithm R).
  const int64_t cap = options_.reservoir_rows();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t seen = rows_ + i;  // rows before this one
    if (seen < cap) {
      reservoir_.insert(reservoir_.end(), x + i * f, x + (i + 1) * f);
    } else {
      const uint64_t r = detail::next_random(rng_state_) % uint64_t(seen + 1);
      if (r < uint64_t(cap)) std::memcpy(reservoir_.data() + r * f, x + i * f, f * sizeof(double));
    }
  }
  rows_ += n;
}

at::Tensor column_stats::finite_count() const { return to_tensor(count_); }
at::Tensor column_stats::nan_count() const { return to_tensor(nan_); }
at::Tensor column_stats::posinf_count() const { return to_tensor(posinf_); }
at::Tensor column_stats::neginf_count() const { return to_tensor(neginf_); }

at::Tensor column_stats::mean() const {
  std::vector<double> m(mean_);
  for (size_t j = 0; j < m.size(); ++j)
    if (count_[j] == 0) m[j] = kNaN;
  return to_tensor(m);
}

at::Tensor column_stats::std() const {
  std::vector<double> s(m2_.size());
  for (size_t j = 0; j < s.size(); ++j)
    s[j] = count_[j] ? double(std::sqrt(m2_[j] / count_[j])) : kNaN;
  return to_tensor(s);
}

at::Tensor column_stats::min() const {
  std::vector<double> m(min_);
  for (size_t j = 0; j < m.size(); ++j)
    if (count_[j] == 0) m[j] = kNaN;
  return to_tensor(m);
}

at::Tensor column_stats::max() const {
  std::vector<double> m(max_);
  for (size_t j = 0; j < m.size(); ++j)
    if (count_[j] == 0) m[j] = kNaN;
  return to_tensor(m);
}

std::vector<double> column_stats::column_sorted(int64_t j) const {
  const int64_t f = features();
  const int64_t n = f ? int64_t(reservoir_.size()) / f : 0;
  std::vector<double> v;
  v.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const double x = reservoir_[size_t(i * f + j)];
    if (std::isfinite(x)) v.push_back(x);
  }
  std::sort(v.begin(), v.end());
  return v;
}

at::Tensor column_stats::quantile(double q) const {
  TORCH_CHECK(q >= 0 && q <= 1, "nanguard::column_stats::quantile: q must be in [0, 1] but is ", q,
              "; for the 99.9th percentile pass 0.999");
  std::vector<double> out(static_cast<size_t>(features()), 0.0);
  for (int64_t j = 0; j < features(); ++j) {
    const std::vector<double> s = column_sorted(j);
    out[size_t(j)] = sorted_quantile(s, q);
    // The exact extremes are known: never report a quantile outside them.
    if (!s.empty()) out[size_t(j)] = std::clamp(out[size_t(j)], min_[j], max_[j]);
  }
  return to_tensor(out);
}

at::Tensor column_stats::median() const { return quantile(0.5); }

at::Tensor column_stats::mad() const {
  std::vector<double> out(static_cast<size_t>(features()), 0.0);
  for (int64_t j = 0; j < features(); ++j) {
    std::vector<double> s = column_sorted(j);
    const double med = sorted_quantile(s, 0.5);
    for (double& x : s) x = std::fabs(x - med);
    std::sort(s.begin(), s.end());
    out[size_t(j)] = sorted_quantile(s, 0.5);
  }
  return to_tensor(out);
}

std::vector<int64_t> column_stats::constant_columns() const {
  std::vector<int64_t> out;
  for (int64_t j = 0; j < features(); ++j)
    if (count_[j] == 0 || min_[j] == max_[j]) out.push_back(j);
  return out;
}

at::Tensor column_stats::zscore(const at::Tensor& batch) const {
  check_batch(batch, "zscore");
  TORCH_CHECK(rows_ > 0, "nanguard::column_stats::zscore: no data yet; call update() first");
  const at::Tensor s = std();
  const at::Tensor safe = at::where(s > 0, s, at::full_like(s, kNaN));
  const at::Tensor z = (as_matrix(batch) - mean()) / safe;
  return at::where(at::isfinite(z), z, at::full_like(z, kNaN));  // non-finite x: no z-score
}

at::Tensor column_stats::robust_zscore(const at::Tensor& batch) const {
  check_batch(batch, "robust_zscore");
  TORCH_CHECK(rows_ > 0, "nanguard::column_stats::robust_zscore: no data yet; call update() first");
  const at::Tensor m = mad();
  const at::Tensor safe = at::where(m > 0, m, at::full_like(m, kNaN));
  at::Tensor z = 0.6745 * (as_matrix(batch) - median()) / safe;
  // Non-finite inputs have no z-score.
  return at::where(at::isfinite(z), z, at::full_like(z, kNaN));
}

at::Tensor column_stats::sample() const {
  const int64_t f = features();
  const int64_t n = f ? int64_t(reservoir_.size()) / f : 0;
  at::Tensor t = at::empty({n, f}, at::kDouble);
  if (n) std::memcpy(t.data_ptr<double>(), reservoir_.data(), reservoir_.size() * sizeof(double));
  return t;
}

double column_stats::quantile_rank_error(double q) const {
  if (rows_ <= options_.reservoir_rows()) return 0.0;
  const double k = double(options_.reservoir_rows());
  return 4.0 * std::sqrt(std::max(q * (1 - q), 1.0 / k) / k) + 1.0 / k;
}

}  // namespace nanguard
