// column_stats.h: streaming per-feature statistics against reference values.
#include "nanguard/column_stats.h"
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
using nanguard::column_stats_options;
using nanguard::test::error_of;
using nanguard::test::finite_sorted;
using nanguard::test::kInf;
using nanguard::test::kNaN;
using nanguard::test::np_quantile;

// Data with NaN/Inf sprinkled in, a constant column and an all-NaN column.
at::Tensor messy_data(int64_t n) {
  at::manual_seed(11);
  at::Tensor x = at::randn({n, 5}, at::kDouble) * at::tensor({1.0, 10.0, 1e-3, 1.0, 1.0}, at::kDouble) +
                 at::tensor({0.0, 1e6, -5.0, 0.0, 0.0}, at::kDouble);
  x.select(1, 3).fill_(2.5);   // constant
  x.select(1, 4).fill_(kNaN);  // nothing finite
  x[1][0] = kNaN;
  x[2][0] = kInf;
  x[3][1] = -kInf;
  x[4][1] = kNaN;
  return x;
}

TEST(column_stats, matches_reference_moments_and_counts) {
  // Rounded to float32 first, so the float32 batch below holds the same values.
  const at::Tensor x = messy_data(1000).to(at::kFloat).to(at::kDouble);
  column_stats s;
  // Uneven batches, one of them empty: the merge must not depend on them.
  s.update(x.slice(0, 0, 1));
  s.update(x.slice(0, 1, 1));
  s.update(x.slice(0, 1, 377));
  s.update(x.slice(0, 377, 1000).to(at::kFloat));  // any floating dtype
  EXPECT_EQ(s.rows(), 1000);
  EXPECT_EQ(s.features(), 5);
  EXPECT_EQ(s.nan_count()[0].item<int64_t>(), 1);
  EXPECT_EQ(s.posinf_count()[0].item<int64_t>(), 1);
  EXPECT_EQ(s.neginf_count()[1].item<int64_t>(), 1);
  EXPECT_EQ(s.nan_count()[1].item<int64_t>(), 1);
  EXPECT_EQ(s.nan_count()[4].item<int64_t>(), 1000);
  EXPECT_EQ(s.finite_count()[0].item<int64_t>(), 998);
  for (int64_t j = 0; j < 4; ++j) {
    const std::vector<double> v = finite_sorted(x, j);
    long double sum = 0;
    for (double e : v) sum += e;
    const long double mean = sum / v.size();
    long double m2 = 0;
    for (double e : v) m2 += (e - mean) * (e - mean);
    const double sd = std::sqrt(double(m2 / v.size()));
    EXPECT_NEAR(s.mean()[j].item<double>(), double(mean), 1e-12 * (1 + std::fabs(double(mean)))) << j;
    EXPECT_NEAR(s.std()[j].item<double>(), sd, 1e-9 * (sd + 1e-300)) << j;
    EXPECT_EQ(s.min()[j].item<double>(), v.front()) << j;
    EXPECT_EQ(s.max()[j].item<double>(), v.back()) << j;
  }
  EXPECT_TRUE(std::isnan(s.mean()[4].item<double>()));
  EXPECT_EQ(s.std()[3].item<double>(), 0.0);
  EXPECT_EQ(s.constant_columns(), (std::vector<int64_t>{3, 4}));
}

// Squared deviations past 1.3e154 overflow a double: std was 0 (the firewall's
// three_sigma rule then dropped every row), and sums near 1e308 made the mean inf.
TEST(column_stats, huge_finite_values_keep_a_finite_mean_and_std) {
  column_stats s;
  s.update(at::tensor({1e200, -1e200, 2e200}, at::kDouble));
  EXPECT_NEAR(s.mean().item<double>() / 6.666666666666667e199, 1.0, 1e-12);
  EXPECT_NEAR(s.std().item<double>() / 1.247219128924647e200, 1.0, 1e-12);  // numpy's std
  s.update(at::tensor({-2e200}, at::kDouble));  // merged across batches
  EXPECT_NEAR(s.std().item<double>() / 1.5811388300841898e200, 1.0, 1e-12);
  column_stats near_max;
  near_max.update(at::tensor({1e308, 1e308, -1e308}, at::kDouble));
  EXPECT_NEAR(near_max.mean().item<double>() / 3.3333333333333333e307, 1.0, 1e-12);
  EXPECT_NEAR(near_max.std().item<double>() / 9.428090415820634e307, 1.0, 1e-12);
}

// b - a overflows for -1.7e308 and 1.7e308: the interpolation must not.
TEST(column_stats, quantiles_between_values_near_the_double_limit_stay_finite) {
  column_stats s;
  s.update(at::tensor({1.7e308, -1.7e308}, at::kDouble));
  EXPECT_EQ(s.median().item<double>(), 0.0);
  EXPECT_NEAR(s.quantile(0.001).item<double>() / -1.6966e308, 1.0, 1e-12);
  EXPECT_NEAR(s.quantile(0.999).item<double>() / 1.6966e308, 1.0, 1e-12);
  EXPECT_EQ(s.quantile(0).item<double>(), -1.7e308);
  EXPECT_EQ(s.quantile(1).item<double>(), 1.7e308);
}

