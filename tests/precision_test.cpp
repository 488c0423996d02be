#include "nanguard/census.h"
#include "nanguard/precision.h"
#include "nanguard/scope.h"

#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>

namespace {

using nanguard::direction;

std::filesystem::path model_path(const std::string& name) {
  return std::filesystem::path(NANGUARD_TEST_MODELS_DIR) / (name + ".pt");
}

struct per_op_autograd {  // the graph executor fuses backward nodes otherwise
  per_op_autograd() { torch::jit::setGraphExecutorOptimize(false); }
  ~per_op_autograd() { torch::jit::setGraphExecutorOptimize(true); }
};

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

const nanguard::module_precision* module_named(const nanguard::precision_report& r, const std::string& m) {
  for (const auto& x : r.modules)
    if (x.module == m) return &x;
  return nullptr;
}

void zero_grad(torch::jit::Module& m) {
  for (auto p : m.parameters())
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
}

// Three regression steps of a scripted model under an advisor.
nanguard::precision_report advise(torch::jit::Module& m, int steps = 3) {
  nanguard::precision_advisor advisor;
  advisor.name_parameters(m);
  torch::manual_seed(1);
  for (int step = 0; step < steps; ++step) {
    const at::Tensor x = at::randn({16, 4});
    const at::Tensor y = at::randn({16, 1});
    const at::Tensor loss = torch::mse_loss(m.forward({x}).toTensor(), y);
    loss.backward();
    advisor.end_step();
    zero_grad(m);
  }
  return advisor.report();
}

#define NEED_MODEL(name) \
  ASSERT_TRUE(std::filesystem::exists(model_path(name))) << model_path(name) << " was not written at build time"

// The acceptance test: the advisor names the one module that overflows fp16
// (fp16_net.blow multiplies by 1e5), and emulated fp16 makes exactly that
// module go non-finite; keeping it in fp32 keeps the model finite.
TEST(precision_advisor, names_the_module_that_overflows_fp16_and_emulation_confirms_it) {
  NEED_MODEL("fp16_net");
  per_op_autograd per_op;
  torch::jit::Module m = torch::jit::load(model_path("fp16_net").string());
  const nanguard::precision_report r = advise(m);

  EXPECT_EQ(3, r.steps);
  EXPECT_FALSE(r.fp32_nonfinite);
  EXPECT_EQ(std::vector<std::string>{"blow"}, r.keep_fp32);
  const auto* blow = module_named(r, "blow");
  ASSERT_NE(nullptr, blow);
  EXPECT_GT(blow->forward.fp16_overflow, 0);
  EXPECT_GT(blow->forward.absmax, nanguard::fp16_max);
  for (const char* other : {"lin", "squash", "head"}) {
    const auto* mp = module_named(r, other);
    ASSERT_NE(nullptr, mp) << other;
    EXPECT_EQ(0, mp->forward.fp16_overflow) << other;
    EXPECT_FALSE(mp->keep_fp32) << other;
    EXPECT_GT(mp->backward.values, 0) << other << ": its backward ops were attributed to it\n"
                                      << nanguard::to_text(r);
  }
  // The op is named per module too.
  bool blow_mul = false;
  for (const auto& o : r.ops)
    blow_mul |= o.module == "blow" && o.op == "aten::mul" && o.direction == direction::forward &&
                o.values.fp16_overflow > 0;
  EXPECT_TRUE(blow_mul);
  // Within bf16's range, and the advice says so.
  EXPECT_TRUE(r.bf16_safe);
  const std::string text = nanguard::to_text(r);
  EXPECT_NE(std::string::npos, text.find("bf16 is safe")) << text;
  EXPECT_NE(std::string::npos, text.find("keep these modules in fp32: blow")) << text;
  EXPECT_NE(std::string::npos, text.find("fp16 needs a loss scale in [")) << text;
  EXPECT_TRUE(r.loss_scale_fits);
  EXPECT_LE(r.loss_scale_min, r.loss_scale_max);
  // squash (x * 1e-5) makes the backward values tiny: they set the minimum scale.
  EXPECT_EQ("the backward of squash", r.loss_scale_min_from);
  EXPECT_GE(r.loss_scale_min, 16.0);

  // Verification: every op output rounded to fp16.
  torch::NoGradGuard no_grad;
  torch::manual_seed(2);
  const at::Tensor x = at::randn({16, 4});
  {
    nanguard::precision_emulator fp16;
    const at::Tensor y = m.forward({x}).toTensor();
    EXPECT_TRUE(nanguard::has_nonfinite(y)) << "emulated fp16 should overflow";
    EXPECT_EQ(r.keep_fp32, fp16.producers());
    EXPECT_EQ("aten::mul", fp16.first().op) << nanguard::to_text(fp16.first());
    EXPECT_EQ("blow", fp16.first().module);
  }
  {
    nanguard::precision_emulator fp16(nanguard::emulator_options().keep_fp32(r.keep_fp32));
    const at::Tensor y = m.forward({x}).toTensor();
    EXPECT_FALSE(nanguard::has_nonfinite(y)) << "with the advice followed the model stays finite";
    EXPECT_TRUE(fp16.producers().empty());
  }
  // bf16, emulated and through CPU autocast: finite, as advised.
  {
    nanguard::precision_emulator bf16(nanguard::emulator_options().dtype(at::kBFloat16));
    EXPECT_FALSE(nanguard::has_nonfinite(m.forward({x}).toTensor()));
    EXPECT_TRUE(bf16.producers().empty());
  }
  {
    nanguard::cpu_autocast autocast;
    nanguard::precision_emulator watch(nanguard::emulator_options().dtype(at::kFloat));
    const at::Tensor y = m.forward({x}).toTensor();
    EXPECT_EQ(at::kBFloat16, y.scalar_type()) << "autocast ran the head in bf16";
    EXPECT_FALSE(nanguard::has_nonfinite(y));
    EXPECT_TRUE(watch.producers().empty());
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "cpu_autocast restores the previous state";
}

TEST(precision_advisor, advises_bf16_and_plain_fp16_for_a_model_in_range) {
  NEED_MODEL("clf_net");
  per_op_autograd per_op;
  torch::jit::Module m = torch::jit::load(model_path("clf_net").string());
  nanguard::precision_advisor advisor;
  advisor.name_parameters(m);
  torch::manual_seed(3);
  for (int step = 0; step < 2; ++step) {
    const at::Tensor loss =
        torch::cross_entropy_loss(m.forward({at::randn({32, 4})}).toTensor(), at::randint(0, 3, {32}));
    loss.backward();
    advisor.end_step();
    zero_grad(m);
  }
  const auto r = advisor.report();
  EXPECT_TRUE(r.bf16_safe);
  EXPECT_TRUE(r.keep_fp32.empty());
  EXPECT_TRUE(r.bf16_overflow_modules.empty());
  EXPECT_LT(r.forward.absmax, 100.0);
  ASSERT_EQ(4u, r.gradients.size());  // hidden.weight, hidden.bias, out.weight, out.bias
  EXPECT_EQ("hidden.bias", r.gradients[0].parameter);
  EXPECT_GT(r.gradient.values, 0);
  EXPECT_TRUE(r.loss_scale_fits);
  EXPECT_GE(r.loss_scale_max, 1024.0);
  EXPECT_NE(std::string::npos, r.advice[0].find("bf16 is safe")) << r.advice[0];
  const std::string json = nanguard::to_json(r);
  EXPECT_NE(std::string::npos, json.find("\"bf16_safe\": true")) << json;
  EXPECT_NE(std::string::npos, json.find("\"keep_fp32\": []")) << json;

  torch::NoGradGuard no_grad;
  nanguard::cpu_autocast autocast;
  nanguard::precision_emulator watch(nanguard::emulator_options().dtype(at::kFloat));
  const at::Tensor y = m.forward({at::randn({32, 4}) * 10}).toTensor();
  EXPECT_EQ(at::kBFloat16, y.scalar_type());
  EXPECT_FALSE(nanguard::has_nonfinite(y));
}

// The loss-scale bounds follow the backward values: a gradient around 2^-30
// needs at least 2^6 not to flush to zero in fp16 (below 2^-24), and a
// backward value around 2^10 allows at most 2^5 (65504 / 2^10 < 2^6).
TEST(precision_advisor, loss_scale_bounds_come_from_the_backward_values) {
  auto w = torch::full({1000}, 1.0, torch::requires_grad());
  {
    nanguard::precision_advisor advisor;
    advisor.name_parameter("w", w);
    (w * 1.0).sum().backward();  // grad = 1: no underflow, max 1
    advisor.end_step();
    const auto r = advisor.report();
    EXPECT_EQ(std::ldexp(1.0, 15), r.loss_scale_max);  // 65504 / 1 → 2^15
    EXPECT_EQ(std::ldexp(1.0, -24), r.loss_scale_min);
  }
  {
    w.mutable_grad() = at::Tensor();
    nanguard::precision_advisor advisor(nanguard::advisor_options().underflow_tolerance(0));
    advisor.name_parameter("w", w);
    (w * std::ldexp(1.0, -30)).sum().backward();  // grad = 2^-30
    advisor.end_step();
    const auto r = advisor.report();
    EXPECT_EQ(std::ldexp(1.0, 6), r.loss_scale_min);
    ASSERT_EQ(1u, r.gradients.size());
    EXPECT_EQ(1000, r.gradients[0].values.fp16_underflow);
    EXPECT_DOUBLE_EQ(std::ldexp(1.0, -30), r.gradients[0].min_nonzero_abs);
    EXPECT_TRUE(r.loss_scale_fits);
    EXPECT_NE(std::string::npos, nanguard::to_text(r).find("fp16 needs a loss scale in [64 (2^6), "))
        << nanguard::to_text(r);
  }
  {
    // The tolerance lets the smallest 1% flush: 990 values at 2^-10, 10 at 2^-40.
    w.mutable_grad() = at::Tensor();
    at::Tensor scale = at::full({1000}, std::ldexp(1.0, -10));
    scale.slice(0, 0, 10).fill_(std::ldexp(1.0, -40));
    nanguard::precision_advisor advisor(nanguard::advisor_options().underflow_tolerance(0.01));
    advisor.name_parameter("w", w);
    (w * scale).sum().backward();
    advisor.end_step();
    EXPECT_EQ(std::ldexp(1.0, -14), advisor.report().loss_scale_min);
  }
  {
    auto u = torch::full({1}, 1.0, torch::requires_grad());
    nanguard::precision_advisor advisor;
    advisor.name_parameter("u", u);
    (u * 1024.0).sum().backward();  // a backward value and gradient of 1024
    advisor.end_step();
    EXPECT_EQ(std::ldexp(1.0, 5), advisor.report().loss_scale_max);
  }
}

TEST(precision_advisor, reports_when_no_static_loss_scale_fits) {
  auto w = torch::full({100}, 1.0, torch::requires_grad());
  auto v = torch::full({1}, 1.0, torch::requires_grad());
  nanguard::precision_advisor advisor(nanguard::advisor_options().underflow_tolerance(0));
  advisor.name_parameter("w", w);
  advisor.name_parameter("v", v);
  ((w * 1e-9).sum() + (v * 3e4).sum()).backward();  // gradients 1e-9 (needs 2^6) and 3e4 (allows 2^1)
  advisor.end_step();
  const auto r = advisor.report();
  EXPECT_TRUE(r.keep_fp32.empty());
  EXPECT_FALSE(r.loss_scale_fits);
  EXPECT_EQ(std::ldexp(1.0, 6), r.loss_scale_min);
  EXPECT_EQ(std::ldexp(1.0, 1), r.loss_scale_max);
  const std::string text = nanguard::to_text(r);
  EXPECT_NE(std::string::npos, text.find("no fp16 loss scale fits")) << text;
}

// Plain C++ modules: attribution from scopes (forward_scoped) and parameters.
TEST(precision_advisor, attributes_cpp_modules_by_scope) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Functional([](const at::Tensor& x) {
                              return torch::tanh(x * 1e6);  // overflows fp16, then back in range
                            }),
                            torch::nn::Linear(4, 1));
  nanguard::precision_advisor advisor;
  advisor.name_parameters(*seq);
  const at::Tensor loss = nanguard::forward_scoped(*seq, at::randn({8, 4})).pow(2).mean();
  loss.backward();
  advisor.end_step();
  const auto r = advisor.report();
  EXPECT_EQ(std::vector<std::string>{"1"}, r.keep_fp32);
  ASSERT_NE(nullptr, module_named(r, "0"));
  ASSERT_NE(nullptr, module_named(r, "2"));
  EXPECT_EQ(0, module_named(r, "0")->forward.fp16_overflow);
  ASSERT_EQ(4u, r.gradients.size());
}

