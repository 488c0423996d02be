#include "nanguard/firewall.h"

#include "nanguard/spelling.h"

#include "detail/dtype_limits.h"
#include "detail/enum_from_string.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

namespace nanguard {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string show(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{:.6g}", v);
}

std::string list_rows(const std::vector<int64_t>& rows, size_t max_shown = 8) {
  std::string s;
  for (size_t i = 0; i < rows.size() && i < max_shown; ++i)
    s += (i ? ", " : "") + std::to_string(rows[i]);
  if (rows.size() > max_shown) s += fmt::format(", ... ({} in all)", rows.size());
  return s;
}

// apply()'s argument checks: a floating [rows, features] tensor with the
// fitted columns.
void check_batch(const firewall& fw, const at::Tensor& batch) {
  TORCH_CHECK(batch.defined(), "nanguard::firewall::apply: the batch is undefined");
  TORCH_CHECK(batch.dim() == 2, "nanguard::firewall::apply: expected a [batch, features] tensor but "
              "got shape ", batch.sizes(), "; flatten each sample to one row first (x.flatten(1))");
  TORCH_CHECK_TYPE(batch.is_floating_point(), "nanguard::firewall::apply: expected a floating-point "
                   "tensor but got ", batch.scalar_type(), "; integer data needs no firewall");
  const int64_t f = batch.size(1);
  TORCH_CHECK(fw.options().outliers() == outlier_policy::ignore || fw.fitted(), "nanguard::firewall::apply: "
              "outlier policies need fitted bounds; call fit(training_data) first or use outlier_policy::ignore");
  TORCH_CHECK(!fw.fitted() || f == fw.stats().features(), "nanguard::firewall::apply: the batch has ", f,
              " features but the firewall was fitted on ", fw.stats().features(),
              "; pass batches with the same columns");
  for (int64_t j : fw.options().label_columns())
    TORCH_CHECK(j < f, "nanguard::firewall::apply: label column ", j, " does not exist in a batch "
                "of ", f, " features");
}

// What apply() writes over each column's non-finite values and outliers.
struct column_fills {
  std::vector<double> median, lower, upper;  // NaN bounds (no data) never flag an outlier
  std::vector<double> posinf, neginf;
};

// The values a raise policy refused: how many, in which rows, and the first.
struct raised_values {
  int64_t nonfinite = 0, outliers = 0;
  std::vector<int64_t> rows;
  int64_t row = -1, column = -1;  // the first value (row -1: none)
  double value = 0;
  bool is_outlier = false;

  void add(int64_t i, int64_t j, double v, bool outlier) {
    ++(outlier ? outliers : nonfinite);
    if (row >= 0) return;
    row = i, column = j, value = v, is_outlier = outlier;
  }
  // What is wrong with the first value.
  std::string what(const column_fills& fills) const {
    if (!is_outlier) return fmt::format("holds {}", show(value));
    return fmt::format("{} is outside the fitted bounds [{}, {}]", show(value), show(fills.lower[size_t(column)]),
                       show(fills.upper[size_t(column)]));
  }
};

// What screening did to one row.
struct row_effect {
  bool raised = false, dropped = false, changed = false;
};

// Screens a batch's values in place under the options' policies, counting
// what it finds and does in a report.
class value_screen {
 public:
  value_screen(const firewall_options& o, const column_fills& fills, firewall_report& report)
      : o_(o),
        fills_(fills),
        report_(report),
        is_label_(fills.median.size(), 0),
        check_outliers_(o.outliers() != outlier_policy::ignore) {
    for (int64_t j : o.label_columns()) is_label_[size_t(j)] = 1;
  }

  // Screens row `i`, whose values start at `values`. Its repairs and clips
  // count only when the row is kept: a dropped row's values never reach the
  // output (a row with a NaN and an outlier under drop + clip).
  void row(int64_t i, double* values) {
    row_effect r;
    repaired_.clear();
    clipped_.clear();
    for (int64_t j = 0; j < int64_t(is_label_.size()); ++j) {
      if (!std::isfinite(values[j]))
        nonfinite(values[j], i, j, r);
      else if (check_outliers_ && !is_label_[size_t(j)])
        outlier(values[j], i, j, r);
    }
    if (r.raised) raised_.rows.push_back(i);
    if (r.dropped) {
      report_.dropped_rows.push_back(i);
      return;
    }
    for (int64_t j : repaired_) ++report_.columns[size_t(j)].repaired;
    for (int64_t j : clipped_) ++report_.columns[size_t(j)].clipped;
    if (r.changed) report_.changed_rows.push_back(i);
  }

