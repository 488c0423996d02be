#include "nanguard/isolation_forest.h"

#include "nanguard/spelling.h"

#include "detail/random.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_set>

namespace nanguard {
namespace {

using node = isolation_forest::node;

at::Tensor as_rows(const at::Tensor& x, const char* fn, int64_t features) {
  TORCH_CHECK(x.defined(), "nanguard::isolation_forest::", fn, ": the tensor is undefined");
  TORCH_CHECK(x.dim() == 2, "nanguard::isolation_forest::", fn,
              ": expected a [rows, features] tensor but got shape ", x.sizes(),
              "; flatten each sample to one row first (x.flatten(1))");
  TORCH_CHECK_TYPE(x.is_floating_point(), "nanguard::isolation_forest::", fn,
                   ": expected a floating-point tensor but got ", x.scalar_type(),
                   "; convert it with ", spelled("x.to(at::kDouble)", "x.double()"));
  TORCH_CHECK(features <= 0 || x.size(1) == features, "nanguard::isolation_forest::", fn,
              ": the forest was fitted on ", features, " features but x has ", x.size(1),
              "; score data with the same columns");
  const at::Tensor d = x.to(at::kCPU, at::kDouble).contiguous();
  TORCH_CHECK(at::isfinite(d).all().item<bool>(), "nanguard::isolation_forest::", fn,
              ": x holds NaN or Inf (first at flat index ",
              at::logical_not(at::isfinite(d)).reshape({-1}).nonzero()[0].item<int64_t>(),
              "); impute missing values first (nanguard::firewall with impute_median)");
  return d;
}

struct builder {
  const double* x;  // [psi, f] compact copy of the tree's sample
  int64_t f;
  int max_depth;
  uint64_t rng;
  std::vector<int64_t> idx;
  std::vector<int32_t> feature_order;
  std::vector<node> nodes;

