// `nanguard scan data.csv [--label COL] [--json]`: a health report of a
// training data file — missing and non-finite values per column,
// zero-variance columns, outliers by the 3σ rule, the robust z-score and an
// isolation forest, and what to do about them. Two streaming passes: the
// first fits the statistics (and a row sample for the forest), the second
// scores every row. Exit code 3 when the data holds NaN/Inf or missing values.
#include "commands.h"
#include "data_common.h"
#include "validators.h"

#include <nanguard/column_stats.h>
#include <nanguard/csv.h>
#include <nanguard/isolation_forest.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <queue>

namespace nanguard::cli {
namespace {

struct scan_args {
  std::string path;
  std::string label;
  bool json = false;
  int64_t top = 10;
  uint64_t seed = 0;
  double sigmas = 3.0;
  double robust_z = 3.5;
};

struct column_summary {
  std::string name;
  bool is_label = false;
  int64_t missing = 0, pos_inf = 0, neg_inf = 0;
  double mean, std, min, max, p001, median, p999, mad;
  bool constant = false;
  int64_t out_sigma = 0, out_robust = 0;
};

// Element j of a 1-D tensor, read directly: t[j].item() costs a tensor per call.
double at_(const at::Tensor& t, int64_t j) { return t.data_ptr<double>()[j]; }
int64_t count_at(const at::Tensor& t, int64_t j) { return t.data_ptr<int64_t>()[j]; }
double num(double v) { return v; }

int run_scan(const scan_args& a) {
  keep_memory_bounded();
  const csv_input input(a.path);
  const std::vector<std::string> names = input.open()->columns();
  const int64_t f = int64_t(names.size());
  const int64_t label = find_column(names, a.label, a.path);
  // ---- pass 1: statistics and a row sample
  const column_stats stats = fit_columns(input, a.seed);
  if (stats.rows() == 0)
    throw usage_error(fmt::format("'{}' has a header and no data rows; scan needs at least one row", a.path));
  std::vector<int64_t> feats;
  for (int64_t j = 0; j < f; ++j)
    if (j != label) feats.push_back(j);
  const at::Tensor feat_idx = at::tensor(feats, at::kLong);

  const at::Tensor mean = stats.mean(), sd = stats.std(), mn = stats.min(), mx = stats.max();
  const at::Tensor p001 = stats.quantile(0.001), med = stats.median(), p999 = stats.quantile(0.999),
                   mad = stats.mad();
  const at::Tensor nan = stats.nan_count(), pinf = stats.posinf_count(), ninf = stats.neginf_count();
  const std::vector<int64_t> constant = stats.constant_columns();
  std::vector<column_summary> cols(static_cast<size_t>(f));
  for (int64_t j = 0; j < f; ++j) {
    auto& c = cols[size_t(j)];
    c.name = names[size_t(j)];
    c.is_label = j == label;
    c.missing = count_at(nan, j);
    c.pos_inf = count_at(pinf, j);
    c.neg_inf = count_at(ninf, j);
    c.mean = at_(mean, j), c.std = at_(sd, j), c.min = at_(mn, j), c.max = at_(mx, j);
    c.p001 = at_(p001, j), c.median = at_(med, j), c.p999 = at_(p999, j), c.mad = at_(mad, j);
  }
  for (int64_t j : constant) cols[size_t(j)].constant = true;

  // The isolation forest is fitted on the reservoir sample of the features,
  // missing values imputed with the medians.
  const bool use_forest = !feats.empty() && stats.rows() >= 2;
  isolation_forest forest(isolation_forest_options().seed(a.seed));
  const at::Tensor feat_median = med.index_select(0, feat_idx);
  auto impute = [&](const at::Tensor& x) {
    const at::Tensor m = feat_median.nan_to_num(0.0).expand_as(x);
    return at::where(at::isfinite(x), x, m);
  };
  // Per-feature constants of the z-scores (as column_stats::zscore and
  // robust_zscore compute them), computed once rather than per batch.
  const auto nan_if_zero = [](const at::Tensor& t) { return at::where(t > 0, t, at::full_like(t, NAN)); };
  const at::Tensor feat_mean = mean.index_select(0, feat_idx);
  const at::Tensor feat_sd = nan_if_zero(sd.index_select(0, feat_idx));
  const at::Tensor feat_mad = nan_if_zero(mad.index_select(0, feat_idx));
  int64_t fitted_rows = 0;
  if (use_forest) {
    const at::Tensor sample = impute(stats.sample().index_select(1, feat_idx));
    fitted_rows = sample.size(0);
    forest.fit(sample);
  }

  // ---- pass 2: score every row
  using scored = std::pair<double, int64_t>;  // (score, row); the max-heap keeps the lowest scores
  std::priority_queue<scored> top;
  std::vector<int64_t> bad_rows;
  int64_t bad_row_count = 0, rows_sigma = 0, rows_robust = 0, rows_forest = 0;
  auto in = input.open();
  int64_t base = 0;
  as_input_error([&] {
    for (at::Tensor b = in->next_batch(kDataBatchRows); b.size(0) > 0; b = in->next_batch(kDataBatchRows)) {
      const int64_t n = b.size(0);
      const at::Tensor bad = at::logical_not(at::isfinite(b)).any(1);
      const bool* badp = bad.data_ptr<bool>();
      for (int64_t i = 0; i < n; ++i)
        if (badp[i]) {
          if (bad_rows.size() < 10) bad_rows.push_back(base + i);
          ++bad_row_count;
        }
      if (!feats.empty()) {
        const at::Tensor x = b.index_select(1, feat_idx);
        // No z-score for a non-finite x, nor where std / MAD = 0 (NaN > k is false).
        const at::Tensor finite = at::isfinite(x);
        const at::Tensor z = finite & (((x - feat_mean) / feat_sd).abs() > a.sigmas);
        const at::Tensor rz = finite & ((0.6745 * (x - feat_median) / feat_mad).abs() > a.robust_z);
        const at::Tensor zc = z.sum(0), rzc = rz.sum(0);
        for (size_t k = 0; k < feats.size(); ++k) {
          cols[size_t(feats[k])].out_sigma += count_at(zc, int64_t(k));
          cols[size_t(feats[k])].out_robust += count_at(rzc, int64_t(k));
        }
        rows_sigma += z.any(1).sum().item<int64_t>();
        rows_robust += rz.any(1).sum().item<int64_t>();
        if (use_forest) {
          const at::Tensor s = forest.score_samples(impute(x));
          const double* sp = s.data_ptr<double>();
          for (int64_t i = 0; i < n; ++i) {
            rows_forest += sp[i] < forest.offset();
            if (int64_t(top.size()) < a.top) {
              top.push({sp[i], base + i});
            } else if (a.top > 0 && sp[i] < top.top().first) {
              top.pop();
              top.push({sp[i], base + i});
            }
          }
        }
      }
      base += n;
    }
  });
  std::vector<scored> worst;
  for (; !top.empty(); top.pop()) worst.push_back(top.top());
  std::reverse(worst.begin(), worst.end());

  // ---- advice
  std::vector<std::string> advice;
  int64_t nonfinite_total = 0;
  for (const auto& c : cols) nonfinite_total += c.missing + c.pos_inf + c.neg_inf;
  if (nonfinite_total > 0) {
    std::vector<std::string> which;
    for (const auto& c : cols)
      if (c.missing + c.pos_inf + c.neg_inf > 0 && !c.is_label) which.push_back(c.name);
    if (!which.empty())
      advice.push_back(fmt::format(
          "{} rows hold missing or non-finite values (columns {}): they turn a loss into NaN. Run "
          "`nanguard clean {} -o clean.csv --policy repair` to impute the column medians, or "
          "--policy drop to drop those rows", bad_row_count, fmt::join(which, ", "), a.path));
    if (label >= 0 && cols[size_t(label)].missing + cols[size_t(label)].pos_inf + cols[size_t(label)].neg_inf > 0)
      advice.push_back(fmt::format("the label column '{}' has missing values: `nanguard clean` drops "
                                   "those rows under every policy (a label cannot be made up)", a.label));
  }
  for (int64_t j : constant)
    if (j != label)
      advice.push_back(fmt::format("column '{}' is constant (std = 0): standardising it computes 0/0 = "
                                   "NaN; drop it, or divide by (std + eps)", names[size_t(j)]));
  for (const auto& c : cols) {
    if (c.is_label) continue;
    const double absmax = std::max(std::fabs(c.min), std::fabs(c.max));
    if (std::isfinite(absmax) && absmax > 65504)
      advice.push_back(fmt::format("column '{}' reaches |x| = {:.4g}, beyond float16's 65504: "
                                   "standardise it before training in fp16/AMP", c.name, absmax));
  }
  if (rows_robust > 0)
    advice.push_back(fmt::format(
        "{} rows have a value with |robust z| > {} (median/MAD rule): check them; `nanguard clean "
        "{} -o clean.csv --policy clip` clips every column to its fitted [P0.1, P99.9]",
        rows_robust, a.robust_z, a.path));
  if (advice.empty()) advice.push_back("no problems found: the data is finite and every column varies");

  const int rc = nonfinite_total > 0 ? exit_nonfinite : exit_ok;
  if (a.json) {
    nlohmann::json j;
    j["file"] = a.path;
    j["rows"] = stats.rows();
    j["columns"] = nlohmann::json::array();
    for (const auto& c : cols) {
      auto v = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); };
      j["columns"].push_back({{"name", c.name}, {"label", c.is_label}, {"missing", c.missing},
                              {"pos_inf", c.pos_inf}, {"neg_inf", c.neg_inf}, {"mean", v(c.mean)},
                              {"std", v(c.std)}, {"min", v(c.min)}, {"p0.1", v(c.p001)},
                              {"median", v(c.median)}, {"p99.9", v(c.p999)}, {"max", v(c.max)},
                              {"mad", v(c.mad)}, {"constant", c.constant},
                              {"outliers_3sigma", c.out_sigma}, {"outliers_robust_z", c.out_robust}});
    }
    j["label"] = a.label.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.label);
    std::vector<std::string> const_names;
    for (int64_t c : constant) const_names.push_back(names[size_t(c)]);
    j["zero_variance_columns"] = const_names;
    j["rows_with_nonfinite"] = bad_row_count;
    j["first_rows_with_nonfinite"] = bad_rows;
    j["rows_with_3sigma_outlier"] = rows_sigma;
    j["rows_with_robust_z_outlier"] = rows_robust;
    nlohmann::json forest_j = {{"fitted", use_forest}, {"n_estimators", 100}, {"fitted_rows", fitted_rows},
                               {"rows_below_threshold", rows_forest}, {"top_rows", nlohmann::json::array()}};
    for (const auto& [s, r] : worst) forest_j["top_rows"].push_back({{"row", r}, {"score", s}});
    j["isolation_forest"] = forest_j;
    j["advice"] = advice;
    fmt::print("{}\n", j.dump(2));
    return rc;
  }

  fmt::print("{}: {} rows x {} columns{}\n", a.path, stats.rows(), f,
             label >= 0 ? fmt::format(" (label: {})", a.label) : "");
  fmt::print("rows are numbered from 0, the first row after the header\n\n");
  size_t w = 6;
  for (const auto& c : cols) w = std::max(w, std::min<size_t>(c.name.size(), 24));
  fmt::print("{:<{}} {:>8} {:>6} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>6} {:>6}\n", "column", w,
             "missing", "+inf", "-inf", "mean", "std", "min", "median", "max", ">3σ", "|rz|>" );
  for (const auto& c : cols)
    fmt::print("{:<{}} {:>8} {:>6} {:>6} {:>11.4g} {:>11.4g} {:>11.4g} {:>11.4g} {:>11.4g} {:>6} {:>6}{}\n",
               c.name.substr(0, 24), w, c.missing, c.pos_inf, c.neg_inf, num(c.mean), num(c.std),
               num(c.min), num(c.median), num(c.max), c.out_sigma, c.out_robust,
               c.is_label ? "  (label)" : c.constant ? "  (constant)" : "");
  fmt::print("\nrows with missing or non-finite values: {}{}\n", bad_row_count,
             bad_row_count ? " (rows " + list_rows(bad_rows, bad_row_count) + ")" : "");
  fmt::print("zero-variance columns: {}\n", constant.empty() ? "none" : [&] {
    std::vector<std::string> v;
    for (int64_t c : constant) v.push_back(names[size_t(c)]);
    return fmt::format("{}", fmt::join(v, ", "));
  }());
  fmt::print("rows with a 3σ outlier: {}; with |robust z| > {}: {}\n", rows_sigma, a.robust_z, rows_robust);
  if (use_forest) {
    fmt::print("isolation forest (100 trees, fitted on {} sampled rows; scikit-learn's score_samples, "
               "lower is odder): most anomalous rows\n", fitted_rows);
    for (const auto& [s, r] : worst) fmt::print("  row {:<10} score {:.4f}\n", r, s);
  }
  fmt::print("\nadvice:\n");
  for (const auto& s : advice) fmt::print("  - {}\n", s);
  return rc;
}

}  // namespace

command add_scan_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "scan", "Health report of a CSV training file: missing/non-finite values, constant columns, outliers");
  auto a = std::make_shared<scan_args>();
  sub->add_option("file", a->path, "CSV file with a header row and numeric columns")->required();
  sub->add_option("--label", a->label, "the label column: reported, but not an outlier feature");
  sub->add_flag("--json", a->json, "print the report as JSON");
  sub->add_option("--top", a->top, "rows to list from the isolation forest")->check(CLI::Range(0, 1000000));
  sub->add_option("--seed", a->seed, "seed of the row sample and the isolation forest")->check(non_negative_integer());
  sub->footer("FILE may be a pipe or /dev/stdin (read once, into a temporary copy in $TMPDIR).\n" +
              exit_codes("healthy", "the data holds missing or non-finite values"));
  return {sub, [a] { return run_scan(*a); }};
}

}  // namespace nanguard::cli
