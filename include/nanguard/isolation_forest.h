// isolation_forest.h — unsupervised outlier scores for tabular data.
//
// An isolation forest (Liu, Ting & Zhou, 2008) isolates each sample with
// random axis-aligned splits; outliers are isolated after fewer splits. The
// score is scikit-learn's `score_samples`: -2^(-E[h(x)] / c(psi)), where
// E[h(x)] is the mean path length over the trees (with the c(n) correction at
// leaves cut off at depth ceil(log2 psi)) and c(psi) the mean path length of
// an unsuccessful search in a binary search tree of psi samples. Scores lie
// in [-1, 0): lower is more abnormal; about -0.5 is ordinary.
//
//   nanguard::isolation_forest forest(
//       nanguard::isolation_forest_options().n_estimators(100).seed(7));
//   forest.fit(x);                                   // [rows, features]
//   at::Tensor s = forest.score_samples(x);          // [rows], lower = odder
//   at::Tensor is_outlier = forest.predict(x) == -1;
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <vector>

namespace nanguard {

/// Options of `isolation_forest` (the names and defaults of scikit-learn's).
struct isolation_forest_options {
  /// Number of trees.
  TORCH_ARG(int64_t, n_estimators) = 100;
  /// Samples drawn (without replacement) to grow each tree; min(this, rows).
  TORCH_ARG(int64_t, max_samples) = 256;
  /// Expected share of outliers in (0, 0.5], used to set the threshold of
  /// `predict`; 0 means scikit-learn's "auto" (threshold score -0.5).
  TORCH_ARG(double, contamination) = 0.0;
  /// Seed: the same data and seed give the same forest, on any thread count.
  TORCH_ARG(uint64_t, seed) = 0;
};

/// An isolation forest; fit and scoring run in parallel with at::parallel_for.
class isolation_forest {
 public:
  /// An unfitted forest. Throws c10::Error for out-of-range options.
  explicit isolation_forest(isolation_forest_options options = {});

  /// Grows the trees on `x` ([rows, features], floating, all finite; impute
  /// missing values first, e.g. with the firewall). Returns *this.
  isolation_forest& fit(const at::Tensor& x);

  /// scikit-learn's score_samples: -2^(-E[h(x)]/c(psi)) per row ([rows],
  /// float64); lower is more abnormal. REQUIRES: fitted; same features.
  at::Tensor score_samples(const at::Tensor& x) const;
  /// score_samples(x) - offset(): negative for outliers ([rows], float64).
  at::Tensor decision_function(const at::Tensor& x) const;
  /// -1 for outliers, +1 for inliers ([rows], int64).
  at::Tensor predict(const at::Tensor& x) const;

  /// The score threshold: -0.5 for contamination 0 ("auto"), otherwise the
  /// contamination-quantile of the training scores.
  double offset() const { return offset_; }
  /// True after fit().
  bool fitted() const { return !trees_.empty(); }
  /// Features seen by fit().
  int64_t features() const { return features_; }

  /// c(n): mean path length of an unsuccessful search in a BST of n items,
  /// 2 H(n-1) - 2 (n-1) / n; c(1) = 0, c(2) = 1.
  static double average_path_length(int64_t n);

  /// One node of a tree: an internal split or a leaf.
  struct node {
    int32_t feature;   ///< split feature; -1 for a leaf
    int32_t right;     ///< index of the right child (left is this + 1)
    double value;      ///< split threshold (x <= value goes left); leaf: depth + c(size)
  };

 private:
  isolation_forest_options options_;
  int64_t features_ = 0;
  int64_t psi_ = 0;
  double offset_ = -0.5;
  std::vector<std::vector<node>> trees_;
};

}  // namespace nanguard
