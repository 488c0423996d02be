#include "nanguard/isolation_forest.h"
#include "support.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace {

using nanguard::test::error_of;

using nanguard::isolation_forest;
using nanguard::isolation_forest_options;

// ROC AUC of "lower score = outlier" by the Mann-Whitney statistic (ties count half).
double roc_auc(const at::Tensor& scores, const std::vector<bool>& is_outlier) {
  const int64_t n = scores.numel();
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const double* s = scores.data_ptr<double>();
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
  // Ranks by descending score: outliers should get the high ranks.
  double rank_sum = 0, pos = 0;
  for (int64_t i = 0; i < n;) {
    int64_t j = i;
    while (j < n && s[order[j]] == s[order[i]]) ++j;
    const double avg_rank = (double(i) + double(j - 1)) / 2 + 1;
    for (int64_t k = i; k < j; ++k)
      if (is_outlier[size_t(order[k])]) rank_sum += avg_rank, ++pos;
    i = j;
  }
  const double neg = double(n) - pos;
  return (rank_sum - pos * (pos + 1) / 2) / (pos * neg);
}

// A Gaussian blob in 8-d with 2% outliers 6-10σ from the centre in random directions.
struct planted {
  at::Tensor x;
  std::vector<bool> outlier;
};
planted blob_with_outliers(int64_t n = 5000) {
  at::manual_seed(42);
  const int64_t f = 8, k = n / 50;
  at::Tensor x = at::randn({n, f}, at::kDouble);
  at::Tensor dir = at::randn({k, f}, at::kDouble);
  dir = dir / dir.norm(2, 1, true);
  const at::Tensor radius = at::rand({k, 1}, at::kDouble) * 4 + 6;
  std::vector<bool> outlier(size_t(n), false);
  const at::Tensor where = at::randperm(n).slice(0, 0, k);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t r = where[i].item<int64_t>();
    x[r] = dir[i] * radius[i];
    outlier[size_t(r)] = true;
  }
  return {x, outlier};
}

TEST(isolation_forest, separates_planted_outliers) {
  const planted p = blob_with_outliers();
  isolation_forest forest(isolation_forest_options().seed(1));
  forest.fit(p.x);
  const at::Tensor s = forest.score_samples(p.x);
  ASSERT_EQ(s.sizes(), (at::IntArrayRef{5000}));
  const double auc = roc_auc(s, p.outlier);
  EXPECT_GE(auc, 0.95) << "AUC " << auc;
  // Scores are scikit-learn's: in [-1, 0), ordinary points near -0.5 or above.
  EXPECT_LT(s.max().item<double>(), 0.0);
  EXPECT_GE(s.min().item<double>(), -1.0);
  EXPECT_GT(s.median().item<double>(), -0.5);
  // With contamination 2%, predict flags about 2%, most of them planted.
  isolation_forest c(isolation_forest_options().seed(1).contamination(0.02));
  c.fit(p.x);
  const at::Tensor pred = c.predict(p.x);
  const int64_t flagged = (pred == -1).sum().item<int64_t>();
  EXPECT_NEAR(double(flagged), 100.0, 2.0);
  int64_t hits = 0;
  for (int64_t i = 0; i < 5000; ++i) hits += pred[i].item<int64_t>() == -1 && p.outlier[size_t(i)];
  EXPECT_GE(hits, 80);
  EXPECT_TRUE(at::allclose(c.decision_function(p.x), c.score_samples(p.x) - c.offset()));
}

TEST(isolation_forest, is_deterministic_per_seed_on_any_thread_count) {
  const planted p = blob_with_outliers(2000);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor one = isolation_forest(isolation_forest_options().seed(7)).fit(p.x).score_samples(p.x);
  at::set_num_threads(std::max(2, threads));
  const at::Tensor two = isolation_forest(isolation_forest_options().seed(7)).fit(p.x).score_samples(p.x);
  at::set_num_threads(threads);
  const at::Tensor other = isolation_forest(isolation_forest_options().seed(8)).fit(p.x).score_samples(p.x);
  EXPECT_TRUE(at::equal(one, two));
  EXPECT_FALSE(at::equal(one, other));
}

