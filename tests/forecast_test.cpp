// The forecast: range_trend on series made by hand (a geometric rise, a
// falling, flat, noisy or slow one, a rise cut by a NaN), then end to end
// through the guard: a divergent LR and a float16 overflow are forecast at
// least 3 steps before their first non-finite step, said in a warning, and
// under auto the guard rolls back before the range ends.
#include "nanguard/forecast.h"
#include "nanguard/guard.h"
#include "nanguard/training_host.h"

#include "support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace {

using nanguard::range_trend;

range_trend trend_of(std::initializer_list<double> values) {
  range_trend t;
  for (double v : values) t.add(v);
  return t;
}

TEST(forecast, a_geometric_rise_leaves_the_range_when_its_trend_says) {
  range_trend t;
  for (int i = 0; i < 8; ++i) t.add(10 * std::pow(3.0, i));  // 10 ... 21870
  const auto f = t.forecast("loss", 65504);
  ASSERT_TRUE(f);
  EXPECT_NEAR(3.0, f->growth, 1e-9);
  EXPECT_EQ(0, f->steps_left);  // 21870 x 3 = 65610: past the range at the next step
  EXPECT_EQ("the loss (2.187e+04) leaves the range 65504 at the next step (x3 a step)", to_string(*f));
  const auto far = t.forecast("loss", std::numeric_limits<float>::max());
  ASSERT_TRUE(far);
  EXPECT_EQ(71, far->steps_left);  // log(3.4e38 / 21870) / log(3)
}

TEST(forecast, a_healthy_series_has_none) {
  EXPECT_FALSE(trend_of({9, 8, 7, 6, 5, 4, 3, 2}).forecast("loss", 65504)) << "falling";
  EXPECT_FALSE(trend_of({1, 1, 1, 1, 1, 1, 1, 1}).forecast("loss", 65504)) << "flat";
  EXPECT_FALSE(trend_of({1, 3, 2, 6, 4, 12, 8, 24}).forecast("loss", 65504)) << "noisy";
  EXPECT_FALSE(trend_of({1, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7}).forecast("loss", 65504)) << "slow: under 1.2x";
  EXPECT_FALSE(trend_of({1, 2, 4, 8, 16, 32, 64}).forecast("loss", 65504)) << "7 values: no trend yet";
  EXPECT_FALSE(trend_of({1, 2, 4, 8, 16, 32, 64, 128}).forecast("loss", 1e300)) << "beyond the horizon";
}

TEST(forecast, a_nan_or_a_non_positive_value_starts_the_trend_again) {
  EXPECT_FALSE(trend_of({1, 2, 4, NAN, 8, 16, 32, 64, 128}).forecast("loss", 65504));
  EXPECT_FALSE(trend_of({1, 2, 4, 0, 8, 16, 32, 64, 128}).forecast("loss", 65504));
  EXPECT_TRUE(trend_of({1, 2, 4, 0, 8, 16, 32, 64, 128, 256, 512, 1024}).forecast("loss", 65504));
}

// Linear regression whose LR is raised at step 20 to where the loss grows
// about 3x a step: finite for a long while, then Inf.
struct diverging_regression {
  torch::nn::Linear model{nullptr};
  at::Tensor x, y;
  diverging_regression() {
    torch::manual_seed(3);  // before the model: its initial weights too are the same in every run
    model = torch::nn::Linear(8, 1);
    x = torch::randn({64, 8});
    y = x.matmul(torch::randn({8, 1}));
  }
  nanguard::step_fn loss_fn() {
    return [this](const std::vector<at::Tensor>& b) { return (model->forward(b[0]) - b[1]).pow(2).mean(); };
  }
};

TEST(forecast, a_divergent_lr_is_forecast_3_steps_or_more_before_its_first_nonfinite_step) {
  diverging_regression r;
  torch::optim::SGD opt(r.model->parameters(), torch::optim::SGDOptions(0.05));
  nanguard::guard g(r.model, opt, nanguard::guard_options().policy(nanguard::policy::skip).verbose(false));
  int64_t forecast_at = -1, nonfinite_at = -1;
  std::string warning;
  for (int64_t i = 0; i < 300 && nonfinite_at < 0; ++i) {
    if (i == 20) nanguard::set_lr(opt, 1.5);
    const nanguard::step_event e = g.step({r.x, r.y}, r.loss_fn());
    if (e.forecast && forecast_at < 0) {
      forecast_at = e.step;
      warning = g.narrator().last_warning();
    }
    if (e.skipped) nonfinite_at = e.step;
  }
  ASSERT_GT(nonfinite_at, 0);
  ASSERT_GT(forecast_at, 20);
  EXPECT_GE(nonfinite_at - forecast_at, 3);
  // The loss or the grad norm, whichever trend leaves the range first (here the grad norm's).
  EXPECT_NE(std::string::npos, warning.find("nanguard: step " + std::to_string(forecast_at) + ": the grad norm ("))
      << warning;
  EXPECT_NE(std::string::npos, warning.find("leaves the range 3.40282e+38 in about")) << warning;
}

TEST(forecast, under_auto_the_guard_rolls_back_before_the_range_ends) {
  diverging_regression r;
  torch::optim::SGD opt(r.model->parameters(), torch::optim::SGDOptions(0.05));
  nanguard::guard g(r.model, opt, nanguard::guard_options().verbose(false));
  int64_t rollbacks_before_a_nan = 0;
  for (int64_t i = 0; i < 200; ++i) {
    if (i == 20) nanguard::set_lr(opt, 1.5);
    const nanguard::step_event e = g.step({r.x, r.y}, r.loss_fn());
    ASSERT_TRUE(std::isfinite(e.loss)) << "step " << e.step << ": " << e.reason;
    rollbacks_before_a_nan += e.action == nanguard::action::rollback;
  }
  EXPECT_GE(rollbacks_before_a_nan, 1);
}

// A loss computed in float16 that doubles every step: it passes 65504 at
// step 17, and is forecast against float16's range, not float32's.
TEST(forecast, a_float16_loss_is_forecast_against_float16s_range) {
  torch::nn::Linear model(4, 1);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.0));
  nanguard::guard g(model, opt, nanguard::guard_options().policy(nanguard::policy::skip).verbose(false));
  const at::Tensor x = torch::ones({2, 4});
  double scale = 1;
  int64_t forecast_at = -1, nonfinite_at = -1;
  for (int64_t i = 0; i < 40 && nonfinite_at < 0; ++i, scale *= 2) {
    const nanguard::step_event e = g.step({x}, [&](const std::vector<at::Tensor>& b) {
      return (model->forward(b[0]).abs().sum() * 0 + scale).to(at::kHalf).sum();
    });
    if (e.forecast && forecast_at < 0) {
      forecast_at = e.step;
      EXPECT_EQ(65504, e.forecast->limit);
    }
    if (e.skipped) nonfinite_at = e.step;
  }
  ASSERT_GT(nonfinite_at, 0);
  ASSERT_GT(forecast_at, 0);
  EXPECT_GE(nonfinite_at - forecast_at, 3);
}

}  // namespace
