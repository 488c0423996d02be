// firewall.h — validate, repair or drop the samples of a batch before training.
//
// Bad data causes a large share of NaNs in training. The firewall checks each
// [batch, features] tensor for NaN / ±Inf values and (once fitted on the
// training data) for values outside the fitted range, and acts with a policy
// per problem: raise, drop the sample, or repair it (nan_to_num, median
// imputation, clipping to the fitted bounds). It returns the cleaned batch
// and a report of what it did: which rows, which columns, how many values.
//
//   nanguard::firewall fw(nanguard::firewall_options()
//                             .nonfinite(nanguard::nonfinite_policy::impute_median)
//                             .outliers(nanguard::outlier_policy::clip));
//   fw.fit(train_x);                         // or fit(column_stats) from a stream
//   auto [x, report] = fw.apply(batch);      // x: cleaned batch, same dtype
//   if (!report.clean()) std::cerr << nanguard::to_string(report) << "\n";
#pragma once

#include <nanguard/column_stats.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace nanguard {

/// What to do with NaN and ±Inf values.
enum class nonfinite_policy {
  raise,          ///< throw c10::Error naming the row, column and value
  drop,           ///< drop the samples (rows) that hold one
  nan_to_num,     ///< replace: NaN by nan_value, ±Inf by the fitted max/min
  impute_median,  ///< replace by the feature's median (fitted, else the batch's);
                  ///< a feature with no finite value has none: fit/apply throw
  ignore,         ///< count them, change nothing
};

/// Every nonfinite_policy, in declaration order.
inline constexpr nonfinite_policy all_nonfinite_policies[] = {nonfinite_policy::raise, nonfinite_policy::drop,
                                                              nonfinite_policy::nan_to_num,
                                                              nonfinite_policy::impute_median, nonfinite_policy::ignore};
/// "raise", "drop", "nan_to_num", "impute_median", "ignore".
const char* to_string(nonfinite_policy p);
/// The nonfinite_policy whose to_string is `name`. Throws c10::Error listing the names for another.
nonfinite_policy nonfinite_policy_from_string(const std::string& name);

/// What to do with finite values outside the fitted bounds (see outlier_rule).
enum class outlier_policy {
  ignore,  ///< do not look for outliers
  raise,   ///< throw c10::Error naming the row, column, value and bounds
  drop,    ///< drop the samples that hold one
  clip,    ///< clamp them to the bounds
};

/// Every outlier_policy, in declaration order.
inline constexpr outlier_policy all_outlier_policies[] = {outlier_policy::ignore, outlier_policy::raise,
                                                          outlier_policy::drop, outlier_policy::clip};
/// "ignore", "raise", "drop", "clip".
const char* to_string(outlier_policy p);
/// The outlier_policy whose to_string is `name`. Throws c10::Error listing the names for another.
outlier_policy outlier_policy_from_string(const std::string& name);

/// How the firewall's bounds of each feature are set from the fitted data.
enum class outlier_rule {
  quantile_range,  ///< [quantile(low_quantile), quantile(high_quantile)]
  three_sigma,     ///< mean ± sigmas · std
  robust_z,        ///< median ± robust_z · MAD / 0.6745 (robust z-score); none where MAD = 0
};

/// Every outlier_rule, in declaration order.
inline constexpr outlier_rule all_outlier_rules[] = {outlier_rule::quantile_range, outlier_rule::three_sigma,
                                                     outlier_rule::robust_z};
/// "quantile_range", "three_sigma", "robust_z".
const char* to_string(outlier_rule r);
/// The outlier_rule whose to_string is `name`, e.g. "robust_z". Throws c10::Error listing the names for another.
///
///   auto options = nanguard::firewall_options().rule(nanguard::outlier_rule_from_string("robust_z"));
outlier_rule outlier_rule_from_string(const std::string& name);