  const raised_values& raised() const { return raised_; }

 private:
  void nonfinite(double& e, int64_t i, int64_t j, row_effect& r) {
    column_report& c = report_.columns[size_t(j)];
    (std::isnan(e) ? c.nan : e > 0 ? c.pos_inf : c.neg_inf)++;
    nonfinite_policy p = o_.nonfinite();
    if (is_label_[size_t(j)] && p != nonfinite_policy::raise && p != nonfinite_policy::ignore)
      p = nonfinite_policy::drop;  // a label cannot be made up
    switch (p) {
      case nonfinite_policy::raise:
        raised_.add(i, j, e, /*outlier=*/false);
        r.raised = true;
        break;
      case nonfinite_policy::drop:
        r.dropped = true;
        break;
      case nonfinite_policy::nan_to_num:
        e = std::isnan(e) ? o_.nan_value() : e > 0 ? fills_.posinf[size_t(j)] : fills_.neginf[size_t(j)];
        repaired_.push_back(j);
        r.changed = true;
        break;
      case nonfinite_policy::impute_median:
        e = fills_.median[size_t(j)];  // finite: check_medians refused a column without one
        repaired_.push_back(j);
        r.changed = true;
        break;
      case nonfinite_policy::ignore:
        break;
    }
  }

  void outlier(double& e, int64_t i, int64_t j, row_effect& r) {
    const double l = fills_.lower[size_t(j)], h = fills_.upper[size_t(j)];
    if (!(e < l || e > h)) return;
    column_report& c = report_.columns[size_t(j)];
    ++c.outliers;
    switch (o_.outliers()) {
      case outlier_policy::raise:
        raised_.add(i, j, e, /*outlier=*/true);
        r.raised = true;
        break;
      case outlier_policy::drop:
        r.dropped = true;
        break;
      case outlier_policy::clip:
        e = std::clamp(e, l, h);
        clipped_.push_back(j);
        r.changed = true;
        break;
      case outlier_policy::ignore:
        break;
    }
  }

  const firewall_options& o_;
  const column_fills& fills_;
  firewall_report& report_;
  std::vector<char> is_label_;
  const bool check_outliers_;
  raised_values raised_;
  std::vector<int64_t> repaired_, clipped_;  // the current row's columns, counted once it is kept
};

// The indices of the rows of [0, n) not in `dropped` (ascending).
at::Tensor kept_rows(int64_t n, const std::vector<int64_t>& dropped) {
  std::vector<int64_t> keep;
  keep.reserve(size_t(n) - dropped.size());
  size_t d = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (d < dropped.size() && dropped[d] == i)
      ++d;
    else
      keep.push_back(i);
  }
  return at::tensor(keep, at::kLong);
}

}  // namespace

int64_t firewall_report::nonfinite() const {
  int64_t n = 0;
  for (const auto& c : columns) n += c.nan + c.pos_inf + c.neg_inf;
  return n;
}
int64_t firewall_report::outliers() const {
  int64_t n = 0;
  for (const auto& c : columns) n += c.outliers;
  return n;
}
int64_t firewall_report::repaired() const {
  int64_t n = 0;
  for (const auto& c : columns) n += c.repaired;
  return n;
}
int64_t firewall_report::clipped() const {
  int64_t n = 0;
  for (const auto& c : columns) n += c.clipped;
  return n;
}

firewall::firewall(firewall_options options) : options_(std::move(options)) {
  const auto& o = options_;
  TORCH_CHECK(o.low_quantile() >= 0 && o.low_quantile() < o.high_quantile() && o.high_quantile() <= 1,
              "nanguard::firewall: need 0 <= low_quantile < high_quantile <= 1 but got low_quantile=",
              o.low_quantile(), " high_quantile=", o.high_quantile(), "; e.g. 0.001 and 0.999");
  TORCH_CHECK(o.sigmas() > 0 && std::isfinite(o.sigmas()), "nanguard::firewall: sigmas must be a finite "
              "number > 0 but is ", o.sigmas(), "; 3 is the usual 3σ rule");
  TORCH_CHECK(o.robust_z() > 0 && std::isfinite(o.robust_z()), "nanguard::firewall: robust_z must be a "
              "finite number > 0 but is ", o.robust_z(), "; 5 (the default) leaves clean normal data untouched");
  TORCH_CHECK(std::isfinite(o.nan_value()), "nanguard::firewall: nan_value must be finite but is ",
              o.nan_value());
  for (const auto& [name, v] : {std::pair{"posinf_value", o.posinf_value()}, {"neginf_value", o.neginf_value()}})
    TORCH_CHECK(!v || std::isfinite(*v), "nanguard::firewall: ", name, " must be finite but is ", *v,
                "; leave it unset for the fitted max/min");
  for (int64_t j : o.label_columns())
    TORCH_CHECK(j >= 0, "nanguard::firewall: label_columns holds ", j,
                "; pass column indices from 0");
  std::unordered_map<std::string, size_t> first;
  for (size_t j = 0; j < o.column_names().size(); ++j) {
    const auto [it, fresh] = first.emplace(o.column_names()[j], j);
    TORCH_CHECK(fresh, "nanguard::firewall: column_names holds '", it->first, "' twice (columns ", it->second,
                " and ", j, "); give every column a unique name");
  }
}

