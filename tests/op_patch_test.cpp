// op_patch on its own: each rewrite changes only the op it targets, only
// where its input needs it, in the forward and (through autograd) the
// backward; nothing is rewritten outside a scope or after the patch.
#include "guard/op_patch.h"

#include "support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

namespace {

using nanguard::detail::op_patch;
using nanguard::detail::op_rewrite;
using nanguard::test::error_of;

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(op_patch, a_clamp_keeps_log_and_its_gradient_finite) {
  const at::Tensor x = torch::tensor({0.0, 2.0}).requires_grad_();
  const op_patch patch(op_rewrite::clamp_input("aten::log", 1e-12, kInf));
  at::Tensor y;
  {
    const op_patch::scope on;
    y = x.log();
    y.sum().backward();
  }
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  EXPECT_NEAR(y[1].item<double>(), std::log(2.0), 1e-6);  // in range: unchanged
  EXPECT_TRUE(torch::isfinite(x.grad()).all().item<bool>());
  EXPECT_EQ(patch.calls_rewritten(), 1);
}

TEST(op_patch, nothing_is_rewritten_outside_a_scope) {
  const op_patch patch(op_rewrite::clamp_input("aten::log", 1e-12, kInf));
  EXPECT_TRUE(torch::isinf(torch::tensor({0.0}).log()).all().item<bool>());
  EXPECT_EQ(patch.calls_rewritten(), 0);
}

TEST(op_patch, other_ops_and_values_in_range_are_left_alone) {
  const op_patch patch(op_rewrite::clamp_input("aten::log", 1e-12, kInf));
  const op_patch::scope on;
  EXPECT_TRUE(torch::isinf(torch::tensor({0.0}).reciprocal()).all().item<bool>());
  EXPECT_NEAR(torch::tensor({3.0}).log().item<double>(), std::log(3.0), 1e-6);
  EXPECT_EQ(patch.calls_rewritten(), 0);
}

TEST(op_patch, an_eps_replaces_the_zeros_of_a_denominator) {
  const at::Tensor x = torch::tensor({1.0, 4.0}).requires_grad_();
  const at::Tensor d = torch::tensor({0.0, 2.0}).requires_grad_();
  const op_patch patch(op_rewrite::denominator_eps("aten::div", 1e-5));
  at::Tensor y;
  {
    const op_patch::scope on;
    y = x / d;
    y.sum().backward();
  }
  EXPECT_NEAR(y[0].item<double>(), 1e5, 1);
  EXPECT_NEAR(y[1].item<double>(), 2.0, 1e-9);
  EXPECT_TRUE(torch::isfinite(x.grad()).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(d.grad()).all().item<bool>());
}

TEST(op_patch, a_safe_softmax_gives_zeros_for_a_fully_masked_row) {
  const at::Tensor s = torch::tensor({{1.0, 2.0}, {-kInf, -kInf}}).requires_grad_();
  const op_patch patch(op_rewrite::safe_softmax("aten::_softmax"));
  at::Tensor p;
  {
    const op_patch::scope on;
    p = s.softmax(-1);
    (p * torch::tensor({1.0, 3.0})).sum().backward();
  }
  EXPECT_TRUE(torch::equal(p[1], torch::zeros({2}, at::kDouble)));
  EXPECT_NEAR(p[0].sum().item<double>(), 1.0, 1e-9);
  EXPECT_TRUE(torch::isfinite(s.grad()).all().item<bool>());
}

TEST(op_patch, float32_runs_the_op_and_what_mixes_with_it_in_float32) {
  const at::Tensor h = torch::full({4}, 300.0, at::kHalf).requires_grad_();
  EXPECT_TRUE(torch::isinf(h.pow(2)).all().item<bool>());  // 90000 > 65504
  const op_patch patch(op_rewrite::float32("aten::pow", at::kHalf));
  at::Tensor loss;
  {
    const op_patch::scope on;
    loss = (h.pow(2) * torch::ones({4}, at::kHalf)).mean();  // the mul mixes float32 and float16
    loss.backward();
  }
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_NEAR(loss.item<double>(), 90000.0, 1e-3);
  EXPECT_EQ(h.grad().scalar_type(), at::kHalf);
  EXPECT_TRUE(torch::isfinite(h.grad()).all().item<bool>());
  EXPECT_GE(patch.calls_rewritten(), 1);
}

TEST(op_patch, one_patch_at_a_time) {
  const op_patch patch(op_rewrite::clamp_input("aten::log", 1e-12, kInf));
  EXPECT_NE(error_of([] { op_patch second(op_rewrite::safe_softmax("aten::_softmax")); })
                .find("nanguard: an op patch for aten::log is in force; one patch at a time"),
            std::string::npos);
}

TEST(op_patch, its_description_names_the_op_and_the_constants) {
  EXPECT_EQ(op_rewrite::denominator_eps("aten::div", 1e-5).description(),
            "eps 1e-05 on the zero denominators of aten::div");
  EXPECT_EQ(op_rewrite::clamp_input("aten::acos", -0.999, 0.999).description(),
            "the input of aten::acos clamped to [-0.999, 0.999]");
  EXPECT_EQ(op_rewrite::float32("aten::pow", at::kHalf).description(), "aten::pow in float32 instead of Half");
}

}  // namespace