TEST(precision_advisor, reports_nonfinite_fp32_values_first) {
  nanguard::precision_advisor advisor;
  NANGUARD_SCOPE("bad");
  (void)(at::zeros({4}) / at::zeros({4}));
  advisor.end_step();
  const auto r = advisor.report();
  EXPECT_TRUE(r.fp32_nonfinite);
  ASSERT_FALSE(r.advice.empty());
  EXPECT_NE(std::string::npos, r.advice[0].find("already makes NaN/Inf in float32 (first: aten::div (forward) in bad)"))
      << r.advice[0];
}

// FakeTensor, FunctionalTensor and functionalization's wrapper (what ops run
// on while torch.compile compiles) hold no values to measure (#37).
TEST(precision_advisor, measures_no_tensor_that_stands_for_values) {
  const at::Tensor wrapper = at::functionalization::impl::to_functional_tensor(at::full({4}, 1e5));
  const at::Tensor meta = at::ones({4}, at::kMeta);
  nanguard::precision_advisor advisor;
  testing::internal::CaptureStderr();
  (void)(wrapper * wrapper);
  (void)(meta * 1e5);
  advisor.end_step();
  EXPECT_EQ("", testing::internal::GetCapturedStderr());
  EXPECT_EQ(0, advisor.report().forward.values);
}