firewall& firewall::fit(const at::Tensor& data) {
  column_stats s;
  s.update(data);
  return fit(std::move(s));
}

firewall& firewall::fit(column_stats stats) {
  TORCH_CHECK(stats.rows() > 0, "nanguard::firewall::fit: the statistics hold no rows; fit on "
              "the training data");
  const auto& names = options_.column_names();
  TORCH_CHECK(names.empty() || int64_t(names.size()) == stats.features(), "nanguard::firewall::fit: ",
              names.size(), " column_names for data of ", stats.features(), " columns; name every column or none");
  const at::Tensor median = stats.median();
  if (options_.nonfinite() == nonfinite_policy::impute_median) check_medians(median, "fit");
  median_ = median;
  min_ = stats.min();
  max_ = stats.max();
  switch (options_.rule()) {
    case outlier_rule::quantile_range:
      lower_ = stats.quantile(options_.low_quantile());
      upper_ = stats.quantile(options_.high_quantile());
      break;
    case outlier_rule::three_sigma: {
      const at::Tensor m = stats.mean(), s = stats.std() * options_.sigmas();
      lower_ = m - s;
      upper_ = m + s;
      break;
    }
    case outlier_rule::robust_z: {
      // A MAD of 0 (more than half the values equal, a 0/1 flag) gives no
      // robust z-score, as column_stats::robust_zscore says: NaN bounds flag
      // nothing. Zero-width bounds dropped or clipped every other value.
      const at::Tensor mad = stats.mad();
      const at::Tensor w = at::where(mad > 0, mad, at::full_like(mad, kNaN)) * (options_.robust_z() / 0.6745);
      lower_ = median_ - w;
      upper_ = median_ + w;
      break;
    }
  }
  stats_.emplace(std::move(stats));
  return *this;
}

const column_stats& firewall::stats() const {
  TORCH_CHECK(fitted(), "nanguard::firewall::stats: the firewall is not fitted; call fit() first");
  return *stats_;
}
const at::Tensor& firewall::lower_bounds() const {
  TORCH_CHECK(fitted(), "nanguard::firewall::lower_bounds: the firewall is not fitted; call fit() first");
  return lower_;
}
const at::Tensor& firewall::upper_bounds() const {
  TORCH_CHECK(fitted(), "nanguard::firewall::upper_bounds: the firewall is not fitted; call fit() first");
  return upper_;
}

void firewall::check_medians(const at::Tensor& median, const char* fn) const {
  const double* m = median.data_ptr<double>();
  const auto& labels = options_.label_columns();
  for (int64_t j = 0; j < median.numel(); ++j)
    TORCH_CHECK(std::isfinite(m[j]) || std::find(labels.begin(), labels.end(), j) != labels.end(),
                "nanguard::firewall::", fn, ": ", column_name(j), " has no finite value, so impute_median has "
                "no median to impute; drop the column, or its rows (policy drop)");
}

std::string firewall::column_name(int64_t j) const {
  const auto& names = options_.column_names();
  if (j < int64_t(names.size())) return fmt::format("column {} ('{}')", j, names[size_t(j)]);
  return fmt::format("column {}", j);
}