/// Options of `firewall`.
struct firewall_options {
  /// Policy for NaN and ±Inf values.
  TORCH_ARG(nonfinite_policy, nonfinite) = nonfinite_policy::raise;
  /// Policy for finite values outside the bounds; needs fit().
  TORCH_ARG(outlier_policy, outliers) = outlier_policy::ignore;
  /// How the bounds are set.
  TORCH_ARG(outlier_rule, rule) = outlier_rule::quantile_range;
  /// Lower quantile of outlier_rule::quantile_range.
  TORCH_ARG(double, low_quantile) = 0.001;
  /// Upper quantile of outlier_rule::quantile_range.
  TORCH_ARG(double, high_quantile) = 0.999;
  /// Width of outlier_rule::three_sigma, in standard deviations.
  TORCH_ARG(double, sigmas) = 3.0;
  /// Threshold of outlier_rule::robust_z on |0.6745 (x - median) / MAD|. 5
  /// (5σ for normal data) leaves a clean N(0, 1) value out with probability
  /// 5.7e-7: a clean row of 100 features 0.006% of the time; 3.5, the usual
  /// cut for flagging values to inspect, drops 0.05% per feature (2% of the
  /// rows of 40 features). docs/data-firewall.md.
  TORCH_ARG(double, robust_z) = 5.0;
  /// nan_to_num: the value that replaces NaN.
  TORCH_ARG(double, nan_value) = 0.0;
  /// nan_to_num: the value for +Inf; default the fitted max, else the dtype's max.
  TORCH_ARG(c10::optional<double>, posinf_value) = c10::nullopt;
  /// nan_to_num: the value for -Inf; default the fitted min, else the dtype's lowest.
  TORCH_ARG(c10::optional<double>, neginf_value) = c10::nullopt;
  /// Columns that are never repaired or clipped (labels, ids): a row with a
  /// non-finite value there is dropped (or raises under nonfinite_policy::raise).
  TORCH_ARG(std::vector<int64_t>, label_columns) = {};
  /// Column names for messages and reports (optional).
  TORCH_ARG(std::vector<std::string>, column_names) = {};
};

/// What the firewall found and did in one column.
struct column_report {
  int64_t nan = 0;       ///< NaN values found
  int64_t pos_inf = 0;   ///< +Inf values found
  int64_t neg_inf = 0;   ///< -Inf values found
  int64_t outliers = 0;  ///< finite values outside the bounds
  int64_t repaired = 0;  ///< non-finite values replaced
  int64_t clipped = 0;   ///< outliers clamped to the bounds
};

/// What the firewall found in a batch and what it did.
struct firewall_report {
  int64_t rows_in = 0;                 ///< rows of the input batch
  int64_t rows_out = 0;                ///< rows of the cleaned batch
  std::vector<int64_t> dropped_rows;   ///< input rows dropped, ascending
  std::vector<int64_t> changed_rows;   ///< input rows kept with a value repaired or clipped
  std::vector<column_report> columns;  ///< one per feature

  /// NaN and ±Inf values found, all columns.
  int64_t nonfinite() const;
  /// Outliers found, all columns.
  int64_t outliers() const;
  /// Values repaired (non-finite replaced), all columns.
  int64_t repaired() const;
  /// Values clipped, all columns.
  int64_t clipped() const;
  /// True when nothing was found.
  bool clean() const { return nonfinite() == 0 && outliers() == 0; }
};

/// A cleaned batch and the report of what was done to it.
struct firewall_result {
  at::Tensor batch;        ///< the cleaned batch (same dtype and device as the input)
  firewall_report report;  ///< what was found and done
};

/// Checks and repairs [batch, features] tensors with a policy per problem.
///
/// Usable unfitted for non-finite values (impute_median then takes the
/// batch's own medians); outlier policies need fit() first.
class firewall {
 public:
  /// A firewall with these policies. Throws c10::Error for invalid options.
  explicit firewall(firewall_options options = {});

  /// Fits the statistics (medians, bounds) on `data` ([rows, features]).
  /// Throws c10::Error under impute_median when a feature (not a label)
  /// has no finite value, and when column_names does not name every feature.
  firewall& fit(const at::Tensor& data);
  /// Uses statistics gathered elsewhere, e.g. streamed over a large file.
  firewall& fit(column_stats stats);
  /// True after fit().
  bool fitted() const { return stats_.has_value(); }
  /// The fitted statistics. REQUIRES: fitted().
  const column_stats& stats() const;
  /// Per-feature lower bounds of the outlier rule ([features], float64). REQUIRES: fitted().
  const at::Tensor& lower_bounds() const;
  /// Per-feature upper bounds of the outlier rule ([features], float64). REQUIRES: fitted().
  const at::Tensor& upper_bounds() const;
  /// The options.
  const firewall_options& options() const { return options_; }

  /// Checks `batch` ([rows, features], floating) and applies the policies.
  /// Throws c10::Error under a `raise` policy when a problem is found,
  /// naming the row, the column and the value.
  firewall_result apply(const at::Tensor& batch) const;

 private:
  std::string column_name(int64_t j) const;
  // impute_median needs a finite median in each feature that is not a label.
  void check_medians(const at::Tensor& median, const char* fn) const;

  firewall_options options_;
  std::optional<column_stats> stats_;
  at::Tensor median_, lower_, upper_, min_, max_;  // float64 [features]
};

/// A few lines: rows in/out, dropped rows, per column what was found and done.
std::string to_string(const firewall_report& report,
                      const std::vector<std::string>& column_names = {});

}  // namespace nanguard
