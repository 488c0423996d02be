// Diagnosis: one traced model per cause that really makes that failure, the
// assertion that its finding gets that cause and a remedy naming the fix,
// and, where the fix is mechanical, the fixed model staying finite. Then
// the evidence rules (a div without a zero denominator is no x/0), the
// history (divergence), and the finding's JSON with and without a diagnosis.
#include "nanguard/diagnosis.h"
#include "nanguard/finding.h"
#include "nanguard/firewall.h"
#include "nanguard/safe_ops.h"
#include "nanguard/tracer.h"
#include "support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <iterator>
#include <limits>

namespace {

using nanguard::cause;
using nanguard::confidence;
using nanguard::direction;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The first finding of running `fn` under a fresh tracer.
template <typename Fn>
nanguard::finding first_finding(Fn fn, const torch::nn::Module* model = nullptr) {
  nanguard::tracer t;
  if (model) t.name_parameters(*model);
  fn(t);
  if (t.findings().empty()) throw std::runtime_error("no finding");
  return t.findings().front();
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

bool finite(const at::Tensor& x) { return at::isfinite(x).all().item<bool>(); }

// Every gradient of `m` finite after backward of `loss`.
bool trains_finite(const at::Tensor& loss, torch::nn::Module& m) {
  if (!finite(loss)) return false;
  loss.backward();
  for (const auto& p : m.parameters())
    if (p.grad().defined() && !finite(p.grad())) return false;
  return true;
}

// ------------------------------------------------------------ log of 0

// A classifier whose confident logits make softmax underflow to 0.
struct classifier_impl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  classifier_impl() {
    fc = register_module("fc", torch::nn::Linear(4, 3));
    torch::NoGradGuard no_grad;
    fc->weight.fill_(0);
    fc->weight.select(1, 0).copy_(torch::tensor({200.0, -200.0, 0.0}));
    fc->bias.fill_(0);
  }
};
TORCH_MODULE_IMPL(classifier, classifier_impl);

TEST(diagnosis, log_of_an_underflowed_softmax_is_log_of_nonpositive) {
  classifier net;
  const at::Tensor x = at::ones({8, 4}), y = at::zeros({8}, at::kLong);
  const auto f = first_finding([&](nanguard::tracer&) {
    at::nll_loss(at::log(at::softmax(net->fc(x), 1)), y).backward();
  }, net.get());
  EXPECT_EQ("aten::log", f.op);
  EXPECT_EQ(cause::log_of_nonpositive, f.diagnosis.cause);
  EXPECT_EQ(confidence::high, f.diagnosis.confidence);
  EXPECT_TRUE(has(f.diagnosis.evidence, "log of 0: 16 of 24 inputs are exactly 0")) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.evidence, "probabilities that underflowed")) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "torch::log_softmax(x, -1)")) << f.diagnosis.remedy;
  EXPECT_TRUE(has(f.diagnosis.remedy, "torch.log_softmax(x, -1)")) << f.diagnosis.remedy;

  net->zero_grad();
  EXPECT_TRUE(trains_finite(at::nll_loss(at::log_softmax(net->fc(x), 1), y), *net)) << "the remedy";
}

TEST(diagnosis, log_of_a_negative_names_the_smallest_input) {
  const auto f = first_finding([](nanguard::tracer&) { at::log(torch::tensor({1.0, -0.5, 2.0})); });
  EXPECT_EQ(cause::log_of_nonpositive, f.diagnosis.cause);
  EXPECT_TRUE(has(f.diagnosis.evidence, "the smallest of 3 inputs is -0.5")) << f.diagnosis.evidence;
}

// ------------------------------------------------------------ 0/0 in a normalisation

struct norm_net_impl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  double eps;
  explicit norm_net_impl(double eps) : eps(eps) { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = lin(x);
    return (h - h.mean(0, true)) / (h.std(0, true, true) + eps);
  }
};
TORCH_MODULE_IMPL(norm_net, norm_net_impl);

