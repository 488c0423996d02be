#include "nanguard/firewall.h"

#include "detail/dtype_limits.h"

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
              "finite number > 0 but is ", o.robust_z(), "; 3.5 is the usual cut");
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
      const at::Tensor w = stats.mad() * (options_.robust_z() / 0.6745);
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
  TORCH_CHECK(batch.defined(), "nanguard::firewall::apply: the batch is undefined");
  TORCH_CHECK(batch.dim() == 2, "nanguard::firewall::apply: expected a [batch, features] tensor but "
              "got shape ", batch.sizes(), "; flatten each sample to one row first (x.flatten(1))");
  TORCH_CHECK(batch.is_floating_point(), "nanguard::firewall::apply: expected a floating-point "
              "tensor but got ", batch.scalar_type(), "; integer data needs no firewall");
  const int64_t n = batch.size(0), f = batch.size(1);
  const bool check_outliers = options_.outliers() != outlier_policy::ignore;
  TORCH_CHECK(!check_outliers || fitted(), "nanguard::firewall::apply: outlier policies need "
              "fitted bounds; call fit(training_data) first or use outlier_policy::ignore");
  TORCH_CHECK(!fitted() || f == stats_->features(), "nanguard::firewall::apply: the batch has ", f,
              " features but the firewall was fitted on ", stats_->features(),
              "; pass batches with the same columns");
  for (int64_t j : options_.label_columns())
    TORCH_CHECK(j < f, "nanguard::firewall::apply: label column ", j, " does not exist in a batch "
                "of ", f, " features");

  at::Tensor x = batch.to(at::kCPU, at::kDouble, /*non_blocking=*/false, /*copy=*/true).contiguous();
  double* v = x.data_ptr<double>();
  std::vector<char> is_label(size_t(f), 0);
  for (int64_t j : options_.label_columns()) is_label[size_t(j)] = 1;

  // Replacement values.
  const auto policy = options_.nonfinite();
  std::vector<double> med(size_t(f), kNaN), lo(size_t(f), kNaN), hi(size_t(f), kNaN);
  if (fitted()) {
    std::copy_n(median_.data_ptr<double>(), f, med.begin());
    std::copy_n(lower_.data_ptr<double>(), f, lo.begin());
    std::copy_n(upper_.data_ptr<double>(), f, hi.begin());
  } else if (policy == nonfinite_policy::impute_median && n > 0) {
    column_stats own;
    own.update(x);
    const at::Tensor m = own.median();
    check_medians(m, "apply");
    std::copy_n(m.data_ptr<double>(), f, med.begin());
  }
  const double dtype_max = detail::largest_finite(batch.scalar_type());
  std::vector<double> posinf(size_t(f), dtype_max), neginf(size_t(f), -dtype_max);
  for (int64_t j = 0; j < f; ++j) {
    if (fitted()) {
      const double mx = max_.data_ptr<double>()[j], mn = min_.data_ptr<double>()[j];
      if (std::isfinite(mx)) posinf[size_t(j)] = mx;
      if (std::isfinite(mn)) neginf[size_t(j)] = mn;
    }
    if (options_.posinf_value()) posinf[size_t(j)] = *options_.posinf_value();
    if (options_.neginf_value()) neginf[size_t(j)] = *options_.neginf_value();
  }

  firewall_result result;
  firewall_report& rep = result.report;
  rep.rows_in = n;
  rep.columns.assign(size_t(f), column_report{});
  std::vector<char> drop(size_t(n), 0);
  int64_t raise_nonfinite = 0, raise_outlier = 0;
  int64_t first_row = -1, first_col = -1;
  double first_value = 0;
  bool first_is_outlier = false;
  std::vector<int64_t> raise_rows;

  for (int64_t i = 0; i < n; ++i) {
    double* row = v + i * f;
    bool changed = false, raised = false;
    for (int64_t j = 0; j < f; ++j) {
      double& e = row[j];
      column_report& c = rep.columns[size_t(j)];
      if (!std::isfinite(e)) {
        (std::isnan(e) ? c.nan : e > 0 ? c.pos_inf : c.neg_inf)++;
        nonfinite_policy p = policy;
        if (is_label[size_t(j)] && p != nonfinite_policy::raise && p != nonfinite_policy::ignore)
          p = nonfinite_policy::drop;  // a label cannot be made up
        switch (p) {
          case nonfinite_policy::raise:
            ++raise_nonfinite;
            raised = true;
            if (first_row < 0) first_row = i, first_col = j, first_value = e;
            break;
          case nonfinite_policy::drop:
            drop[size_t(i)] = 1;
            break;
          case nonfinite_policy::nan_to_num:
            e = std::isnan(e) ? options_.nan_value() : e > 0 ? posinf[size_t(j)] : neginf[size_t(j)];
            ++c.repaired;
            changed = true;
            break;
          case nonfinite_policy::impute_median: {
            e = med[size_t(j)];  // finite: check_medians refused a column without one
            ++c.repaired;
            changed = true;
            break;
          }
          case nonfinite_policy::ignore:
            break;
        }
        continue;
      }
      if (!check_outliers || is_label[size_t(j)]) continue;
      const double l = lo[size_t(j)], h = hi[size_t(j)];
      if (!(e < l || e > h)) continue;  // NaN bounds (no data) never flag
      ++c.outliers;
      switch (options_.outliers()) {
        case outlier_policy::raise:
          ++raise_outlier;
          raised = true;
          if (first_row < 0) first_row = i, first_col = j, first_value = e, first_is_outlier = true;
          break;
        case outlier_policy::drop:
          drop[size_t(i)] = 1;
          break;
        case outlier_policy::clip:
          e = std::clamp(e, l, h);
          ++c.clipped;
          changed = true;
          break;
        case outlier_policy::ignore:
          break;
      }
    }
    if (raised) raise_rows.push_back(i);
    if (drop[size_t(i)])
      rep.dropped_rows.push_back(i);
    else if (changed)
      rep.changed_rows.push_back(i);
  }

  if (first_row >= 0) {
    std::string what;
    if (first_is_outlier)
      what = fmt::format("{} is outside the fitted bounds [{}, {}]", show(first_value),
                         show(lo[size_t(first_col)]), show(hi[size_t(first_col)]));
    else
      what = fmt::format("holds {}", show(first_value));
    TORCH_CHECK(false, "nanguard::firewall: row ", first_row, ", ", column_name(first_col), " ",
                what, "; the batch has ", raise_nonfinite, " non-finite value(s) and ", raise_outlier,
                " outlier(s) under a raise policy, in rows ", list_rows(raise_rows),
                ". Fix the data, or choose a policy that drops or repairs them, e.g. "
                "firewall_options().nonfinite(nonfinite_policy::impute_median)");
  }

  rep.rows_out = n - int64_t(rep.dropped_rows.size());
  if (!rep.dropped_rows.empty()) {
    std::vector<int64_t> keep;
    keep.reserve(size_t(rep.rows_out));
    for (int64_t i = 0; i < n; ++i)
      if (!drop[size_t(i)]) keep.push_back(i);
    x = x.index_select(0, at::tensor(keep, at::kLong));
  }
  result.batch = x.to(batch.device(), batch.scalar_type());
  return result;
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
