#include "nanguard/sentinel.h"

#include "census/census_kernels.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace {

using nanguard::sentinel;

std::vector<std::pair<std::string, at::Tensor>> params_with_grads(at::ScalarType t = at::kFloat) {
  torch::manual_seed(0);
  std::vector<std::pair<std::string, at::Tensor>> p;
  for (int64_t n : {1, 7, 1000, (1 << 17) + 5}) {  // one spans several work items
    at::Tensor w = torch::zeros({n}, at::TensorOptions(t).requires_grad(true));
    w.mutable_grad() = torch::randn({n}, t) * 3;
    p.emplace_back("p" + std::to_string(n), w);
  }
  at::Tensor no_grad = torch::zeros({4}, at::TensorOptions(t).requires_grad(true));
  p.emplace_back("unused", no_grad);
  return p;
}

TEST(sentinel, norms_match_at_norm) {
  for (auto t : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    const auto p = params_with_grads(t);
    const sentinel s(p);
    const auto r = s.inspect_grads();
    ASSERT_TRUE(r.finite());
    double total = 0;
    const double tol = t == at::kFloat || t == at::kDouble ? 1e-6 : 1e-3;
    for (size_t i = 0; i + 1 < p.size(); ++i) {
      const double want = p[i].second.grad().to(at::kDouble).norm().item<double>();
      EXPECT_NEAR(want, r.norms[i], tol * want) << p[i].first << " " << t;
      total += want * want;
    }
    EXPECT_EQ(0, r.norms.back());
    EXPECT_NEAR(std::sqrt(total), r.total_norm, tol * std::sqrt(total));
  }
}

TEST(sentinel, float64_gradients_beyond_1e154_have_finite_norms) {
  // Their squares pass float64's range; their norms do not: a diverging
  // float64 run is clipped to max_norm, not zeroed by an infinite norm.
  std::vector<std::pair<std::string, at::Tensor>> p;
  for (int64_t n : {3, (1 << 17) + 5}) {  // the second spans several work items
    at::Tensor w = torch::zeros({n}, at::TensorOptions(at::kDouble).requires_grad(true));
    w.mutable_grad() = torch::randn({n}, at::kDouble) * 1e160;
    p.emplace_back("p" + std::to_string(n), w);
  }
  at::Tensor strided = torch::zeros({4, 4}, at::TensorOptions(at::kDouble).requires_grad(true));
  strided.mutable_grad() = (torch::randn({4, 4}, at::kDouble) * 1e200).t();  // through census_many
  p.emplace_back("strided", strided);
  const sentinel s(p);
  const auto r = s.inspect_grads();
  ASSERT_TRUE(r.finite());
  std::vector<double> want;
  for (const auto& [name, w] : p) want.push_back((w.grad() / 1e150).norm().item<double>() * 1e150);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(want[i], r.norms[i], 1e-9 * want[i]) << p[i].first;
  const double total = std::sqrt(want[0] / 1e200 * (want[0] / 1e200) + want[1] / 1e200 * (want[1] / 1e200) +
                                 want[2] / 1e200 * (want[2] / 1e200)) * 1e200;
  EXPECT_NEAR(total, r.total_norm, 1e-9 * total);
}

TEST(sentinel, every_kernel_isa_gives_the_same_sums) {
  const at::Tensor x = torch::randn({100003});
  at::Tensor y = x.clone();
  y[77777] = INFINITY;
  y[5] = NAN;
  const double want = x.to(at::kDouble).pow(2).sum().item<double>();
  for (auto isa : {nanguard::detail::kernel_isa::baseline, nanguard::detail::kernel_isa::avx2,
                   nanguard::detail::kernel_isa::avx512}) {
    nanguard::detail::force_isa(isa);
    const auto p = nanguard::detail::sumsq_f32(x.data_ptr<float>(), x.numel());
    EXPECT_NEAR(want, p.sumsq, 1e-6 * want);
    EXPECT_EQ(0, p.nonfinite);
    const auto q = nanguard::detail::sumsq_f32(y.data_ptr<float>(), y.numel());
    EXPECT_EQ(2, q.nonfinite);
    const double finite_part = want - double(x[77777].item<float>()) * x[77777].item<float>() -
                               double(x[5].item<float>()) * x[5].item<float>();
    EXPECT_NEAR(finite_part, q.sumsq, 1e-6 * want);
  }
  nanguard::detail::force_isa(nanguard::detail::kernel_isa::best);
  // Squares beyond float range are summed exactly in double, not called Inf.
  const at::Tensor huge = torch::full({10}, 1e20f);
  const auto h = nanguard::detail::sumsq_f32(huge.data_ptr<float>(), 10);
  EXPECT_EQ(0, h.nonfinite);
  EXPECT_NEAR(10 * 1e40, h.sumsq, 1e34);
}

TEST(sentinel, counts_nonfinite_per_parameter_and_names_the_first) {
  auto p = params_with_grads();
  p[2].second.grad()[3] = NAN;
  p[3].second.grad()[100000] = -INFINITY;
  p[3].second.grad()[100001] = INFINITY;
  const sentinel s(p);
  const auto r = s.inspect_grads();
  EXPECT_FALSE(r.finite());
  EXPECT_EQ(3, r.nonfinite);
  EXPECT_EQ(0, r.nonfinite_counts[0]);
  EXPECT_EQ(1, r.nonfinite_counts[2]);
  EXPECT_EQ(2, r.nonfinite_counts[3]);
  EXPECT_EQ("p1000", r.first_nonfinite_name);
  EXPECT_TRUE(std::isnan(r.total_norm));
  EXPECT_TRUE(std::isnan(r.norms[2]));
  EXPECT_FALSE(std::isnan(r.norms[1]));
}