TEST(diagnosis, a_zero_std_normalisation_is_division_by_zero) {
  torch::manual_seed(0);
  norm_net net(0.0);
  const at::Tensor x = at::ones({8, 4});  // every feature constant: std 0
  const auto f = first_finding([&](nanguard::tracer&) { net->forward(x).sum().backward(); }, net.get());
  EXPECT_EQ("aten::div", f.op);
  EXPECT_EQ(cause::division_by_zero, f.diagnosis.cause);
  EXPECT_TRUE(has(f.diagnosis.evidence, "4 of 4 denominators (input 1) are exactly 0")) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "x / (x.std(0) + 1e-5)")) << f.diagnosis.remedy;

  torch::manual_seed(0);
  norm_net fixed(1e-5);
  EXPECT_TRUE(trains_finite(fixed->forward(x).sum(), *fixed)) << "the remedy";
}

TEST(diagnosis, std_of_a_batch_of_one_is_division_by_zero) {
  const auto f = first_finding([](nanguard::tracer&) { at::ones({1, 4}).std(0); });
  EXPECT_EQ(cause::division_by_zero, f.diagnosis.cause);
  EXPECT_TRUE(has(f.diagnosis.evidence, "n - 1 = 0")) << f.diagnosis.evidence;
}

// ------------------------------------------------------------ exp overflow

TEST(diagnosis, exp_beyond_log_of_the_largest_float_is_overflow) {
  const at::Tensor scores = torch::tensor({{1.0, 90.0, 3.0}}, at::kFloat);
  const auto f = first_finding([&](nanguard::tracer&) { at::log(at::exp(scores).sum(1)); });
  EXPECT_EQ("aten::exp", f.op);
  EXPECT_EQ(cause::overflow, f.diagnosis.cause);
  EXPECT_EQ(confidence::high, f.diagnosis.confidence);
  EXPECT_TRUE(
      has(f.diagnosis.evidence, "exp of up to 90: beyond 88.72, where exp passes the largest Float (3.403e+38)"))
      << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "torch::logsumexp(x, -1)")) << f.diagnosis.remedy;
  EXPECT_TRUE(finite(at::logsumexp(scores, 1))) << "the remedy";
}

TEST(diagnosis, a_div_without_a_zero_denominator_is_no_division_by_zero) {
  const auto f = first_finding([](nanguard::tracer&) { at::full({4}, 1e30) / at::full({4}, 1e-30); });
  EXPECT_EQ(cause::overflow, f.diagnosis.cause) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.evidence, "from finite inputs up to |x| = 1e+30")) << f.diagnosis.evidence;
}

// ------------------------------------------------------------ a fully masked softmax row

TEST(diagnosis, softmax_of_a_fully_masked_row_is_fully_masked_softmax) {
  torch::manual_seed(0);
  const at::Tensor scores = torch::randn({4, 4}, torch::requires_grad());
  at::Tensor mask = at::zeros({4, 4}, at::kBool);
  mask[2].fill_(true);  // query 2 may attend to nothing
  const auto f = first_finding([&](nanguard::tracer&) {
    at::softmax(scores.masked_fill(mask, -kInf), -1).sum().backward();
  });
  EXPECT_EQ(cause::fully_masked_softmax, f.diagnosis.cause);
  EXPECT_EQ(confidence::high, f.diagnosis.confidence);
  EXPECT_TRUE(has(f.diagnosis.evidence, "1 row(s) with no finite entry")) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "nanguard::masked_softmax(scores, mask)")) << f.diagnosis.remedy;

  scores.mutable_grad() = at::Tensor();
  const at::Tensor p = nanguard::masked_softmax(scores, mask, -1);
  ASSERT_TRUE(finite(p)) << "the remedy";
  p.sum().backward();
  EXPECT_TRUE(finite(scores.grad()));
}

// ------------------------------------------------------------ sqrt at 0, in backward

TEST(diagnosis, the_backward_of_a_distance_at_zero_is_sqrt_at_zero) {
  // A Euclidean distance between a point and itself: sqrt(0) is 0, its
  // derivative 1/(2 sqrt(0)) is inf.
  const at::Tensor a = torch::tensor({{1.0, 2.0}, {3.0, 4.0}}, torch::requires_grad());
  const at::Tensor b = torch::tensor({{1.0, 2.0}, {0.0, 0.0}});
  const auto f = first_finding([&](nanguard::tracer&) { (a - b).pow(2).sum(1).sqrt().sum().backward(); });
  EXPECT_EQ(direction::backward, f.direction);
  EXPECT_EQ("aten::sqrt", f.forward_op);
  EXPECT_EQ(cause::sqrt_at_zero, f.diagnosis.cause);
  EXPECT_EQ(confidence::high, f.diagnosis.confidence);
  EXPECT_TRUE(has(f.diagnosis.evidence, "backward of aten::sqrt (SqrtBackward0): 1 of 2 values it divides by are 0"))
      << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "torch::sqrt(x + 1e-12)")) << f.diagnosis.remedy;

  a.mutable_grad() = at::Tensor();
  (((a - b).pow(2).sum(1) + 1e-12).sqrt()).sum().backward();
  EXPECT_TRUE(finite(a.grad())) << "the remedy";
}