firewall_result firewall::apply(const at::Tensor& batch) const {
  check_batch(*this, batch);
  const int64_t n = batch.size(0), f = batch.size(1);
  at::Tensor x = batch.to(at::kCPU, at::kDouble, /*non_blocking=*/false, /*copy=*/true).contiguous();

  // Replacement values: the fitted ones, or the batch's own medians.
  column_fills fills{std::vector<double>(size_t(f), kNaN), std::vector<double>(size_t(f), kNaN),
                     std::vector<double>(size_t(f), kNaN), {}, {}};
  if (fitted()) {
    std::copy_n(median_.data_ptr<double>(), f, fills.median.begin());
    std::copy_n(lower_.data_ptr<double>(), f, fills.lower.begin());
    std::copy_n(upper_.data_ptr<double>(), f, fills.upper.begin());
  } else if (options_.nonfinite() == nonfinite_policy::impute_median && n > 0) {
    column_stats own;
    own.update(x);
    const at::Tensor m = own.median();
    check_medians(m, "apply");
    std::copy_n(m.data_ptr<double>(), f, fills.median.begin());
  }
  const double dtype_max = detail::largest_finite(batch.scalar_type());
  fills.posinf.assign(size_t(f), options_.posinf_value().value_or(dtype_max));
  fills.neginf.assign(size_t(f), options_.neginf_value().value_or(-dtype_max));
  for (int64_t j = 0; fitted() && j < f; ++j) {
    const double mx = max_.data_ptr<double>()[j], mn = min_.data_ptr<double>()[j];
    if (std::isfinite(mx) && !options_.posinf_value()) fills.posinf[size_t(j)] = mx;
    if (std::isfinite(mn) && !options_.neginf_value()) fills.neginf[size_t(j)] = mn;
  }

  firewall_result result;
  firewall_report& rep = result.report;
  rep.rows_in = n;
  rep.columns.assign(size_t(f), column_report{});
  value_screen screen(options_, fills, rep);
  double* v = x.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) screen.row(i, v + i * f);
  const raised_values& raised = screen.raised();
  TORCH_CHECK(raised.row < 0, "nanguard::firewall: row ", raised.row, ", ", column_name(raised.column), " ",
              raised.what(fills), "; the batch has ", raised.nonfinite, " non-finite value(s) and ", raised.outliers,
              " outlier(s) under a raise policy, in rows ", list_rows(raised.rows),
              ". Fix the data, or choose a policy that drops or repairs them, e.g. ",
              spelled("firewall_options().nonfinite(nonfinite_policy::impute_median)",
                      "nanguard.Firewall(nonfinite=\"impute_median\")"));

  rep.rows_out = n - int64_t(rep.dropped_rows.size());
  if (!rep.dropped_rows.empty()) x = x.index_select(0, kept_rows(n, rep.dropped_rows));
  result.batch = x.to(batch.device(), batch.scalar_type());
  return result;
}

const char* to_string(nonfinite_policy p) {
  switch (p) {
    case nonfinite_policy::raise: return "raise";
    case nonfinite_policy::drop: return "drop";
    case nonfinite_policy::nan_to_num: return "nan_to_num";
    case nonfinite_policy::impute_median: return "impute_median";
    case nonfinite_policy::ignore: return "ignore";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: nonfinite_policy ", static_cast<int>(p), " has no name");
}

nonfinite_policy nonfinite_policy_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_nonfinite_policies, "nonfinite_policy");
}

const char* to_string(outlier_policy p) {
  switch (p) {
    case outlier_policy::ignore: return "ignore";
    case outlier_policy::raise: return "raise";
    case outlier_policy::drop: return "drop";
    case outlier_policy::clip: return "clip";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: outlier_policy ", static_cast<int>(p), " has no name");
}

outlier_policy outlier_policy_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_outlier_policies, "outlier_policy");
}

const char* to_string(outlier_rule r) {
  switch (r) {
    case outlier_rule::quantile_range: return "quantile_range";
    case outlier_rule::three_sigma: return "three_sigma";
    case outlier_rule::robust_z: return "robust_z";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: outlier_rule ", static_cast<int>(r), " has no name");
}

outlier_rule outlier_rule_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_outlier_rules, "outlier_rule");
}

std::string to_string(const firewall_report& r, const std::vector<std::string>& names) {
  std::string s = fmt::format("rows {} -> {}: {} non-finite, {} outliers; {} repaired, {} clipped, "
                              "{} rows dropped",
                              r.rows_in, r.rows_out, r.nonfinite(), r.outliers(), r.repaired(),
                              r.clipped(), r.dropped_rows.size());
  if (!r.dropped_rows.empty()) s += "\n  dropped rows: " + list_rows(r.dropped_rows);
  for (size_t j = 0; j < r.columns.size(); ++j) {
    const column_report& c = r.columns[j];
    if (c.nan + c.pos_inf + c.neg_inf + c.outliers == 0) continue;
    const std::string name = j < names.size() ? names[j] : fmt::format("column {}", j);
    s += fmt::format("\n  {}: nan={} +inf={} -inf={} outliers={} repaired={} clipped={}", name, c.nan,
                     c.pos_inf, c.neg_inf, c.outliers, c.repaired, c.clipped);
  }
  return s;
}

}  // namespace nanguard