TEST(sentinel, reports_unscaled_norms_and_applies_one_factor) {
  const auto p = params_with_grads();
  const sentinel s(p);
  const double unscaled = s.inspect_grads().total_norm;
  for (auto& [n, t] : p) if (t.grad().defined()) t.grad().mul_(1024);
  EXPECT_NEAR(unscaled, s.inspect_grads(1.0 / 1024).total_norm, 1e-6 * unscaled);
  s.apply_factor_(1.0 / 1024);
  EXPECT_NEAR(unscaled, s.inspect_grads().total_norm, 1e-6 * unscaled);
}

TEST(sentinel, applies_a_factor_bit_for_bit_as_a_multi_tensor_mul) {
  // What at::_foreach_mul_ writes, for every dtype, on the calling thread
  // and (with a gradient big enough) on several; each gradient's version
  // bumped as an in-place write bumps it.
  for (auto t : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (bool big : {false, true}) {
      auto p = params_with_grads(t);
      if (big) {
        at::Tensor w = torch::zeros({(1 << 18) + 3}, at::TensorOptions(t).requires_grad(true));
        w.mutable_grad() = torch::randn({(1 << 18) + 3}, t);
        p.emplace_back("big", w);
      }
      std::vector<at::Tensor> want;
      std::vector<int64_t> versions;
      for (const auto& [name, w] : p) {
        want.push_back(w.grad().defined() ? w.grad().clone() : at::Tensor());
        versions.push_back(w.grad().defined() ? w.grad()._version() : 0);
        if (want.back().defined()) at::_foreach_mul_(want.back(), 1.0 / 3);
      }
      sentinel(p).apply_factor_(1.0 / 3);
      for (size_t i = 0; i < p.size(); ++i) {
        if (!want[i].defined()) continue;
        EXPECT_TRUE(torch::equal(want[i], p[i].second.grad())) << p[i].first << " " << t << " big " << big;
        EXPECT_GT(p[i].second.grad()._version(), versions[i]) << p[i].first << " " << t;
      }
    }
  }
}

TEST(sentinel, checks_the_loss) {
  const sentinel s({});
  double v = 0;
  EXPECT_TRUE(s.check_loss(torch::full({}, 2.5), &v));
  EXPECT_EQ(2.5, v);
  EXPECT_FALSE(s.check_loss(torch::full({1}, NAN)));
  EXPECT_FALSE(s.check_loss(torch::full({}, -INFINITY)));
  try {
    s.check_loss(torch::ones({2, 3}));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("the loss must hold one element but has shape [2, 3]"));
  }
}

TEST(spike_detector, flags_a_spike_after_warmup_only) {
  nanguard::spike_detector d(nanguard::spike_options().window(10).min_samples(5).threshold(6));
  EXPECT_EQ(0, d.observe(100));  // too few samples: never a spike
  d.reset();
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(d.is_spike(d.observe(1.0 + 0.01 * (i % 5))));
  EXPECT_TRUE(d.is_spike(d.observe(5.0)));
  EXPECT_EQ(10, d.size());
  EXPECT_EQ(0, d.observe(NAN));
  EXPECT_EQ(10, d.size());
  EXPECT_FALSE(d.is_spike(d.observe(1.02)));
}

// The median of an even window averages its two middle values: 1.7e308 +
// 1.75e308 overflows, the median must not (an inf median made every z NaN).
TEST(spike_detector, a_window_near_the_double_limit_gives_finite_scores) {
  nanguard::spike_detector d(nanguard::spike_options().window(10).min_samples(4).threshold(6));
  for (double x : {1.7e308, 1.75e308, 1.7e308, 1.75e308}) d.observe(x);
  const double z = d.observe(1.725e308);
  EXPECT_TRUE(std::isfinite(z)) << z;
  EXPECT_NEAR(z, 0.0, 1e-9);
}

TEST(spike_detector, validates_options) {
  try {
    nanguard::spike_detector d(nanguard::spike_options().window(2));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("window must be at least 3 but is 2"));
  }
  try {
    nanguard::spike_detector d(nanguard::spike_options().window(10).min_samples(11));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("min_samples must be in [3, window=10] but is 11"));
  }
}

TEST(sentinel, observe_reports_grad_norm_spikes) {
  sentinel s({}, nanguard::spike_options().window(10).min_samples(5));
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(s.observe(1.0, 2.0 + 0.1 * (i % 2)).empty());
  const auto spikes = s.observe(1.0, 100.0);
  ASSERT_EQ(1u, spikes.size());
  EXPECT_EQ("grad_norm", spikes[0].series);
  EXPECT_EQ(0u, nanguard::to_string(spikes[0]).find("grad_norm 100 (z="));
}

}  // namespace

namespace {

TEST(sentinel, measures_sparse_gradients_by_their_values) {
  torch::nn::Embedding emb(torch::nn::EmbeddingOptions(10, 4).sparse(true));
  emb->forward(torch::tensor({1, 3, 3})).sum().backward();
  ASSERT_TRUE(emb->weight.grad().is_sparse());
  const nanguard::sentinel s(emb->named_parameters().pairs());
  const auto r = s.inspect_grads();
  EXPECT_TRUE(r.finite());
  EXPECT_NEAR(emb->weight.grad().to_dense().norm().item<double>(), r.total_norm, 1e-6);
}

}  // namespace