// ------------------------------------------------------------ acos at ±1

TEST(diagnosis, the_backward_of_acos_at_one_is_inverse_trig_at_bound) {
  // The angle between two equal unit vectors (row 0): the cosine is exactly 1.
  const at::Tensor u = torch::tensor({{1.0, 0.0}, {0.0, 1.0}}, torch::requires_grad());
  const at::Tensor v = torch::tensor({{1.0, 0.0}, {1.0, 0.0}});
  const auto f = first_finding([&](nanguard::tracer&) { at::acos((u * v).sum(1)).sum().backward(); });
  EXPECT_EQ(direction::backward, f.direction);
  EXPECT_EQ(cause::inverse_trig_at_bound, f.diagnosis.cause);
  EXPECT_TRUE(has(f.diagnosis.evidence, "backward of aten::acos")) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "torch::acos(x.clamp(-1 + 1e-6, 1 - 1e-6))")) << f.diagnosis.remedy;

  u.mutable_grad() = at::Tensor();
  at::acos((u * v).sum(1).clamp(-1 + 1e-6, 1 - 1e-6)).sum().backward();
  EXPECT_TRUE(finite(u.grad())) << "the remedy";
}

TEST(diagnosis, acos_beyond_one_in_forward_is_inverse_trig_at_bound) {
  const auto f = first_finding([](nanguard::tracer&) { at::acos(torch::tensor({0.5, 1.0000001})); });
  EXPECT_EQ(cause::inverse_trig_at_bound, f.diagnosis.cause);
  EXPECT_TRUE(has(f.diagnosis.evidence, "the largest |x| of 2 inputs is 1.0000001")) << f.diagnosis.evidence;
}

// ------------------------------------------------------------ inf - inf

TEST(diagnosis, a_hand_written_stable_softmax_of_a_masked_row_is_inf_arithmetic) {
  // x - max(x) on a row that is all -inf: -inf - (-inf).
  torch::manual_seed(0);
  const at::Tensor scores = torch::randn({3, 4});
  at::Tensor mask = at::zeros({3, 4}, at::kBool);
  mask[1].fill_(true);
  const auto f = first_finding([&](nanguard::tracer&) {
    const at::Tensor s = scores.masked_fill(mask, -kInf);
    const at::Tensor shifted = s - std::get<0>(s.max(1, true));
    shifted.exp().sum();
  });
  EXPECT_EQ("aten::sub", f.op);
  EXPECT_EQ(cause::inf_arithmetic, f.diagnosis.cause);
  EXPECT_TRUE(has(f.diagnosis.evidence, "inf - inf: aten::sub made 4 NaN from infinities")) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "masked_fill(mask, -1e9)")) << f.diagnosis.remedy;

  const at::Tensor s = scores.masked_fill(mask, -1e9);
  EXPECT_TRUE(finite((s - std::get<0>(s.max(1, true))).exp())) << "the remedy";
}

// ------------------------------------------------------------ float16 range

TEST(diagnosis, a_cast_to_float16_beyond_65504_is_precision_range) {
  torch::manual_seed(0);
  torch::nn::Linear head(4, 2);
  {
    torch::NoGradGuard no_grad;
    head->weight.fill_(3e4);
  }
  const at::Tensor x = at::ones({2, 4});
  const auto f = first_finding([&](nanguard::tracer&) { head(x).to(at::kHalf).sum(); }, head.get());
  EXPECT_EQ(cause::precision_range, f.diagnosis.cause);
  EXPECT_EQ(confidence::high, f.diagnosis.confidence);
  EXPECT_TRUE(has(f.diagnosis.evidence, "cast to Half: 4 of 4 values")) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.evidence, "beyond 6.55e+04")) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "loss_scaler_options().enabled(true)")) << f.diagnosis.remedy;
  EXPECT_TRUE(has(f.diagnosis.remedy, "bfloat16")) << f.diagnosis.remedy;
  EXPECT_TRUE(finite(head(x).to(at::kBFloat16))) << "the remedy (bf16)";
}

