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

#include "detail/printable.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
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

  int64_t nonfinite() const { return missing + pos_inf + neg_inf; }
};

using scored = std::pair<double, int64_t>;  // (isolation forest score, row)

// What scan found, per column and per row.
struct scan_report {
  int64_t rows = 0;
  int64_t label = -1;  // the --label column, or -1
  std::vector<column_summary> columns;
  std::vector<int64_t> constant;  // zero-variance columns
  std::vector<int64_t> bad_rows;  // the first 10 rows holding a missing or non-finite value
  int64_t bad_row_count = 0, rows_sigma = 0, rows_robust = 0, rows_forest = 0;
  int64_t bad_feature_rows = 0;  // the rows holding one in a feature (not the label): what clean repairs
  bool forest_fitted = false;
  int64_t forest_rows = 0;     // the rows the forest was fitted on
  std::vector<scored> worst;   // the forest's lowest scores, lowest first
  std::vector<std::string> advice;

  int64_t nonfinite_total() const {
    int64_t n = 0;
    for (const auto& c : columns) n += c.nonfinite();
    return n;
  }
  std::vector<std::string> constant_names() const {
    std::vector<std::string> v;
    for (int64_t j : constant) v.push_back(columns[size_t(j)].name);
    return v;
  }
};

// Element j of a 1-D tensor, read directly: t[j].item() costs a tensor per call.
double at_(const at::Tensor& t, int64_t j) { return t.data_ptr<double>()[j]; }
int64_t count_at(const at::Tensor& t, int64_t j) { return t.data_ptr<int64_t>()[j]; }
double num(double v) { return v; }

// A column name (or a label the user named) as the terminal shows it: its
// control bytes escaped. The JSON output keeps the name itself (JSON escapes them).
std::string shown(const std::string& name) { return detail::printable(name); }

// A column name as the table shows it: escaped, and at most 24 columns wide
// (fmt's precision cuts by display width, never inside a UTF-8 character).
constexpr size_t kNameWidth = 24;
std::string table_name(const std::string& name) { return fmt::format("{:.{}}", shown(name), kNameWidth); }

// Pass 1's statistics of each column.
std::vector<column_summary> summarize_columns(const column_stats& stats, const std::vector<std::string>& names,
                                              int64_t label) {
  const at::Tensor mean = stats.mean(), sd = stats.std(), mn = stats.min(), mx = stats.max();
  const at::Tensor p001 = stats.quantile(0.001), med = stats.median(), p999 = stats.quantile(0.999),
                   mad = stats.mad();
  const at::Tensor nan = stats.nan_count(), pinf = stats.posinf_count(), ninf = stats.neginf_count();
  std::vector<column_summary> cols(names.size());
  for (int64_t j = 0; j < int64_t(names.size()); ++j) {
    auto& c = cols[size_t(j)];
    c.name = names[size_t(j)];
    c.is_label = j == label;
    c.missing = count_at(nan, j);
    c.pos_inf = count_at(pinf, j);
    c.neg_inf = count_at(ninf, j);
    c.mean = at_(mean, j), c.std = at_(sd, j), c.min = at_(mn, j), c.max = at_(mx, j);
    c.p001 = at_(p001, j), c.median = at_(med, j), c.p999 = at_(p999, j), c.mad = at_(mad, j);
  }
  for (int64_t j : stats.constant_columns()) cols[size_t(j)].constant = true;
  return cols;
}