TEST(isolation_forest, average_path_length_is_the_bst_formula) {
  EXPECT_EQ(isolation_forest::average_path_length(0), 0.0);
  EXPECT_EQ(isolation_forest::average_path_length(1), 0.0);
  EXPECT_EQ(isolation_forest::average_path_length(2), 1.0);
  // 2 (ln(n-1) + γ) - 2 (n-1)/n, the value scikit-learn uses.
  EXPECT_NEAR(isolation_forest::average_path_length(256), 10.244770920119917, 1e-12);
  EXPECT_NEAR(isolation_forest::average_path_length(3), 2 * (std::log(2.0) + 0.5772156649015329) - 4.0 / 3,
              1e-15);
}

// Identical points cannot be isolated: every tree is one leaf of psi
// samples, E[h] = c(psi), so every score is exactly -2^-1.
TEST(isolation_forest, scores_of_identical_points_are_minus_one_half) {
  const at::Tensor x = at::full({300, 3}, 1.5, at::kDouble);
  const at::Tensor s = isolation_forest().fit(x).score_samples(x);
  EXPECT_TRUE(at::allclose(s, at::full_like(s, -0.5), 0, 1e-15));
}

// Three points at 0, 1 and 10 (psi = 3, depth limit 2): the split is uniform
// on (0, 10), so 10 is isolated at depth 1 with probability 0.9 and at depth
// 2 otherwise: E[h(10)] = 1.1, and its score -2^(-1.1 / c(3)), the value
// scikit-learn's score_samples converges to.
TEST(isolation_forest, matches_the_expected_path_length_of_a_known_case) {
  const at::Tensor x = at::tensor({0.0, 1.0, 10.0}, at::kDouble).reshape({3, 1});
  isolation_forest forest(isolation_forest_options().n_estimators(20000).seed(3));
  const at::Tensor s = forest.fit(x).score_samples(x);
  const double c3 = isolation_forest::average_path_length(3);
  EXPECT_NEAR(s[2].item<double>(), -std::exp2(-1.1 / c3), 2e-3);
  // 0 is alone at depth 1 when t < 1 (p 0.1); otherwise {0, 1} is split once
  // more, at depth 2: E[h(0)] = 0.1 * 1 + 0.9 * 2 = 1.9.
  EXPECT_NEAR(s[0].item<double>(), -std::exp2(-1.9 / c3), 2e-3);
  EXPECT_LT(s[2].item<double>(), s[0].item<double>());
}

TEST(isolation_forest, rejects_bad_input_with_clear_messages) {
  std::string msg = error_of([] { isolation_forest(isolation_forest_options().max_samples(1)); });
  EXPECT_NE(msg.find("max_samples must be at least 2 but is 1"), std::string::npos) << msg;
  msg = error_of([] { isolation_forest(isolation_forest_options().contamination(0.7)); });
  EXPECT_NE(msg.find("contamination must be in [0, 0.5] but is 0.7"), std::string::npos) << msg;
  at::Tensor x = at::randn({10, 2});
  x[4][1] = std::numeric_limits<float>::quiet_NaN();
  msg = error_of([&] { isolation_forest().fit(x); });
  EXPECT_NE(msg.find("x holds NaN or Inf (first at flat index 9); impute missing values first"),
            std::string::npos)
      << msg;
  msg = error_of([] { isolation_forest().score_samples(at::ones({2, 2})); });
  EXPECT_NE(msg.find("the forest is not fitted; call fit(x) first"), std::string::npos) << msg;
  isolation_forest f;
  f.fit(at::randn({10, 2}));
  msg = error_of([&] { f.score_samples(at::ones({2, 3})); });
  EXPECT_NE(msg.find("fitted on 2 features but x has 3"), std::string::npos) << msg;
}

}  // namespace