TEST(diagnosis, exp_in_float16_of_what_float32_holds_is_precision_range_not_overflow) {
  const at::Tensor x = torch::tensor({1.0, 12.0}).to(at::kHalf);
  const auto f = first_finding([&](nanguard::tracer&) { at::exp(x); });
  EXPECT_EQ(cause::precision_range, f.diagnosis.cause) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.evidence, "float32 holds it")) << f.diagnosis.evidence;
  EXPECT_TRUE(finite(at::exp(x.to(at::kFloat)))) << "the remedy";
}

// ------------------------------------------------------------ bad data

TEST(diagnosis, a_nan_in_the_batch_is_bad_data_with_its_row) {
  torch::manual_seed(0);
  torch::nn::Linear fc(3, 2);
  at::Tensor batch = torch::randn({5, 3});
  batch[3][1] = std::numeric_limits<double>::quiet_NaN();
  const auto f = first_finding([&](nanguard::tracer& t) {
    t.name_tensor(batch, "batch[0]");
    fc(batch).sum().backward();
  }, fc.get());
  EXPECT_EQ(nanguard::role::input, f.role);
  EXPECT_EQ(cause::bad_data, f.diagnosis.cause);
  EXPECT_EQ(confidence::high, f.diagnosis.confidence);
  EXPECT_TRUE(has(f.diagnosis.evidence, "came in with batch[0] (1 NaN of 15), the first in row 3"))
      << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "firewall")) << f.diagnosis.remedy;

  const auto clean = nanguard::firewall(nanguard::firewall_options().nonfinite(nanguard::nonfinite_policy::drop))
                         .apply(batch);
  fc->zero_grad();
  EXPECT_TRUE(trains_finite(fc(clean.batch).sum(), *fc)) << "the remedy";
}

// ------------------------------------------------------------ divergence

// An addmm that overflowed, as a finding carries it.
nanguard::finding overflowed_addmm() {
  nanguard::finding f;
  f.op = "aten::addmm";
  f.inputs = {{"input 0", "Float", {4}, {}}, {"input 1", "Float", {8, 4}, {}}};
  f.inputs[0].stats.numel = 4;
  f.inputs[0].stats.finite = 4;
  f.inputs[0].stats.absmax = 3e20;
  f.outputs = {{"output 0", "Float", {8}, {}}};
  f.outputs[0].stats.numel = 8;
  f.outputs[0].stats.pos_inf = 8;
  return f;
}

TEST(diagnosis, an_overflow_after_a_grad_norm_spike_is_divergence) {
  const nanguard::finding f = overflowed_addmm();
  EXPECT_EQ(cause::overflow, nanguard::diagnose(f).cause) << "no history: no divergence";
  nanguard::diagnosis_context calm;
  calm.grad_norms = {1.0, 1.1, 0.9, 1.0, 1.05, 0.97, 1.02, 0.99, 1.01};
  EXPECT_EQ(cause::overflow, nanguard::diagnose(f, calm).cause) << "a calm history: no divergence";

  nanguard::diagnosis_context spiking = calm;
  spiking.grad_norms.insert(spiking.grad_norms.end(), {40.0, 900.0, 2e4});
  spiking.lr = 0.5;
  const nanguard::diagnosis d = nanguard::diagnose(f, spiking);
  EXPECT_EQ(cause::divergence, d.cause);
  EXPECT_EQ(confidence::high, d.confidence);
  EXPECT_TRUE(has(d.evidence, "the grad norm rose to 2e+04 in the steps before (median 1")) << d.evidence;
  EXPECT_TRUE(has(d.evidence, "at lr 0.5; then aten::addmm made 8 +Inf")) << d.evidence;
  EXPECT_TRUE(has(d.remedy, "guard_options().max_norm(1.0)")) << d.remedy;
  EXPECT_TRUE(has(d.remedy, "default policy (auto) rolls a divergence back")) << d.remedy;
}

