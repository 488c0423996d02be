#include "nanguard/schedule.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace {

// PyTorch's CosineAnnealingLR in its recursive (chainable) form, the form
// its scheduler.step() uses, after a LinearLR warmup from 1/W to 1.
std::vector<double> pytorch_reference(double base, int64_t warmup, int64_t total, double eta_min, int64_t steps) {
  std::vector<double> out;
  for (int64_t s = 0; s < warmup && s < steps; ++s) out.push_back(base * double(s + 1) / double(warmup));
  const int64_t T = total - warmup;
  double lr = base;
  for (int64_t t = 0; int64_t(out.size()) < steps; ++t) {
    if (t > 0 && t <= T) {
      lr = (1 + std::cos(M_PI * t / T)) / (1 + std::cos(M_PI * (t - 1) / T)) * (lr - eta_min) + eta_min;
    }
    out.push_back(t > T ? eta_min : lr);
  }
  return out;
}

TEST(schedule, matches_pytorch_linear_warmup_then_cosine_annealing) {
  const nanguard::warmup_cosine s(nanguard::schedule_options(0.1).warmup_steps(10).total_steps(110).min_lr(1e-3));
  const auto ref = pytorch_reference(0.1, 10, 110, 1e-3, 130);
  for (int64_t i = 0; i < 130; ++i) EXPECT_NEAR(ref[i], s.lr(i), 1e-12) << i;
  EXPECT_NEAR(0.01, s.lr(0), 1e-15);
  EXPECT_NEAR(0.1, s.lr(9), 1e-15);
  EXPECT_NEAR(0.1, s.lr(10), 1e-15);
  EXPECT_NEAR(1e-3 + (0.1 - 1e-3) / 2, s.lr(60), 1e-12);
  EXPECT_EQ(1e-3, s.lr(500));
}

TEST(schedule, sets_every_param_group_of_any_optimizer) {
  auto a = torch::zeros({2}, torch::requires_grad()), b = torch::zeros({2}, torch::requires_grad());
  torch::optim::AdamW opt({torch::optim::OptimizerParamGroup({a}), torch::optim::OptimizerParamGroup({b})});
  const nanguard::warmup_cosine s(nanguard::schedule_options(1.0).warmup_steps(4).total_steps(8));
  EXPECT_EQ(0.5, s.apply(opt, 1));
  for (auto& g : opt.param_groups()) EXPECT_EQ(0.5, g.options().get_lr());
  EXPECT_EQ(0.25, s.apply(opt, 3, 0.25));
  EXPECT_EQ(0.25, nanguard::get_lr(opt));
  nanguard::scale_lr(opt, 0.5);
  for (auto& g : opt.param_groups()) EXPECT_EQ(0.125, g.options().get_lr());
  torch::optim::SGD sgd({a}, torch::optim::SGDOptions(1));
  s.apply(sgd, 7);
  EXPECT_NEAR(s.lr(7), nanguard::get_lr(sgd), 1e-15);
}

TEST(schedule, validates_options) {
  try {
    nanguard::warmup_cosine s(nanguard::schedule_options(0.1).warmup_steps(10).total_steps(10));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos,
              std::string(e.what()).find("need 0 <= warmup_steps < total_steps but got warmup_steps=10, total_steps=10"));
  }
  try {
    nanguard::warmup_cosine s(nanguard::schedule_options(0.1).min_lr(0.2));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("min_lr must be in [0, base_lr=0.1] but is 0.2"));
  }
}

}  // namespace
