// firewall.h: the data firewall's policies on bad samples.
#include "nanguard/firewall.h"
#include "support.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace {

using nanguard::column_stats;
using nanguard::firewall;
using nanguard::firewall_options;
using nanguard::nonfinite_policy;
using nanguard::outlier_policy;
using nanguard::outlier_rule;
using nanguard::test::error_of;
using nanguard::test::finite_sorted;
using nanguard::test::kInf;
using nanguard::test::kNaN;
using nanguard::test::np_quantile;

at::Tensor small_batch() {
  return at::tensor({1.0, 10.0, 2.0,  //
                     kNaN, 20.0, 3.0,  //
                     3.0, kInf, 4.0,   //
                     4.0, 40.0, -kInf,  //
                     5.0, 50.0, 6.0},
                    at::kDouble)
      .reshape({5, 3});
}

TEST(firewall, raise_names_row_column_and_value) {
  firewall fw(firewall_options().column_names({"age", "income", "score"}));
  const std::string msg = error_of([&] { fw.apply(small_batch()); });
  EXPECT_NE(msg.find("row 1, column 0 ('age') holds nan"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3 non-finite value(s)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("in rows 1, 2, 3"), std::string::npos) << msg;
  // A clean batch passes untouched.
  const at::Tensor ok = at::randn({4, 3});
  const auto r = fw.apply(ok);
  EXPECT_TRUE(at::equal(r.batch, ok));
  EXPECT_TRUE(r.report.clean());
}

TEST(firewall, drop_removes_the_bad_samples) {
  firewall fw(firewall_options().nonfinite(nonfinite_policy::drop));
  const at::Tensor x = small_batch().to(at::kFloat);
  const auto r = fw.apply(x);
  EXPECT_EQ(r.batch.scalar_type(), at::kFloat);
  EXPECT_EQ(r.report.dropped_rows, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(r.report.rows_in, 5);
  EXPECT_EQ(r.report.rows_out, 2);
  EXPECT_TRUE(at::equal(r.batch, x.index_select(0, at::tensor({0, 4}, at::kLong))));
  EXPECT_EQ(r.report.columns[0].nan, 1);
  EXPECT_EQ(r.report.columns[1].pos_inf, 1);
  EXPECT_EQ(r.report.columns[2].neg_inf, 1);
  EXPECT_EQ(r.report.nonfinite(), 3);
  EXPECT_EQ(r.report.repaired(), 0);
}

TEST(firewall, nan_to_num_uses_fitted_extremes_or_the_dtype_limits) {
  // Unfitted: like at::nan_to_num.
  const at::Tensor x = small_batch().to(at::kFloat);
  const auto r = firewall(firewall_options().nonfinite(nonfinite_policy::nan_to_num)).apply(x);
  EXPECT_TRUE(at::equal(r.batch, at::nan_to_num(x)));
  EXPECT_EQ(r.report.repaired(), 3);
  EXPECT_EQ(r.report.changed_rows, (std::vector<int64_t>{1, 2, 3}));
  // Fitted: ±Inf become the largest / smallest values seen in training.
  firewall fw(firewall_options().nonfinite(nonfinite_policy::nan_to_num).nan_value(-1));
  fw.fit(small_batch());
  const at::Tensor y = fw.apply(small_batch()).batch;
  EXPECT_EQ(y[1][0].item<double>(), -1.0);
  EXPECT_EQ(y[2][1].item<double>(), 50.0);
  EXPECT_EQ(y[3][2].item<double>(), 2.0);
  // Explicit replacement values win.
  const at::Tensor z = firewall(firewall_options()
                                    .nonfinite(nonfinite_policy::nan_to_num)
                                    .posinf_value(1e3)
                                    .neginf_value(-1e3))
                           .apply(small_batch())
                           .batch;
  EXPECT_EQ(z[2][1].item<double>(), 1e3);
  EXPECT_EQ(z[3][2].item<double>(), -1e3);
}

TEST(firewall, impute_median_uses_fitted_or_batch_medians) {
  const auto own = firewall(firewall_options().nonfinite(nonfinite_policy::impute_median))
                       .apply(small_batch());
  // Batch medians of the finite values: col0 {1,3,4,5} -> 3.5, col1 {10,20,40,50} -> 30, col2 {2,3,4,6} -> 3.5.
  EXPECT_EQ(own.batch[1][0].item<double>(), 3.5);
  EXPECT_EQ(own.batch[2][1].item<double>(), 30.0);
  EXPECT_EQ(own.batch[3][2].item<double>(), 3.5);
  EXPECT_EQ(own.report.repaired(), 3);
  EXPECT_EQ(own.report.rows_out, 5);
  EXPECT_FALSE(at::isnan(own.batch).any().item<bool>());
  firewall fw(firewall_options().nonfinite(nonfinite_policy::impute_median));
  fw.fit(at::arange(101, at::kDouble).reshape({101, 1}).repeat({1, 3}));  // medians 50
  const auto r = fw.apply(small_batch());
  EXPECT_EQ(r.batch[1][0].item<double>(), 50.0);
  EXPECT_EQ(r.batch[2][1].item<double>(), 50.0);
  EXPECT_EQ(r.batch[0][0].item<double>(), 1.0);  // finite values untouched
}

TEST(firewall, clip_to_fitted_quantiles) {
  at::manual_seed(4);
  const at::Tensor train = at::randn({20000, 2}, at::kDouble);
  firewall fw(firewall_options()
                  .outliers(outlier_policy::clip)
                  .low_quantile(0.01)
                  .high_quantile(0.99));
  fw.fit(train);
  const double lo0 = np_quantile(finite_sorted(train, 0), 0.01);
  const double hi1 = np_quantile(finite_sorted(train, 1), 0.99);
  EXPECT_DOUBLE_EQ(fw.lower_bounds()[0].item<double>(), lo0);
  EXPECT_DOUBLE_EQ(fw.upper_bounds()[1].item<double>(), hi1);
  const at::Tensor batch = at::tensor({-50.0, 0.0, 0.5, 80.0, 0.1, 0.2}, at::kDouble).reshape({3, 2});
  const auto r = fw.apply(batch);
  EXPECT_DOUBLE_EQ(r.batch[0][0].item<double>(), lo0);
  EXPECT_DOUBLE_EQ(r.batch[1][1].item<double>(), hi1);
  EXPECT_EQ(r.batch[2][0].item<double>(), 0.1);
  EXPECT_EQ(r.report.clipped(), 2);
  EXPECT_EQ(r.report.outliers(), 2);
  EXPECT_EQ(r.report.changed_rows, (std::vector<int64_t>{0, 1}));
  // Clipping the training data keeps 98% of each column inside the bounds.
  const at::Tensor c = fw.apply(train).batch;
  EXPECT_EQ(c.select(1, 0).min().item<double>(), lo0);
}

// A dropped row's values never reach the output: its repairs and clips are
// not counted (clean said "clipped 4 values" of a file that had 2 clipped).
TEST(firewall, a_dropped_row_counts_no_repair_or_clip) {
  firewall clip(firewall_options().nonfinite(nonfinite_policy::drop).outliers(outlier_policy::clip));
  clip.fit(at::tensor({0.0, 0.0, 1.0, 1.0}, at::kDouble).reshape({2, 2}));
  const at::Tensor nan_and_outlier = at::tensor({kNaN, 100.0, 0.5, 0.5}, at::kDouble).reshape({2, 2});
  const auto r = clip.apply(nan_and_outlier);
  EXPECT_EQ(r.report.dropped_rows, (std::vector<int64_t>{0}));
  EXPECT_EQ(r.report.columns[1].outliers, 1);  // found, as the NaN is
  EXPECT_EQ(r.report.clipped(), 0);
  EXPECT_TRUE(r.report.changed_rows.empty());
  // A missing label drops its row under impute_median: no value of it is repaired.
  firewall repair(firewall_options().nonfinite(nonfinite_policy::impute_median).label_columns({1}));
  repair.fit(at::tensor({1.0, 0.0, 3.0, 1.0}, at::kDouble).reshape({2, 2}));
  const auto s = repair.apply(at::tensor({kNaN, kNaN, kNaN, 1.0}, at::kDouble).reshape({2, 2}));
  EXPECT_EQ(s.report.dropped_rows, (std::vector<int64_t>{0}));
  EXPECT_EQ(s.report.changed_rows, (std::vector<int64_t>{1}));
  EXPECT_EQ(s.report.columns[0].nan, 2);
  EXPECT_EQ(s.report.repaired(), 1);
}

TEST(firewall, three_sigma_and_robust_z_rules_drop_or_raise) {
  at::manual_seed(6);
  const at::Tensor train = at::randn({5000, 1}, at::kDouble) * 2 + 10;
  column_stats stats;
  stats.update(train);
  firewall sigma(firewall_options().outliers(outlier_policy::drop).rule(outlier_rule::three_sigma));
  sigma.fit(stats);
  const double m = stats.mean()[0].item<double>(), sd = stats.std()[0].item<double>();
  EXPECT_NEAR(sigma.upper_bounds()[0].item<double>(), m + 3 * sd, 1e-12);
  const at::Tensor batch = at::tensor({10.0, m + 3.1 * sd, m - 2.9 * sd, m - 3.2 * sd}, at::kDouble)
                               .reshape({4, 1});
  const auto r = sigma.apply(batch);
  EXPECT_EQ(r.report.dropped_rows, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(r.batch.size(0), 2);

  firewall robust(firewall_options().outliers(outlier_policy::raise).rule(outlier_rule::robust_z)
                      .column_names({"temp"}));
  robust.fit(stats);
  const double med = stats.median()[0].item<double>(), mad = stats.mad()[0].item<double>();
  EXPECT_NEAR(robust.upper_bounds()[0].item<double>(), med + 5.0 * mad / 0.6745, 1e-12);
  const std::string msg = error_of([&] { robust.apply(at::full({2, 1}, 1000.0, at::kDouble)); });
  EXPECT_NE(msg.find("row 0, column 0 ('temp') 1000 is outside the fitted bounds"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("2 outlier(s)"), std::string::npos) << msg;
}

// The default robust_z drops outliers, not the tails of clean data: of
// 100k rows of 64 N(0, 1) features at most 0.1% (3.5 dropped 3%).
TEST(firewall, robust_z_leaves_clean_normal_rows) {
  at::manual_seed(7);
  const at::Tensor train = at::randn({100000, 64}, at::kDouble);
  firewall fw(firewall_options().outliers(outlier_policy::drop).rule(outlier_rule::robust_z));
  fw.fit(train);
  const auto r = fw.apply(at::randn({100000, 64}, at::kDouble));
  EXPECT_LE(r.report.dropped_rows.size(), 100u) << r.report.dropped_rows.size() << " clean rows dropped";
  at::Tensor outlier = at::randn({1, 64}, at::kDouble);
  outlier[0][5] = 8.0;  // 8σ: an outlier still
  EXPECT_EQ(fw.apply(outlier).report.dropped_rows, std::vector<int64_t>{0});
}

// A 0/1 flag set in 40% of the rows has MAD 0: its bounds were [0, 0], so
// robust_z dropped 40% of the rows, or clipped every 1 to 0.
TEST(firewall, robust_z_leaves_a_feature_whose_mad_is_zero) {
  at::manual_seed(9);
  const at::Tensor flag = (at::rand({1000, 1}, at::kDouble) < 0.4).to(at::kDouble);
  const at::Tensor x = at::cat({at::randn({1000, 1}, at::kDouble), flag}, 1);
  x[7][0] = 50.0;  // an outlier of the other feature is still found
  firewall fw(firewall_options().outliers(outlier_policy::drop).rule(outlier_rule::robust_z));
  fw.fit(x);
  EXPECT_TRUE(std::isnan(fw.lower_bounds()[1].item<double>()));
  const auto r = fw.apply(x);
  EXPECT_EQ(r.report.dropped_rows, (std::vector<int64_t>{7}));
  EXPECT_EQ(r.report.columns[1].outliers, 0);
}

TEST(firewall, label_columns_are_never_made_up) {
  firewall fw(firewall_options().nonfinite(nonfinite_policy::impute_median).label_columns({2}));
  const auto r = fw.apply(small_batch());
  // Row 3's label (column 2) is -inf: the row is dropped, not imputed.
  EXPECT_EQ(r.report.dropped_rows, (std::vector<int64_t>{3}));
  EXPECT_EQ(r.report.changed_rows, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(r.batch.size(0), 4);
  EXPECT_FALSE(at::isnan(r.batch).any().item<bool>());
}

TEST(firewall, rejects_bad_options_and_unfitted_outlier_policies) {
  std::string msg = error_of([] { firewall(firewall_options().low_quantile(0.9).high_quantile(0.1)); });
  EXPECT_NE(msg.find("need 0 <= low_quantile < high_quantile <= 1 but got low_quantile=0.9"),
            std::string::npos)
      << msg;
  msg = error_of([] { firewall(firewall_options().outliers(outlier_policy::clip)).apply(at::ones({2, 2})); });
  EXPECT_NE(msg.find("outlier policies need fitted bounds; call fit(training_data) first"),
            std::string::npos)
      << msg;
  msg = error_of([] { firewall().apply(at::ones({2, 2, 2})); });
  EXPECT_NE(msg.find("expected a [batch, features] tensor but got shape [2, 2, 2]"), std::string::npos)
      << msg;
  firewall fw;
  fw.fit(at::ones({3, 2}));
  msg = error_of([&] { fw.apply(at::ones({3, 5})); });
  EXPECT_NE(msg.find("the batch has 5 features but the firewall was fitted on 2"), std::string::npos)
      << msg;
}

// A wrong dtype is a c10::TypeError (Python: TypeError), not a c10::Error of a bad value.
TEST(firewall, an_integer_batch_is_a_type_error) {
  try {
    firewall().apply(at::ones({2, 2}, at::kLong));
    FAIL() << "an integer batch was accepted";
  } catch (const c10::TypeError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("expected a floating-point tensor but got Long"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(firewall, impute_median_refuses_a_column_with_no_finite_value) {
  // There is no median to impute; it imputed nan_value (0), silently.
  at::Tensor train = at::randn({8, 3}, at::kDouble);
  train.select(1, 1).fill_(kNaN);
  firewall fw(firewall_options().nonfinite(nonfinite_policy::impute_median).column_names({"a", "b", "c"}));
  std::string msg = error_of([&] { fw.fit(train); });
  EXPECT_NE(msg.find("fit: column 1 ('b') has no finite value, so impute_median has no median to impute"),
            std::string::npos)
      << msg;
  EXPECT_FALSE(fw.fitted());
  msg = error_of([&] { firewall(firewall_options().nonfinite(nonfinite_policy::impute_median)).apply(train); });
  EXPECT_NE(msg.find("apply: column 1 has no finite value"), std::string::npos) << msg;
  // Other policies need no median; a label column is never imputed.
  EXPECT_TRUE(firewall(firewall_options().nonfinite(nonfinite_policy::drop)).fit(train).fitted());
  EXPECT_TRUE(firewall(firewall_options().nonfinite(nonfinite_policy::impute_median).label_columns({1}))
                  .fit(train)
                  .fitted());
}

TEST(firewall, refuses_non_finite_widths_replacements_and_duplicate_names) {
  std::string msg = error_of([] { firewall(firewall_options().sigmas(kInf)); });
  EXPECT_NE(msg.find("sigmas must be a finite number > 0 but is inf"), std::string::npos) << msg;
  msg = error_of([] { firewall(firewall_options().robust_z(kNaN)); });
  EXPECT_NE(msg.find("robust_z must be a finite number > 0 but is nan"), std::string::npos) << msg;
  msg = error_of([] { firewall(firewall_options().posinf_value(kNaN)); });
  EXPECT_NE(msg.find("posinf_value must be finite but is nan"), std::string::npos) << msg;
  msg = error_of([] { firewall(firewall_options().column_names({"x", "y", "x"})); });
  EXPECT_NE(msg.find("column_names holds 'x' twice (columns 0 and 2)"), std::string::npos) << msg;
  msg = error_of([] { firewall(firewall_options().column_names({"x"})).fit(at::ones({3, 2}, at::kDouble)); });
  EXPECT_NE(msg.find("1 column_names for data of 2 columns"), std::string::npos) << msg;
}

TEST(firewall, report_prints_what_was_done) {
  const auto r = firewall(firewall_options().nonfinite(nonfinite_policy::drop)).apply(small_batch());
  const std::string s = nanguard::to_string(r.report, {"a", "b", "c"});
  EXPECT_NE(s.find("rows 5 -> 2: 3 non-finite"), std::string::npos) << s;
  EXPECT_NE(s.find("dropped rows: 1, 2, 3"), std::string::npos) << s;
  EXPECT_NE(s.find("b: nan=0 +inf=1"), std::string::npos) << s;
}

}  // namespace

TEST(firewall, enum_names_round_trip_and_a_wrong_one_lists_them) {
  for (nanguard::nonfinite_policy p : nanguard::all_nonfinite_policies)
    EXPECT_EQ(p, nanguard::nonfinite_policy_from_string(nanguard::to_string(p)));
  for (nanguard::outlier_policy p : nanguard::all_outlier_policies)
    EXPECT_EQ(p, nanguard::outlier_policy_from_string(nanguard::to_string(p)));
  for (nanguard::outlier_rule r : nanguard::all_outlier_rules)
    EXPECT_EQ(r, nanguard::outlier_rule_from_string(nanguard::to_string(r)));
  EXPECT_EQ(error_of([] { nanguard::nonfinite_policy_from_string("fix"); }),
            "nanguard::nonfinite_policy_from_string: nonfinite_policy must be one of 'raise', 'drop', 'nan_to_num', "
            "'impute_median', 'ignore' but is 'fix'");
  EXPECT_EQ(error_of([] { nanguard::outlier_rule_from_string("iqr"); }),
            "nanguard::outlier_rule_from_string: outlier_rule must be one of 'quantile_range', 'three_sigma', "
            "'robust_z' but is 'iqr'");
}