TEST(diagnosis, steady_growth_over_a_few_steps_is_divergence) {
  nanguard::diagnosis_context growing;
  growing.losses = {0.5, 0.4, 2.0, 30.0, 900.0};
  const nanguard::diagnosis d = nanguard::diagnose(overflowed_addmm(), growing);
  EXPECT_EQ(cause::divergence, d.cause);
  EXPECT_TRUE(has(d.evidence, "the loss grew in each of the 3 steps before, from 0.4 to 900")) << d.evidence;
  growing.losses = {0.5, 0.4, 0.41, 0.42, 0.43};
  EXPECT_EQ(cause::overflow, nanguard::diagnose(overflowed_addmm(), growing).cause) << "rising, but not 10x";
}

TEST(diagnosis, a_domain_error_keeps_its_class_after_a_spike) {
  const auto f = first_finding([](nanguard::tracer&) { at::log(torch::tensor({0.0, 1.0})); });
  nanguard::diagnosis_context spiking;
  spiking.losses = {1.0, 1.1, 0.9, 1.0, 1.05, 0.97, 50.0, 900.0, 2e4};
  EXPECT_EQ(cause::log_of_nonpositive, nanguard::diagnose(f, spiking).cause);
}

// A real bfloat16 divergence: weights grown step by step until a bf16
// matmul passes 3.4e38. bfloat16 has float32's range, so no wider dtype is
// the fix: divergence (overflow without the history), not precision_range.
TEST(diagnosis, a_bfloat16_overflow_after_growth_is_divergence_not_precision_range) {
  torch::nn::Linear fc(4, 2);
  fc->to(at::kBFloat16);
  {
    torch::NoGradGuard no_grad;
    fc->weight.fill_(3e38);
  }
  const at::Tensor x = at::full({3, 4}, 2.0, at::kBFloat16);
  const auto f = first_finding([&](nanguard::tracer&) { fc(x); }, fc.get());
  // The weights it read say so even without the history.
  EXPECT_EQ(cause::divergence, f.diagnosis.cause) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.evidence, "parameter weight (view) reached |x| = 3")) << f.diagnosis.evidence;
  EXPECT_FALSE(has(f.diagnosis.remedy, "loss_scaler")) << f.diagnosis.remedy;
  nanguard::diagnosis_context growing;
  growing.losses = {0.5, 0.4, 2.0, 30.0, 900.0};
  const nanguard::diagnosis d = nanguard::diagnose(f, growing);
  EXPECT_EQ(cause::divergence, d.cause) << d.evidence;
  EXPECT_TRUE(has(d.remedy, "max_norm(1.0)")) << d.remedy;
  EXPECT_FALSE(has(d.remedy, "bfloat16 instead of float16")) << d.remedy;
  // A cast of float32 values beyond bfloat16's largest value: float32's edge too.
  const at::Tensor big = at::full({2}, 3.4e38, at::kFloat);
  const auto cast = first_finding([&](nanguard::tracer&) { big.to(at::kBFloat16); });
  EXPECT_NE(cause::precision_range, cast.diagnosis.cause) << cast.diagnosis.evidence;
}

TEST(diagnosis, float16_overflow_stays_precision_range_after_growth) {
  const at::Tensor x = torch::tensor({1.0, 12.0}).to(at::kHalf);
  const auto f = first_finding([&](nanguard::tracer&) { at::exp(x); });
  nanguard::diagnosis_context growing;
  growing.losses = {0.5, 0.4, 2.0, 30.0, 900.0};
  EXPECT_EQ(cause::precision_range, nanguard::diagnose(f, growing).cause);
}

// ------------------------------------------------------------ remedies by front end

nanguard::diagnosis diagnose_for(const nanguard::finding& f, nanguard::front_end e, std::string file = "") {
  nanguard::diagnosis_context c;
  c.front_end = e;
  c.data_file = std::move(file);
  c.data = {"features", "labels"};  // the batch, as the guard names it
  return nanguard::diagnose(f, c);
}

// A finding of a NaN that came in with the batch tensor `name`.
nanguard::finding nan_in_batch(const std::string& name) {
  at::Tensor batch = torch::randn({5, 3});
  batch[3][1] = std::numeric_limits<double>::quiet_NaN();
  torch::nn::Linear fc(3, 2);
  return first_finding([&](nanguard::tracer& t) {
    t.name_tensor(batch, name);
    fc(batch).sum();
  });
}