TEST(precision_advisor, validates_options_and_allows_one_per_thread) {
  try {
    nanguard::precision_advisor a(nanguard::advisor_options().underflow_tolerance(1.5));
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("underflow_tolerance must be in [0, 1), got 1.5"))
        << e.what();
  }
  nanguard::precision_advisor first;
  try {
    nanguard::precision_advisor second;
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("already active on this thread")) << e.what();
  }
  try {
    nanguard::precision_emulator e(nanguard::emulator_options().dtype(at::kDouble));
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("dtype must be Half, BFloat16 or Float")) << e.what();
  }
}

TEST(precision_emulator, rounds_outputs_and_names_the_producer_scope) {
  torch::NoGradGuard no_grad;
  nanguard::precision_emulator fp16;
  const at::Tensor x = at::full({3}, 1.0 + 1.0 / 4096);  // not representable in fp16
  at::Tensor a, b;
  {
    NANGUARD_SCOPE("small");
    a = x * 1.0;
  }
  EXPECT_EQ(1.0f, a[0].item<float>()) << "rounded to fp16's 11-bit significand";
  {
    NANGUARD_SCOPE("big");
    b = x * 1e5;
  }
  EXPECT_TRUE(std::isinf(b[0].item<float>()));
  EXPECT_EQ(std::vector<std::string>{"big"}, fp16.producers());
}

TEST(precision_emulator, round_to_precision_rounds_in_place) {
  at::Tensor t = at::tensor({70000.0f, 1.0f + 1.0f / 4096});
  nanguard::round_to_precision_(t, at::kHalf);
  EXPECT_TRUE(std::isinf(t[0].item<float>()));
  EXPECT_EQ(1.0f, t[1].item<float>());
  at::Tensor u = at::tensor({70000.0f});
  nanguard::round_to_precision_(u, at::kBFloat16);
  EXPECT_EQ(70144.0f, u[0].item<float>());  // bf16 keeps the range, loses digits
}

}  // namespace
