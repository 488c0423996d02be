#include "nanguard/safe_ops.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

bool finite(const at::Tensor& t) { return torch::isfinite(t).all().item<bool>(); }

void expect_close(const at::Tensor& want, const at::Tensor& got, double tol = 1e-6) {
  ASSERT_EQ(want.sizes(), got.sizes());
  EXPECT_LE((want - got).abs().max().item<double>(), tol);
}

const auto kD = torch::TensorOptions(at::kDouble);

TEST(safe_ops, cross_entropy_matches_libtorch_with_and_without_label_smoothing) {
  torch::manual_seed(0);
  for (double ls : {0.0, 0.1, 0.3}) {
    const at::Tensor logits = torch::randn({16, 10}, kD).mul(3).requires_grad_(), target = torch::randint(10, {16});
    const at::Tensor want = torch::nn::functional::cross_entropy(
        logits, target, torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(ls));
    const at::Tensor got = nanguard::cross_entropy(logits, target, ls);
    expect_close(want, got);
    const auto gw = torch::autograd::grad({want}, {logits})[0];
    const auto gg = torch::autograd::grad({got}, {logits})[0];
    expect_close(gw, gg);
  }
  // float32 too
  const at::Tensor logits = torch::randn({8, 5}), target = torch::randint(5, {8});
  expect_close(torch::nn::functional::cross_entropy(logits, target), nanguard::cross_entropy(logits, target), 1e-6);
}

TEST(safe_ops, cross_entropy_stays_finite_on_extreme_logits) {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    at::Tensor logits = torch::tensor({1e4, -1e4, 0.0, 1e4, 1e4, 1e4, -1e4, -1e4, -1e4}).reshape({3, 3}).to(dtype).requires_grad_();
    const at::Tensor target = torch::tensor({1, 0, 2});
    const at::Tensor l = nanguard::cross_entropy(logits, target, 0.1);
    EXPECT_TRUE(finite(l));
    EXPECT_GT(l.item<double>(), 1000);  // target 1 of row 0 is 2e4 below the max
    l.backward();
    EXPECT_TRUE(finite(logits.grad()));
  }
}

TEST(safe_ops, log_softmax_and_nll_match_libtorch) {
  torch::manual_seed(1);
  const at::Tensor x = torch::randn({6, 7}, kD) * 5, t = torch::randint(7, {6});
  expect_close(torch::log_softmax(x, 1), nanguard::log_softmax(x, 1));
  expect_close(torch::log_softmax(x, 0), nanguard::log_softmax(x, 0));
  const at::Tensor lp = torch::log_softmax(x, 1);
  expect_close(torch::nll_loss(lp, t), nanguard::nll_loss(lp, t));
  const at::Tensor all_equal = torch::full({2, 4}, 1e4, kD);
  expect_close(torch::full({2, 4}, -std::log(4.0), kD), nanguard::log_softmax(all_equal, 1));
}

TEST(safe_ops, layer_norm_and_standardize_match_libtorch_and_survive_zero_variance) {
  torch::manual_seed(2);
  const at::Tensor x = torch::randn({4, 3, 8}, kD), w = torch::randn({8}, kD), b = torch::randn({8}, kD);
  expect_close(torch::layer_norm(x, {8}, w, b, 1e-5), nanguard::layer_norm(x, {8}, w, b));
  expect_close(torch::layer_norm(x, {3, 8}), nanguard::layer_norm(x, {3, 8}));
  const at::Tensor ref = (x - x.mean(-1, true)) / torch::sqrt(x.var(-1, false, true) + 1e-5);
  expect_close(ref, nanguard::standardize(x));
  at::Tensor flat = torch::full({2, 8}, 3.0, kD).requires_grad_();
  const at::Tensor y = nanguard::layer_norm(flat, {8});
  EXPECT_TRUE(finite(y));
  expect_close(torch::zeros({2, 8}, kD), y);
  (y * torch::arange(8, kD)).sum().backward();
  EXPECT_TRUE(finite(flat.grad()));
  at::Tensor flat2 = torch::full({2, 8}, -7.0).requires_grad_();
  nanguard::standardize(flat2).sum().backward();
  EXPECT_TRUE(finite(flat2.grad()));
  try {
    nanguard::layer_norm(x, {5});
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("normalized_shape [5] must be the trailing dims of the input's shape [4, 3, 8]"));
  }
}

