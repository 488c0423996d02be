// column_stats.h — streaming per-feature statistics of a dataset, in bounded memory.
//
// Feed batches of [rows, features]; get, per feature, the counts of NaN and
// ±Inf, the mean and std of the finite values (Welford/Chan, exact), min and
// max, approximate quantiles, the median and the MAD, and the features that
// are constant (their std is 0: normalising them divides by zero). The
// quantiles come from a uniform reservoir sample of rows (the same sample an
// isolation forest can be fitted on), so memory is
// reservoir_rows × features × 8 bytes whatever the size of the data.
//
//   nanguard::column_stats stats;
//   for (auto& batch : loader) stats.update(batch);   // [rows, features]
//   at::Tensor p999 = stats.quantile(0.999);          // [features]
//   for (int64_t j : stats.constant_columns()) warn(j);
//   at::Tensor z = stats.robust_zscore(batch);        // |z| > 3.5: outlier
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <vector>

namespace nanguard {

/// Options of `column_stats`.
struct column_stats_options {
  /// Rows kept in the uniform reservoir sample behind the quantiles; they are
  /// exact while the data has at most this many rows.
  TORCH_ARG(int64_t, reservoir_rows) = 32768;
  /// Seed of the reservoir sampling: the same data and seed give the same sample.
  TORCH_ARG(uint64_t, seed) = 0;
};

/// Streaming statistics of each column of a [rows, features] dataset.
///
/// NOTE: mean, std, min and max are exact (over finite values); quantiles,
/// median and MAD are exact up to reservoir_rows rows and approximate beyond,
/// with the rank error given by `quantile_rank_error`.
class column_stats {
 public:
  /// Empty statistics; the number of features is set by the first batch.
  explicit column_stats(column_stats_options options = {});

  /// Adds the rows of `batch` ([rows, features], any floating dtype, or 1-D
  /// for one feature). Every batch must have the same number of features.
  void update(const at::Tensor& batch);

  /// Rows seen so far.
  int64_t rows() const { return rows_; }
  /// Features (columns); 0 before the first batch.
  int64_t features() const { return int64_t(count_.size()); }

  /// Finite values per feature ([features], int64).
  at::Tensor finite_count() const;
  /// NaN values per feature ([features], int64).
  at::Tensor nan_count() const;
  /// +Inf values per feature ([features], int64).
  at::Tensor posinf_count() const;
  /// -Inf values per feature ([features], int64).
  at::Tensor neginf_count() const;
  /// Mean of the finite values ([features], float64; NaN when none).
  at::Tensor mean() const;
  /// Population std (ddof = 0) of the finite values ([features], float64).
  at::Tensor std() const;
  /// Smallest finite value ([features], float64; NaN when none).
  at::Tensor min() const;
  /// Largest finite value ([features], float64; NaN when none).
  at::Tensor max() const;
  /// The q-quantile of the finite values, linear interpolation as numpy's
  /// default ([features], float64). REQUIRES: 0 <= q <= 1.
  at::Tensor quantile(double q) const;
  /// The median of the finite values ([features], float64).
  at::Tensor median() const;
  /// Median absolute deviation from the median, unscaled ([features]).
  at::Tensor mad() const;

  /// Features whose finite values are all equal (or that have none): their
  /// std is 0 and normalising them gives NaN.
  std::vector<int64_t> constant_columns() const;

  /// (x - mean) / std per element of `batch` ([rows, features] float64); NaN
  /// where x is not finite or the feature's std is 0. |z| > 3: the 3σ rule.
  at::Tensor zscore(const at::Tensor& batch) const;
  /// The robust z-score 0.6745 (x - median) / MAD (Iglewicz & Hoaglin);
  /// NaN where x is not finite or MAD is 0. |z| > 3.5 is the usual cut.
  at::Tensor robust_zscore(const at::Tensor& batch) const;

  /// The reservoir: a uniform sample of min(rows, reservoir_rows) rows
  /// ([n, features], float64), in no particular order.
  at::Tensor sample() const;

  /// Bound on the rank error of `quantile(q)`: the returned value's true
  /// quantile lies within q ± this (4σ of the sampling error, i.e. with
  /// probability > 99.99%); 0 while the quantiles are exact.
  double quantile_rank_error(double q) const;

 private:
  void check_batch(const at::Tensor& batch, const char* fn) const;
  std::vector<double> column_sorted(int64_t j) const;  // finite reservoir values of column j

  column_stats_options options_;
  int64_t rows_ = 0;
  std::vector<int64_t> count_, nan_, posinf_, neginf_;
  std::vector<double> mean_, min_, max_;
  std::vector<long double> m2_;  // a double overflows past deviations of about 1e154
  std::vector<double> reservoir_;  // row-major, up to reservoir_rows rows
  uint64_t rng_state_;
};

}  // namespace nanguard
