// `nanguard clean data.csv -o out.csv --policy drop|repair|clip`: writes a
// cleaned copy of a CSV training file, atomically (temporary file + rename),
// and prints what it changed. Two streaming passes: the first fits the
// column statistics (medians, quantiles), the second applies the firewall.
//   drop    drop rows that hold a missing or non-finite value
//   repair  replace missing and non-finite values by the column median
//   clip    repair, then clip every value to the column's fitted [P0.1, P99.9]
// A row whose --label value is missing is dropped under every policy.
#include "commands.h"
#include "data_common.h"
#include "temp_file.h"
#include "validators.h"

#include <nanguard/csv.h>
#include <nanguard/firewall.h>

#include "detail/printable.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

namespace nanguard::cli {
namespace {

struct clean_args {
  std::string path;
  std::string out;
  std::string policy;
  std::string label;
  double low_quantile = 0.001;
  double high_quantile = 0.999;
  uint64_t seed = 0;
};

// A file of rows every one of which the policy dropped is no data (scan and
// train refuse it): refused, naming the columns that hold no finite value.
void refuse_an_empty_result(const clean_args& a, const std::vector<std::string>& names,
                            const firewall_report& total) {
  if (total.rows_in == 0 || total.rows_out > 0) return;
  std::vector<std::string> never_finite;
  for (size_t j = 0; j < names.size(); ++j) {
    const column_report& c = total.columns[j];
    if (c.nan + c.pos_inf + c.neg_inf == total.rows_in) never_finite.push_back("'" + names[j] + "'");
  }
  throw usage_error(fmt::format(
      "--policy {} drops every one of the {} rows of '{}' (each holds a missing or non-finite value{}); nothing "
      "written: {}",
      a.policy, total.rows_in, a.path,
      never_finite.empty() ? "" : fmt::format("; no value of {} is finite", fmt::join(never_finite, ", ")),
      never_finite.empty() ? "fix the data" : "remove that column or fix the data"));
}

int run_clean(const clean_args& a) {
  if (!(a.low_quantile < a.high_quantile))
    throw usage_error(fmt::format("need --low-quantile < --high-quantile but got {} and {}", a.low_quantile,
                                  a.high_quantile));
  keep_memory_bounded();
  const csv_input input(a.path);
  auto in = input.open();
  const std::vector<std::string> names = in->columns();
  const int64_t label = find_column(names, a.label, a.path);
  column_stats stats = fit_columns(input, a.seed);

  firewall_options o;
  o.column_names(names).low_quantile(a.low_quantile).high_quantile(a.high_quantile);
  if (label >= 0) o.label_columns({label});
  if (a.policy == "drop") {
    o.nonfinite(nonfinite_policy::drop);
  } else if (a.policy == "repair") {
    o.nonfinite(nonfinite_policy::impute_median);
  } else {  // clip
    o.nonfinite(nonfinite_policy::impute_median).outliers(outlier_policy::clip);
  }
  firewall fw(o);
  if (stats.rows() > 0) {
    try {
      fw.fit(std::move(stats));
    } catch (const c10::Error& e) {  // a column with no value to impute
      throw usage_error(fmt::format("cannot {} '{}': {}", a.policy, a.path, e.what_without_backtrace()));
    }
  }

  firewall_report total;
  total.columns.assign(names.size(), column_report{});
  int64_t dropped = 0, changed = 0;
  std::vector<int64_t> dropped_rows, changed_rows;
  csv_writer out = as_input_error([&] { return csv_writer(a.out, names); });
  const removed_on_signal cleanup(out.temp_path());
  as_input_error([&] {
    int64_t base = 0;
    for (at::Tensor b = in->next_batch(kDataBatchRows); b.size(0) > 0; b = in->next_batch(kDataBatchRows)) {
      const firewall_result r = fw.apply(b);
      out.write(r.batch);
      total.rows_in += r.report.rows_in;
      total.rows_out += r.report.rows_out;
      for (size_t j = 0; j < names.size(); ++j) {
        const column_report& c = r.report.columns[j];
        column_report& t = total.columns[j];
        t.nan += c.nan, t.pos_inf += c.pos_inf, t.neg_inf += c.neg_inf;
        t.outliers += c.outliers, t.repaired += c.repaired, t.clipped += c.clipped;
      }
      for (int64_t i : r.report.dropped_rows)
        if (dropped_rows.size() < 10) dropped_rows.push_back(base + i);
      for (int64_t i : r.report.changed_rows)
        if (changed_rows.size() < 10) changed_rows.push_back(base + i);
      dropped += int64_t(r.report.dropped_rows.size());
      changed += int64_t(r.report.changed_rows.size());
      base += b.size(0);
    }
  });
  refuse_an_empty_result(a, names, total);
  as_input_error([&] { out.commit(); });

  fmt::print("wrote {}: {} -> {} rows (policy {})\n", a.out, total.rows_in, total.rows_out, a.policy);
  fmt::print("  dropped {} rows{}\n", dropped, dropped ? " (rows " + list_rows(dropped_rows, dropped) + ")" : "");
  fmt::print("  repaired {} values, clipped {} values, in {} rows{}\n", total.repaired(), total.clipped(),
             changed, changed ? " (rows " + list_rows(changed_rows, changed) + ")" : "");
  for (size_t j = 0; j < names.size(); ++j) {
    const column_report& c = total.columns[j];
    if (c.nan + c.pos_inf + c.neg_inf + c.clipped == 0) continue;
    fmt::print("  {}: missing={} +inf={} -inf={} repaired={} clipped={}\n", detail::printable(names[j]), c.nan,
               c.pos_inf, c.neg_inf, c.repaired, c.clipped);
  }
  if (total.rows_in == 0) fmt::print("  (the file has a header and no rows)\n");
  return exit_ok;
}

}  // namespace

command add_clean_command(CLI::App& app) {
  auto* sub = app.add_subcommand("clean", "Write a cleaned copy of a CSV training file (atomically)");
  auto a = std::make_shared<clean_args>();
  sub->add_option("file", a->path, "CSV file with a header row and numeric columns")->required();
  sub->add_option("-o,--output", a->out, "the cleaned CSV file to write")->required();
  sub->add_option("--policy", a->policy,
                  "drop: drop rows with missing/non-finite values; repair: impute column medians; "
                  "clip: repair, then clip to the fitted [P0.1, P99.9]")
      ->required()
      ->check(CLI::IsMember({"drop", "repair", "clip"}));
  sub->add_option("--label", a->label, "the label column: never imputed or clipped; rows missing it are dropped");
  sub->add_option("--low-quantile", a->low_quantile, "lower clipping quantile (clip)")->check(finite_in(0, 1));
  sub->add_option("--high-quantile", a->high_quantile, "upper clipping quantile (clip)")->check(finite_in(0, 1));
  sub->add_option("--seed", a->seed, "seed of the row sample behind the quantiles")->check(non_negative_integer());
  sub->footer("FILE may be a pipe or /dev/stdin (read once, into a temporary copy in $TMPDIR). The output is "
              "written to a temporary file and renamed into place; a signal removes the temporary.\n" +
              exit_codes("written"));
  return {sub, [a] { return run_clean(*a); }};
}

}  // namespace nanguard::cli