TEST(diagnosis, remedies_are_the_one_liners_of_the_front_end) {
  using nanguard::front_end;
  const at::Tensor h = torch::tensor({1.0, 12.0}).to(at::kHalf);
  const auto fp16 = first_finding([&](nanguard::tracer&) { at::exp(h); });
  const std::string lightning = diagnose_for(fp16, front_end::lightning).remedy;
  EXPECT_TRUE(has(lightning, "Trainer(precision=\"bf16-mixed\")")) << lightning;
  EXPECT_FALSE(has(lightning, "loss_scale=True")) << "the callback refuses loss_scale=: " << lightning;
  EXPECT_FALSE(has(lightning, "C++")) << lightning;
  const std::string hf = diagnose_for(fp16, front_end::transformers).remedy;
  EXPECT_TRUE(has(hf, "TrainingArguments(bf16=True)")) << hf;
  EXPECT_FALSE(has(hf, "loss_scale=True")) << hf;
  const std::string py = diagnose_for(fp16, front_end::python).remedy;
  EXPECT_TRUE(has(py, "nanguard.Guard(model, opt, loss_scale=True)")) << py;
  EXPECT_FALSE(has(py, "policy=")) << "auto backs off on its own: " << py;
  EXPECT_FALSE(has(py, "loss_scaler_options")) << py;
  const std::string cpp = diagnose_for(fp16, front_end::cpp).remedy;
  EXPECT_TRUE(has(cpp, "loss_scaler_options().enabled(true)")) << cpp;
  EXPECT_FALSE(has(cpp, "nanguard.Guard")) << cpp;

  const nanguard::finding data = nan_in_batch("labels");
  const std::string plain = diagnose_for(data, front_end::python).remedy;
  EXPECT_TRUE(has(plain, "nanguard.data.firewall_collate(")) << plain;
  EXPECT_FALSE(has(plain, "nanguard scan")) << "no CSV file: " << plain;
  const std::string trainer = diagnose_for(data, front_end::transformers).remedy;
  EXPECT_TRUE(has(trainer, "Trainer(data_collator=nanguard.data.firewall_collate(")) << trainer;
  EXPECT_TRUE(has(trainer, "field=\"labels\"")) << trainer;
  const std::string cli = diagnose_for(data, front_end::cli, "train.csv").remedy;
  EXPECT_TRUE(has(cli, "`nanguard scan train.csv`")) << cli;
  EXPECT_TRUE(has(cli, "--firewall drop")) << cli;
  EXPECT_FALSE(has(diagnose_for(data, front_end::unknown).remedy, "nanguard scan")) << "no file, no scan";

  nanguard::diagnosis_context growing;
  growing.losses = {0.5, 0.4, 2.0, 30.0, 900.0};
  growing.front_end = front_end::lightning;
  const std::string diverged = nanguard::diagnose(overflowed_addmm(), growing).remedy;
  EXPECT_TRUE(has(diverged, "Trainer(gradient_clip_val=1.0)")) << diverged;
  EXPECT_TRUE(has(diverged, "the guard's default policy (auto) rolls a divergence back")) << diverged;
  EXPECT_FALSE(has(diverged, "policy=")) << "auto rolls back on its own: " << diverged;
}

TEST(diagnosis, a_view_of_a_named_batch_tensor_is_bad_data) {
  nanguard::finding f;
  f.op = "aten::mm";
  f.role = nanguard::role::input;
  f.culprit = "labels (view)";
  f.inputs = {{"labels (view)", "Float", {4, 2}, {}}};
  f.inputs[0].stats.numel = 8;
  f.inputs[0].stats.nan = 1;
  nanguard::diagnosis_context c;
  c.data = {"features", "labels"};
  const nanguard::diagnosis d = nanguard::diagnose(f, c);
  EXPECT_EQ(cause::bad_data, d.cause) << d.evidence;
  EXPECT_TRUE(has(d.evidence, "came in with labels (view)")) << d.evidence;
}

// ------------------------------------------------------------ unclassified