// Pass 2's scoring of rows: the 3σ and robust z rules per feature and an
// isolation forest fitted on pass 1's reservoir sample of the features,
// missing values imputed with the medians.
class row_scorer {
 public:
  row_scorer(const scan_args& a, const column_stats& stats, int64_t label) : a_(a) {
    for (int64_t j = 0; j < stats.features(); ++j)
      if (j != label) features_.push_back(j);
    feature_idx_ = at::tensor(features_, at::kLong);
    // Per-feature constants of the z-scores (as column_stats::zscore and
    // robust_zscore compute them), computed once rather than per batch.
    const auto nan_if_zero = [](const at::Tensor& t) { return at::where(t > 0, t, at::full_like(t, NAN)); };
    median_ = stats.median().index_select(0, feature_idx_);
    mean_ = stats.mean().index_select(0, feature_idx_);
    sd_ = nan_if_zero(stats.std().index_select(0, feature_idx_));
    mad_ = nan_if_zero(stats.mad().index_select(0, feature_idx_));
    if (!features_.empty() && stats.rows() >= 2) {
      const at::Tensor sample = impute(stats.sample().index_select(1, feature_idx_));
      forest_rows_ = sample.size(0);
      forest_.emplace(isolation_forest_options().seed(a.seed));
      forest_->fit(sample);
    }
  }

  // Scores batch `b`, whose first row is row `base` of the file, into `r`.
  void score(const at::Tensor& b, int64_t base, scan_report& r) {
    count_nonfinite_rows(b, base, r);
    if (features_.empty()) return;
    const at::Tensor x = b.index_select(1, feature_idx_);
    const at::Tensor finite = at::isfinite(x);
    r.bad_feature_rows += at::logical_not(finite.all(1)).sum().item<int64_t>();
    count_outliers(x, finite, r);
    if (forest_) score_forest(x, base, r);
  }

  // Hands the forest's figures over to `r`, once every batch is scored.
  void finish(scan_report& r) {
    r.forest_fitted = forest_.has_value();
    r.forest_rows = forest_rows_;
    for (; !top_.empty(); top_.pop()) r.worst.push_back(top_.top());
    std::reverse(r.worst.begin(), r.worst.end());
  }

 private:
  at::Tensor impute(const at::Tensor& x) const {
    return at::where(at::isfinite(x), x, median_.nan_to_num(0.0).expand_as(x));
  }

  static void count_nonfinite_rows(const at::Tensor& b, int64_t base, scan_report& r) {
    const at::Tensor bad = at::logical_not(at::isfinite(b)).any(1);
    const bool* badp = bad.data_ptr<bool>();
    for (int64_t i = 0; i < b.size(0); ++i)
      if (badp[i]) {
        if (r.bad_rows.size() < 10) r.bad_rows.push_back(base + i);
        ++r.bad_row_count;
      }
  }

  // `finite`: at::isfinite(x).
  void count_outliers(const at::Tensor& x, const at::Tensor& finite, scan_report& r) const {
    // No z-score for a non-finite x, nor where std / MAD = 0 (NaN > k is false).
    const at::Tensor z = finite & (((x - mean_) / sd_).abs() > a_.sigmas);
    const at::Tensor rz = finite & ((0.6745 * (x - median_) / mad_).abs() > a_.robust_z);
    const at::Tensor zc = z.sum(0), rzc = rz.sum(0);
    for (size_t k = 0; k < features_.size(); ++k) {
      r.columns[size_t(features_[k])].out_sigma += count_at(zc, int64_t(k));
      r.columns[size_t(features_[k])].out_robust += count_at(rzc, int64_t(k));
    }
    r.rows_sigma += z.any(1).sum().item<int64_t>();
    r.rows_robust += rz.any(1).sum().item<int64_t>();
  }

  // Counts the rows below the forest's threshold and keeps the --top lowest
  // scores (a max-heap of them).
  void score_forest(const at::Tensor& x, int64_t base, scan_report& r) {
    const at::Tensor s = forest_->score_samples(impute(x));
    const double* sp = s.data_ptr<double>();
    for (int64_t i = 0; i < x.size(0); ++i) {
      r.rows_forest += sp[i] < forest_->offset();
      if (int64_t(top_.size()) < a_.top) {
        top_.push({sp[i], base + i});
      } else if (a_.top > 0 && sp[i] < top_.top().first) {
        top_.pop();
        top_.push({sp[i], base + i});
      }
    }
  }