TEST(safe_ops, div_log_sqrt_match_on_ordinary_inputs_and_stay_finite_at_zero) {
  torch::manual_seed(3);
  const at::Tensor a = torch::randn({100}, kD), b = torch::rand({100}, kD) + 0.5;
  expect_close(a / b, nanguard::safe_div(a, b));
  expect_close(a / -b, nanguard::safe_div(a, -b));
  expect_close(torch::log(b), nanguard::safe_log(b));
  expect_close(torch::sqrt(b), nanguard::safe_sqrt(b));

  at::Tensor z = torch::tensor({0.0, -1.0, 4.0}, kD).requires_grad_();
  const at::Tensor s = nanguard::safe_sqrt(z);
  expect_close(torch::tensor({0.0, 0.0, 2.0}, kD), s);
  s.sum().backward();
  EXPECT_TRUE(finite(z.grad()));
  expect_close(torch::tensor({0.0, 0.0, 0.25}, kD), z.grad());

  at::Tensor zl = torch::tensor({0.0, -3.0, 1.0}, kD).requires_grad_();
  const at::Tensor l = nanguard::safe_log(zl);
  EXPECT_TRUE(finite(l));
  l.sum().backward();
  EXPECT_TRUE(finite(zl.grad()));

  at::Tensor den = torch::zeros({3}, kD).requires_grad_();
  const at::Tensor d = nanguard::safe_div(torch::tensor({0.0, 1.0, -1.0}, kD), den);
  EXPECT_TRUE(finite(d));
  d.sum().backward();
  EXPECT_TRUE(finite(den.grad()));

  try {
    nanguard::safe_log(zl, 0.0);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("safe_log: eps must be finite and positive but is 0"));
  }
}

TEST(safe_ops, masked_softmax_matches_libtorch_and_gives_zeros_for_fully_masked_rows) {
  torch::manual_seed(4);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    at::Tensor x = (torch::randn({3, 4, 6}) * 20).to(dtype).requires_grad_();
    at::Tensor mask = torch::rand({3, 4, 6}) < 0.4;
    mask.select(2, 0).fill_(false);  // every row but the blanked one keeps a position
    mask[1][2].fill_(true);          // a fully masked row
    const at::Tensor got = nanguard::masked_softmax(x, mask, -1);
    const at::Tensor want = torch::softmax(x.masked_fill(mask, -INFINITY), -1);
    const at::Tensor kept = mask.all(-1).logical_not();
    expect_close(want.index({kept}), got.index({kept}));
    expect_close(torch::zeros({6}, dtype), got[1][2]);
    EXPECT_FALSE(finite(want[1][2]));  // what it is there for: at::softmax gives NaN
    const at::Tensor g = torch::randn({3, 4, 6}).to(dtype);
    const at::Tensor gw = torch::autograd::grad({(want * g).sum()}, {x})[0];
    const at::Tensor gg = torch::autograd::grad({(got * g).sum()}, {x})[0];
    EXPECT_TRUE(finite(gg));
    expect_close(gw.index({kept}), gg.index({kept}));
    expect_close(torch::zeros({6}, dtype), gg[1][2]);
  }
  // A broadcast mask (causal, [t, t]) over another dim; logits ±1e4 stay finite.
  const at::Tensor scores = torch::tensor({1e4, -1e4, 0.0, -1e4, 1e4, 3.0, 0.0, 0.0, 0.0}).reshape({1, 3, 3});
  const at::Tensor causal = torch::ones({3, 3}, at::kBool).triu(1);
  const at::Tensor p = nanguard::masked_softmax(scores, causal, -1);
  expect_close(torch::softmax(scores.masked_fill(causal, -INFINITY), -1), p);
  expect_close(torch::tensor({1.0, 0.0, 0.0}), p[0][0]);
  try {
    nanguard::masked_softmax(scores, causal.to(at::kFloat));
    FAIL();
  } catch (const c10::TypeError& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("masked_softmax: the mask must be bool (true = left out) but is Float"))
        << e.what();
  }
}

}  // namespace
