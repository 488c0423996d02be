#include "nanguard/clip.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

std::vector<at::Tensor> params(double scale, int seed) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> p;
  for (int64_t n : {3, 100, 70000}) {
    at::Tensor w = torch::zeros({n}, torch::requires_grad());
    w.mutable_grad() = torch::randn({n}) * scale;
    p.push_back(w);
  }
  return p;
}

TEST(clip, clip_grad_norm_matches_libtorch) {
  for (double scale : {0.001, 1.0, 10.0}) {
    auto a = params(scale, 1), b = params(scale, 1);
    const double want = torch::nn::utils::clip_grad_norm_(a, 1.0);
    const double got = nanguard::clip_grad_norm_(b, 1.0);
    EXPECT_NEAR(want, got, 1e-5 * want);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(torch::allclose(a[i].grad(), b[i].grad(), 1e-5, 1e-7)) << scale << " " << i;
  }
}

TEST(clip, clip_grad_norm_leaves_nonfinite_gradients_alone) {
  auto p = params(10.0, 2);
  p[1].grad()[5] = NAN;
  const auto before = p[0].grad().clone();
  EXPECT_TRUE(std::isnan(nanguard::clip_grad_norm_(p, 1.0)));
  EXPECT_TRUE(at::equal(before, p[0].grad()));
}

TEST(clip, coefficient) {
  EXPECT_EQ(1.0, nanguard::clip_coefficient(0.5, 1.0));
  EXPECT_NEAR(0.25, nanguard::clip_coefficient(4.0, 1.0), 1e-6);
  EXPECT_EQ(1.0, nanguard::clip_coefficient(4.0, 0.0));
  EXPECT_EQ(1.0, nanguard::clip_coefficient(NAN, 1.0));
}

TEST(clip, clip_grad_value_clamps_inf_and_keeps_or_zeroes_nan) {
  for (bool zero : {false, true}) {
    at::Tensor w = torch::zeros({5}, torch::requires_grad());
    w.mutable_grad() = torch::tensor({-10.0f, 0.5f, INFINITY, -INFINITY, NAN});
    EXPECT_EQ(1, nanguard::clip_grad_value_({w}, 2.0, zero));
    const auto g = w.grad();
    EXPECT_EQ(-2.0f, g[0].item<float>());
    EXPECT_EQ(0.5f, g[1].item<float>());
    EXPECT_EQ(2.0f, g[2].item<float>());
    EXPECT_EQ(-2.0f, g[3].item<float>());
    if (zero) EXPECT_EQ(0.0f, g[4].item<float>());
    else EXPECT_TRUE(std::isnan(g[4].item<float>()));
  }
}

TEST(clip, validates_arguments) {
  auto p = params(1.0, 3);
  try {
    nanguard::clip_grad_norm_(p, 0.0);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("max_norm must be finite and positive but is 0"));
  }
  try {
    nanguard::clip_grad_value_(p, -1.0);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("clip_value must be finite and positive but is -1"));
  }
}

}  // namespace