  const scan_args& a_;
  std::vector<int64_t> features_;  // the columns but the label
  at::Tensor feature_idx_, median_, mean_, sd_, mad_;
  std::optional<isolation_forest> forest_;  // none without features or with fewer than 2 rows
  int64_t forest_rows_ = 0;
  std::priority_queue<scored> top_;
};

// What to do about the problems found.
std::vector<std::string> advise(const scan_args& a, const scan_report& r) {
  std::vector<std::string> advice;
  std::vector<std::string> which;
  for (const auto& c : r.columns)
    if (c.nonfinite() > 0 && !c.is_label) which.push_back(shown(c.name));
  if (!which.empty())
    advice.push_back(fmt::format(
        "{} rows hold missing or non-finite values (columns {}): they turn a loss into NaN. Run "
        "`nanguard clean {} -o clean.csv --policy repair` to impute the column medians, or "
        "--policy drop to drop those rows", r.bad_feature_rows, fmt::join(which, ", "), a.path));
  if (r.label >= 0 && r.columns[size_t(r.label)].nonfinite() > 0)
    advice.push_back(fmt::format("the label column '{}' has missing values: `nanguard clean` drops "
                                 "those rows under every policy (a label cannot be made up)", shown(a.label)));
  for (int64_t j : r.constant) {
    const column_summary& c = r.columns[size_t(j)];
    if (j == r.label) continue;
    if (c.nonfinite() == r.rows)  // no value to be constant: every row misses it
      advice.push_back(fmt::format("column '{}' has no finite value (every row is missing or non-finite): "
                                   "drop it; neither repair nor drop can save it", shown(c.name)));
    else
      advice.push_back(fmt::format("column '{}' is constant (std = 0): standardising it computes 0/0 = "
                                   "NaN; drop it, or divide by (std + eps)", shown(c.name)));
  }
  for (const auto& c : r.columns) {
    if (c.is_label) continue;
    const double absmax = std::max(std::fabs(c.min), std::fabs(c.max));
    if (std::isfinite(absmax) && absmax > 65504)
      advice.push_back(fmt::format("column '{}' reaches |x| = {:.4g}, beyond float16's 65504: "
                                   "standardise it before training in fp16/AMP", shown(c.name), absmax));
  }
  if (r.rows_robust > 0)
    advice.push_back(fmt::format(
        "{} rows have a value with |robust z| > {} (median/MAD rule): check them; `nanguard clean "
        "{} -o clean.csv --policy clip` clips every column to its fitted [P0.1, P99.9]",
        r.rows_robust, a.robust_z, a.path));
  if (advice.empty()) advice.push_back("no problems found: the data is finite and every column varies");
  return advice;
}

void print_json(const scan_args& a, const scan_report& r) {
  nlohmann::json j;
  j["file"] = a.path;
  j["rows"] = r.rows;
  j["columns"] = nlohmann::json::array();
  for (const auto& c : r.columns) {
    auto v = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); };
    j["columns"].push_back({{"name", c.name}, {"label", c.is_label}, {"missing", c.missing},
                            {"pos_inf", c.pos_inf}, {"neg_inf", c.neg_inf}, {"mean", v(c.mean)},
                            {"std", v(c.std)}, {"min", v(c.min)}, {"p0.1", v(c.p001)},
                            {"median", v(c.median)}, {"p99.9", v(c.p999)}, {"max", v(c.max)},
                            {"mad", v(c.mad)}, {"constant", c.constant},
                            {"outliers_3sigma", c.out_sigma}, {"outliers_robust_z", c.out_robust}});
  }
  j["label"] = a.label.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.label);
  j["zero_variance_columns"] = r.constant_names();
  j["rows_with_nonfinite"] = r.bad_row_count;
  j["first_rows_with_nonfinite"] = r.bad_rows;
  j["rows_with_3sigma_outlier"] = r.rows_sigma;
  j["rows_with_robust_z_outlier"] = r.rows_robust;
  nlohmann::json forest = {{"fitted", r.forest_fitted}, {"n_estimators", 100}, {"fitted_rows", r.forest_rows},
                           {"rows_below_threshold", r.rows_forest}, {"top_rows", nlohmann::json::array()}};
  for (const auto& [s, row] : r.worst) forest["top_rows"].push_back({{"row", row}, {"score", s}});
  j["isolation_forest"] = forest;
  j["advice"] = r.advice;
  fmt::print("{}\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
}

