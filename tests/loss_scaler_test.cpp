#include "nanguard/loss_scaler.h"
#include "nanguard/sentinel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using nanguard::loss_scaler;
using nanguard::loss_scaler_options;

TEST(loss_scaler, has_grad_scaler_defaults) {
  const loss_scaler_options o;
  EXPECT_EQ(65536.0, o.init_scale());
  EXPECT_EQ(2.0, o.growth_factor());
  EXPECT_EQ(0.5, o.backoff_factor());
  EXPECT_EQ(2000, o.growth_interval());
  EXPECT_EQ(1, o.hysteresis());
  const loss_scaler s;
  EXPECT_EQ(65536.0, s.get_scale());
  EXPECT_TRUE(at::equal(torch::full({}, 2.0 * 65536), s.scale(torch::full({}, 2.0))));
}

// The scale after each step, as torch.amp.GradScaler's update computes it
// (at::_amp_update_scale_, the kernel GradScaler.update runs), for the
// overflows of `found`, on `device`.
std::vector<double> grad_scaler_scales(const std::vector<bool>& found, const loss_scaler_options& o,
                                       at::Device device) {
  at::Tensor scale = at::full({1}, o.init_scale(), at::TensorOptions(device).dtype(at::kFloat));
  at::Tensor tracker = at::zeros({1}, at::TensorOptions(device).dtype(at::kInt));
  std::vector<double> scales;
  for (const bool inf : found) {
    at::_amp_update_scale_(scale, tracker, at::full({1}, inf ? 1.0 : 0.0, scale.options()), o.growth_factor(),
                           o.backoff_factor(), o.growth_interval());
    scales.push_back(scale.item<double>());
  }
  return scales;
}

// GradScaler's semantics, step by step: a back-off on each overflow, growth
// after growth_interval finite steps in a row (bounds wide enough not to bind).
void expect_grad_scaler_semantics(at::Device device) {
  const auto o = loss_scaler_options().init_scale(1024).growth_interval(3).min_scale(1.0 / 1024).max_scale(1e30);
  std::vector<bool> found;
  for (int step = 0; step < 200; ++step) found.push_back((step * 7919 + step / 13) % 5 == 0);
  const std::vector<double> want = grad_scaler_scales(found, o, device);
  loss_scaler s(o);
  for (size_t i = 0; i < found.size(); ++i) {
    s.update(found[i]);
    ASSERT_EQ(want[i], s.get_scale()) << "step " << i;
  }
}

TEST(loss_scaler, updates_as_grad_scaler_does) { expect_grad_scaler_semantics(at::kCPU); }

TEST(loss_scaler, backs_off_on_inf) {
  loss_scaler s;
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(32768.0, s.get_scale());
  EXPECT_EQ(1.0 / 32768, s.inv_scale());
}

TEST(loss_scaler, grows_after_the_interval_and_an_overflow_resets_it) {
  loss_scaler s(loss_scaler_options().init_scale(8).growth_interval(3));
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_TRUE(s.update(true));  // 4, tracker reset
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(4.0, s.get_scale());
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(8.0, s.get_scale());
  EXPECT_EQ(0, s.growth_tracker());
}

TEST(loss_scaler, hysteresis_waits_for_overflows_in_a_row) {
  loss_scaler s(loss_scaler_options().init_scale(64).hysteresis(3));
  EXPECT_FALSE(s.update(true));
  EXPECT_FALSE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(32.0, s.get_scale());
  EXPECT_FALSE(s.update(true));
  EXPECT_FALSE(s.update(false));  // the run of overflows is broken
  EXPECT_FALSE(s.update(true));
  EXPECT_FALSE(s.update(true));
  EXPECT_EQ(32.0, s.get_scale());
}

TEST(loss_scaler, never_grows_past_max_scale) {
  loss_scaler s(loss_scaler_options().init_scale(4).max_scale(8).growth_interval(1));
  EXPECT_TRUE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(8.0, s.get_scale());
}

TEST(loss_scaler, stops_with_a_clear_error_at_min_scale) {
  loss_scaler s(loss_scaler_options().init_scale(2).min_scale(1));
  s.update(true);
  try {
    s.update(true);
    FAIL();
  } catch (const c10::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(std::string::npos, m.find("the loss scale would fall to 0.5, below min_scale=1")) << m;
    EXPECT_NE(std::string::npos, m.find("is not a float16 overflow")) << m;
  }
  EXPECT_EQ(1.0, s.get_scale());
}

TEST(loss_scaler, disabled_is_a_no_op) {
  loss_scaler s(loss_scaler_options().enabled(false));
  const at::Tensor loss = torch::full({}, 3.0);
  EXPECT_TRUE(s.scale(loss).is_same(loss));
  EXPECT_EQ(1.0, s.get_scale());
  EXPECT_FALSE(s.update(true));
  EXPECT_EQ(1.0, s.get_scale());
}

TEST(loss_scaler, validates_options) {
  try {
    loss_scaler s(loss_scaler_options().backoff_factor(1.5));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("backoff_factor must be in (0, 1) but is 1.5"));
  }
  try {
    loss_scaler s(loss_scaler_options().growth_interval(0));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("growth_interval must be >= 1 but is 0"));
  }
}

// Unscaling rides on the sentinel: scaled float16 / bfloat16 gradients are
// measured unscaled, then unscaled in one write.
TEST(loss_scaler, unscales_fp16_and_bf16_gradients_with_the_sentinel) {
  for (auto t : {at::kHalf, at::kBFloat16}) {
    at::Tensor w = torch::ones({64}, at::TensorOptions(t).requires_grad(true));
    const loss_scaler s(loss_scaler_options().init_scale(256));
    s.scale((w.to(at::kFloat) * 0.25).sum()).backward();
    ASSERT_EQ(t, w.grad().scalar_type());
    const nanguard::sentinel sen({{"w", w}});
    const auto r = sen.inspect_grads(s.inv_scale());
    EXPECT_NEAR(0.25 * 8, r.total_norm, 1e-3);
    sen.apply_factor_(s.inv_scale());
    EXPECT_TRUE(at::allclose(w.grad().to(at::kFloat), torch::full({64}, 0.25)));
  }
}

TEST(loss_scaler, an_fp16_overflow_is_seen_by_the_sentinel) {
  at::Tensor w = torch::ones({4}, at::TensorOptions(at::kHalf).requires_grad(true));
  const loss_scaler s;  // 65536 * 2 overflows float16
  s.scale((w.to(at::kFloat) * 2).sum()).backward();
  const nanguard::sentinel sen({{"w", w}});
  EXPECT_EQ(4, sen.inspect_grads(s.inv_scale()).nonfinite);
}

}  // namespace