  void build(int64_t lo, int64_t hi, int depth) {
    const int64_t size = hi - lo;
    if (depth >= max_depth || size <= 1) {
      nodes.push_back({-1, -1, depth + isolation_forest::average_path_length(size)});
      return;
    }
    // Features in random order; the first one that is not constant here splits.
    for (int64_t k = f - 1; k > 0; --k)
      std::swap(feature_order[k], feature_order[detail::next_random(rng) % uint64_t(k + 1)]);
    for (int32_t feat : feature_order) {
      double lo_v = x[idx[lo] * f + feat], hi_v = lo_v;
      for (int64_t i = lo + 1; i < hi; ++i) {
        const double v = x[idx[i] * f + feat];
        lo_v = std::min(lo_v, v);
        hi_v = std::max(hi_v, v);
      }
      if (!(lo_v < hi_v)) continue;
      double t = lo_v + detail::next_uniform(rng) * (hi_v - lo_v);
      if (t >= hi_v) t = lo_v;  // rounding: keep both sides non-empty
      const auto mid = std::partition(idx.begin() + lo, idx.begin() + hi,
                                      [&](int64_t r) { return x[r * f + feat] <= t; });
      const int64_t m = mid - idx.begin();
      const size_t me = nodes.size();
      nodes.push_back({feat, -1, t});
      build(lo, m, depth + 1);
      nodes[me].right = int32_t(nodes.size());
      build(m, hi, depth + 1);
      return;
    }
    // Every feature is constant on these samples: they cannot be separated.
    nodes.push_back({-1, -1, depth + isolation_forest::average_path_length(size)});
  }
};

double path_length(const std::vector<node>& tree, const double* row) {
  const node* n = tree.data();
  int32_t i = 0;
  while (n[i].feature >= 0) i = row[n[i].feature] <= n[i].value ? i + 1 : n[i].right;
  return n[i].value;
}

}  // namespace

double isolation_forest::average_path_length(int64_t n) {
  if (n <= 1) return 0.0;
  if (n == 2) return 1.0;
  constexpr double euler_gamma = 0.5772156649015329;
  const double m = double(n - 1);
  return 2.0 * (std::log(m) + euler_gamma) - 2.0 * m / double(n);
}

isolation_forest::isolation_forest(isolation_forest_options options) : options_(options) {
  TORCH_CHECK(options_.n_estimators() >= 1, "nanguard::isolation_forest: n_estimators must be at "
              "least 1 but is ", options_.n_estimators(), "; 100 is the usual choice");
  TORCH_CHECK(options_.max_samples() >= 2, "nanguard::isolation_forest: max_samples must be at "
              "least 2 but is ", options_.max_samples(), "; 256 is the usual choice");
  TORCH_CHECK(options_.contamination() >= 0 && options_.contamination() <= 0.5,
              "nanguard::isolation_forest: contamination must be in [0, 0.5] but is ",
              options_.contamination(), "; pass the expected share of outliers, or 0 for 'auto'");
}

isolation_forest& isolation_forest::fit(const at::Tensor& x) {
  const at::Tensor d = as_rows(x, "fit", 0);
  const int64_t n = d.size(0), f = d.size(1);
  TORCH_CHECK(n >= 2 && f >= 1, "nanguard::isolation_forest::fit: x has shape ", d.sizes(),
              "; it needs at least two rows and one feature");
  TORCH_CHECK(f < (int64_t(1) << 31), "nanguard::isolation_forest::fit: too many features (", f, ")");
  const double* data = d.data_ptr<double>();
  const int64_t psi = std::min(options_.max_samples(), n);
  const int max_depth = int(std::ceil(std::log2(double(std::max<int64_t>(psi, 2)))));
  const int64_t trees = options_.n_estimators();
  std::vector<std::vector<node>> grown(static_cast<size_t>(trees));

  at::parallel_for(0, trees, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sample(size_t(psi * f));
    for (int64_t t = begin; t < end; ++t) {
      uint64_t rng = detail::splitmix64(options_.seed() ^ detail::splitmix64(uint64_t(t) + 1));
      // psi distinct rows (Floyd's algorithm), in a random order.
      std::vector<int64_t> rows;
      rows.reserve(size_t(psi));
      if (psi == n) {
        rows.resize(size_t(n));
        std::iota(rows.begin(), rows.end(), 0);
      } else {
        std::unordered_set<int64_t> chosen;
        chosen.reserve(size_t(psi * 2));
        for (int64_t j = n - psi; j < n; ++j) {
          const int64_t r = int64_t(detail::next_random(rng) % uint64_t(j + 1));
          const int64_t pick = chosen.insert(r).second ? r : (chosen.insert(j), j);
          rows.push_back(pick);
        }
      }
      for (int64_t i = 0; i < psi; ++i)
        std::copy(data + rows[i] * f, data + (rows[i] + 1) * f, sample.begin() + i * f);
      builder b{sample.data(), f, max_depth, rng, {}, {}, {}};
      b.idx.resize(size_t(psi));
      std::iota(b.idx.begin(), b.idx.end(), 0);
      b.feature_order.resize(size_t(f));
      std::iota(b.feature_order.begin(), b.feature_order.end(), 0);
      b.nodes.reserve(size_t(2 * psi));
      b.build(0, psi, 0);
      grown[size_t(t)] = std::move(b.nodes);
    }
  });
  trees_ = std::move(grown);
  features_ = f;
  psi_ = psi;
  offset_ = -0.5;
  if (options_.contamination() > 0) {
    at::Tensor s = std::get<0>(at::sort(score_samples(d)));
    const double* sv = s.data_ptr<double>();
    const double pos = options_.contamination() * double(n - 1);
    const int64_t lo = int64_t(std::floor(pos));
    const int64_t hi = std::min(lo + 1, n - 1);
    offset_ = sv[lo] + (sv[hi] - sv[lo]) * (pos - double(lo));
  }
  return *this;
}

at::Tensor isolation_forest::score_samples(const at::Tensor& x) const {
  TORCH_CHECK(fitted(), "nanguard::isolation_forest::score_samples: the forest is not fitted; "
              "call fit(x) first");
  const at::Tensor d = as_rows(x, "score_samples", features_);
  const int64_t n = d.size(0), f = d.size(1);
  at::Tensor out = at::empty({n}, at::kDouble);
  const double* data = d.data_ptr<double>();
  double* o = out.data_ptr<double>();
  const double norm = average_path_length(psi_) * double(trees_.size());
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const double* row = data + i * f;
      double h = 0;
      for (const auto& tree : trees_) h += path_length(tree, row);
      o[i] = -std::exp2(-h / norm);
    }
  });
  return out;
}

at::Tensor isolation_forest::decision_function(const at::Tensor& x) const {
  return score_samples(x) - offset_;
}

at::Tensor isolation_forest::predict(const at::Tensor& x) const {
  const at::Tensor dfn = decision_function(x);
  return at::where(dfn < 0, at::full_like(dfn, -1, at::kLong), at::ones_like(dfn, at::kLong));
}

}  // namespace nanguard