TEST(column_stats, quantiles_median_and_mad_are_exact_within_the_reservoir) {
  const at::Tensor x = messy_data(999);
  column_stats s(column_stats_options().reservoir_rows(1000));
  s.update(x);
  EXPECT_EQ(s.quantile_rank_error(0.5), 0.0);
  for (int64_t j = 0; j < 3; ++j) {
    const std::vector<double> v = finite_sorted(x, j);
    for (double q : {0.0, 0.001, 0.25, 0.5, 0.9, 0.999, 1.0})
      EXPECT_DOUBLE_EQ(s.quantile(q)[j].item<double>(), np_quantile(v, q)) << j << " q=" << q;
    const double med = np_quantile(v, 0.5);
    std::vector<double> dev;
    for (double e : v) dev.push_back(std::fabs(e - med));
    std::sort(dev.begin(), dev.end());
    EXPECT_DOUBLE_EQ(s.median()[j].item<double>(), med);
    EXPECT_DOUBLE_EQ(s.mad()[j].item<double>(), np_quantile(dev, 0.5)) << j;
  }
  EXPECT_NE(error_of([&] { s.quantile(99.9); }).find("q must be in [0, 1] but is 99.9"),
            std::string::npos);
}

// Beyond the reservoir the quantiles are approximate: on uniform data the
// value *is* the rank, so the error is measured directly against the bound.
TEST(column_stats, quantiles_stay_within_the_stated_rank_error) {
  at::manual_seed(5);
  column_stats s(column_stats_options().reservoir_rows(4096).seed(5));
  for (int b = 0; b < 50; ++b) s.update(at::rand({4000, 3}, at::kDouble));
  EXPECT_EQ(s.rows(), 200000);
  EXPECT_EQ(s.sample().size(0), 4096);
  for (double q : {0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999}) {
    const double bound = s.quantile_rank_error(q);
    EXPECT_GT(bound, 0.0);
    EXPECT_LT(bound, 0.035);
    for (int64_t j = 0; j < 3; ++j)
      EXPECT_NEAR(s.quantile(q)[j].item<double>(), q, bound) << "q=" << q << " column " << j;
  }
}

TEST(column_stats, takes_a_1d_tensor_as_one_feature) {
  column_stats s;
  s.update(at::tensor({1.0, 2.0, 3.0, kNaN}, at::kFloat));
  EXPECT_EQ(s.features(), 1);
  EXPECT_EQ(s.median()[0].item<double>(), 2.0);
  EXPECT_EQ(s.nan_count()[0].item<int64_t>(), 1);
  const std::string msg = error_of([&] { s.update(at::ones({2, 2, 2})); });
  EXPECT_NE(msg.find("expected a [rows, features] (or 1-D) tensor but got shape [2, 2, 2]"),
            std::string::npos)
      << msg;
}

TEST(column_stats, sample_is_deterministic_per_seed) {
  at::manual_seed(2);
  const at::Tensor x = at::randn({5000, 2}, at::kDouble);
  column_stats a(column_stats_options().reservoir_rows(100).seed(9));
  column_stats b(column_stats_options().reservoir_rows(100).seed(9));
  column_stats c(column_stats_options().reservoir_rows(100).seed(10));
  a.update(x);
  b.update(x.slice(0, 0, 1234));
  b.update(x.slice(0, 1234));
  c.update(x);
  EXPECT_TRUE(at::equal(a.sample(), b.sample()));
  EXPECT_FALSE(at::equal(a.sample(), c.sample()));
}

TEST(column_stats, zscores_follow_the_3_sigma_and_robust_rules) {
  // Column 0: 1..9 and 100; column 1: constant (no z-score).
  std::vector<double> v;
  for (int i = 1; i <= 9; ++i) v.insert(v.end(), {double(i), 4.0});
  v.insert(v.end(), {100.0, 4.0});
  const at::Tensor x = at::tensor(v, at::kDouble).reshape({10, 2});
  column_stats s;
  s.update(x);
  const double mean = 145.0 / 10;
  double m2 = 0;
  for (int i = 0; i < 10; ++i) m2 += std::pow(x[i][0].item<double>() - mean, 2);
  const double sd = std::sqrt(m2 / 10);
  const at::Tensor z = s.zscore(x);
  EXPECT_NEAR(z[9][0].item<double>(), (100 - mean) / sd, 1e-12);
  EXPECT_TRUE(std::isnan(z[0][1].item<double>()));
  // The mean and std are dragged by the outlier (3σ misses it: z = 3.0)...
  EXPECT_LT(std::fabs(z[9][0].item<double>()), 3.01);
  // ...the median (5.5) and MAD (2.5) are not.
  const at::Tensor rz = s.robust_zscore(x);
  EXPECT_NEAR(rz[9][0].item<double>(), 0.6745 * (100 - 5.5) / 2.5, 1e-12);
  EXPECT_GT(rz[9][0].item<double>(), 3.5);
  EXPECT_LT(std::fabs(rz[8][0].item<double>()), 3.5);
  EXPECT_TRUE(std::isnan(rz[0][1].item<double>()));
  // A non-finite value has no z-score (it is not an outlier, it is missing).
  const at::Tensor bad = at::tensor({kInf, 4.0, kNaN, 4.0}, at::kDouble).reshape({2, 2});
  EXPECT_TRUE(at::isnan(s.zscore(bad).select(1, 0)).all().item<bool>());
  EXPECT_TRUE(at::isnan(s.robust_zscore(bad).select(1, 0)).all().item<bool>());
  const std::string msg = error_of([&] { s.zscore(at::ones({2, 3}, at::kDouble)); });
  EXPECT_NE(msg.find("the batch has 3 features but the statistics were fitted on 2"), std::string::npos)
      << msg;
}

}  // namespace