void print_text(const scan_args& a, const scan_report& r) {
  fmt::print("{}: {} rows x {} columns{}\n", a.path, r.rows, r.columns.size(),
             r.label >= 0 ? fmt::format(" (label: {})", shown(a.label)) : "");
  fmt::print("rows are numbered from 0, the first row after the header\n\n");
  size_t w = 6;
  for (const auto& c : r.columns) w = std::max(w, detail::display_width(table_name(c.name)));
  fmt::print("{:<{}} {:>8} {:>6} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>6} {:>6}\n", "column", w,
             "missing", "+inf", "-inf", "mean", "std", "min", "median", "max", ">3σ", "|rz|>" );
  for (const auto& c : r.columns)
    fmt::print("{:<{}} {:>8} {:>6} {:>6} {:>11.4g} {:>11.4g} {:>11.4g} {:>11.4g} {:>11.4g} {:>6} {:>6}{}\n",
               table_name(c.name), w, c.missing, c.pos_inf, c.neg_inf, num(c.mean), num(c.std),
               num(c.min), num(c.median), num(c.max), c.out_sigma, c.out_robust,
               c.is_label ? "  (label)" : c.constant ? "  (constant)" : "");
  fmt::print("\nrows with missing or non-finite values: {}{}\n", r.bad_row_count,
             r.bad_row_count ? " (rows " + list_rows(r.bad_rows, r.bad_row_count) + ")" : "");
  std::vector<std::string> constant = r.constant_names();
  std::transform(constant.begin(), constant.end(), constant.begin(), shown);
  fmt::print("zero-variance columns: {}\n", constant.empty() ? "none" : fmt::format("{}", fmt::join(constant, ", ")));
  fmt::print("rows with a 3σ outlier: {}; with |robust z| > {}: {}\n", r.rows_sigma, a.robust_z, r.rows_robust);
  if (r.forest_fitted) {
    fmt::print("isolation forest (100 trees, fitted on {} sampled rows; scikit-learn's score_samples, "
               "lower is odder): most anomalous rows\n", r.forest_rows);
    for (const auto& [s, row] : r.worst) fmt::print("  row {:<10} score {:.4f}\n", row, s);
  }
  fmt::print("\nadvice:\n");
  for (const auto& s : r.advice) fmt::print("  - {}\n", s);
}

int run_scan(const scan_args& a) {
  keep_memory_bounded();
  const csv_input input(a.path);
  const std::vector<std::string> names = input.open()->columns();
  scan_report r;
  r.label = find_column(names, a.label, a.path);
  // ---- pass 1: statistics and a row sample
  const column_stats stats = fit_columns(input, a.seed);
  if (stats.rows() == 0)
    throw usage_error(fmt::format("'{}' has a header and no data rows; scan needs at least one row", a.path));
  r.rows = stats.rows();
  r.columns = summarize_columns(stats, names, r.label);
  r.constant = stats.constant_columns();
  // ---- pass 2: score every row
  row_scorer scorer(a, stats, r.label);
  auto in = input.open();
  as_input_error([&] {
    int64_t base = 0;
    for (at::Tensor b = in->next_batch(kDataBatchRows); b.size(0) > 0; b = in->next_batch(kDataBatchRows)) {
      scorer.score(b, base, r);
      base += b.size(0);
    }
  });
  scorer.finish(r);
  r.advice = advise(a, r);
  if (a.json)
    print_json(a, r);
  else
    print_text(a, r);
  return r.nonfinite_total() > 0 ? exit_nonfinite : exit_ok;
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