TEST(diagnosis, what_no_class_fits_is_unclassified_with_the_raw_evidence) {
  // sqrt of a negative in forward: no class of the taxonomy.
  const auto f = first_finding([](nanguard::tracer&) { at::sqrt(torch::tensor({4.0, -1.0})); });
  EXPECT_EQ(cause::unclassified, f.diagnosis.cause);
  EXPECT_EQ(confidence::low, f.diagnosis.confidence);
  EXPECT_TRUE(has(f.diagnosis.evidence, "aten::sqrt (forward) made 1 NaN and no class fits")) << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.evidence, "input 0 Float: min -1 max 4, 0 zeros, no non-finite value of 2"))
      << f.diagnosis.evidence;
  EXPECT_TRUE(has(f.diagnosis.remedy, "no class fits the evidence")) << f.diagnosis.remedy;
}

// ------------------------------------------------------------ outputs

TEST(diagnosis, travels_in_the_findings_json_and_text) {
  const auto f = first_finding([](nanguard::tracer&) { at::log(torch::tensor({0.0, 1.0})); });
  const nanguard::finding back = nanguard::finding_from_json(nanguard::to_json(f));
  EXPECT_EQ(f.diagnosis.cause, back.diagnosis.cause);
  EXPECT_EQ(f.diagnosis.evidence, back.diagnosis.evidence);
  EXPECT_EQ(f.diagnosis.remedy, back.diagnosis.remedy);
  EXPECT_EQ(f.diagnosis.confidence, back.diagnosis.confidence);
  const std::string text = nanguard::to_text(f);
  EXPECT_TRUE(has(text, "  cause:     log_of_nonpositive (high confidence)\n")) << text;
  EXPECT_TRUE(has(text, "  evidence:  log of 0: 1 of 2 inputs are exactly 0")) << text;
  EXPECT_TRUE(has(text, "  remedy:    take the log in log space")) << text;
}

TEST(diagnosis, a_finding_written_before_diagnoses_is_diagnosed_on_reading) {
  const auto f = first_finding([](nanguard::tracer&) { at::log(torch::tensor({0.0, 1.0})); });
  auto j = nlohmann::json::parse(nanguard::to_json(f));
  j.erase("diagnosis");
  EXPECT_EQ(cause::log_of_nonpositive, nanguard::finding_from_json(j.dump()).diagnosis.cause);

  j["diagnosis"] = {{"cause", "gremlins"}, {"evidence", ""}, {"remedy", ""}, {"confidence", "high"}};
  try {
    nanguard::finding_from_json(j.dump());
    FAIL() << "an unknown cause was read";
  } catch (const c10::Error& e) {
    EXPECT_TRUE(has(e.what_without_backtrace(),
                    "'cause' is 'gremlins'; expected one of 'unclassified', 'log_of_nonpositive'"))
        << e.what_without_backtrace();
  }
}

TEST(diagnosis, names_round_trip) {
  for (cause c : {cause::unclassified, cause::log_of_nonpositive, cause::division_by_zero, cause::overflow,
                  cause::fully_masked_softmax, cause::sqrt_at_zero, cause::inverse_trig_at_bound,
                  cause::inf_arithmetic, cause::precision_range, cause::divergence, cause::bad_data,
                  cause::masked_infinity_reduced, cause::constant_in_model})
    EXPECT_EQ(c, nanguard::cause_from_string(nanguard::to_string(c)));
  for (confidence c : {confidence::low, confidence::medium, confidence::high})
    EXPECT_EQ(c, nanguard::confidence_from_string(nanguard::to_string(c)));
  // Every value is in its all_ table, and reads back through the one helper.
  EXPECT_EQ(std::size(nanguard::all_causes), size_t(cause::constant_in_model) + 1);
  for (cause c : nanguard::all_causes) EXPECT_EQ(c, nanguard::cause_from_string(nanguard::to_string(c)));
  for (nanguard::front_end e : nanguard::all_front_ends)
    EXPECT_EQ(e, nanguard::front_end_from_string(nanguard::to_string(e)));
  EXPECT_EQ(nanguard::test::error_of([] { nanguard::front_end_from_string("jupyter"); }),
            "nanguard::front_end_from_string: front_end must be one of 'unknown', 'cpp', 'python', 'lightning', "
            "'transformers', 'cli' but is 'jupyter'");
}

}  // namespace
