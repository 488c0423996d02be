// Where the tracer looks when a step is not a plain training step (#40): a
// forward-only pass, judged by the model's outputs; a non-finite loss made
// of intended infinities; TorchScript's constants; complex ops. Part of
// tracer_test: its tracer.* cases run on the deferred path too.
#include "nanguard/diagnosis.h"
#include "nanguard/scope.h"
#include "nanguard/tracer.h"

#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

namespace {

using nanguard::cause;
using nanguard::direction;
using nanguard::role;

nanguard::tracer_options traced() {
  static const bool deferred = std::getenv("NANGUARD_TEST_DEFERRED") != nullptr;  // see tracer_test.cpp
  return nanguard::tracer_options().deferred(deferred);
}

std::string first_of(const nanguard::tracer& t) {
  return t.found() ? nanguard::to_text(t.findings().front()) : "no finding";
}

// A hand-written causal LM: a full + triu causal mask, one attention block,
// an MLP (scoped "mlp") whose activation is a log of 0 when asked.
struct causal_lm_impl : torch::nn::Module {
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear qkv{nullptr}, up{nullptr}, down{nullptr}, head{nullptr};
  bool log_in_mlp;

  explicit causal_lm_impl(bool log_in_mlp) : log_in_mlp(log_in_mlp) {
    embed = register_module("embed", torch::nn::Embedding(32, 16));
    qkv = register_module("qkv", torch::nn::Linear(16, 48));
    up = register_module("up", torch::nn::Linear(16, 32));
    down = register_module("down", torch::nn::Linear(32, 16));
    head = register_module("head", torch::nn::Linear(16, 32));
  }

  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor h = embed(ids);
    const auto qkv_parts = qkv(h).chunk(3, -1);
    const int64_t n = ids.size(1);
    const at::Tensor mask = at::full({n, n}, -INFINITY).triu(1);
    const at::Tensor scores = at::matmul(qkv_parts[0], qkv_parts[1].transpose(-1, -2)) / 4 + mask;
    h = h + at::matmul(at::softmax(scores, -1), qkv_parts[2]);
    at::Tensor mlp;
    {
      NANGUARD_SCOPE("mlp");
      const at::Tensor a = up(h);
      mlp = down(log_in_mlp ? at::log(at::relu(a)) : at::gelu(a));
    }
    return head(h + mlp);
  }
};
TORCH_MODULE_IMPL(causal_lm, causal_lm_impl);

TEST(tracer, judges_a_forward_only_pass_by_the_models_outputs) {
  torch::manual_seed(0);
  causal_lm model(/*log_in_mlp=*/true);
  torch::NoGradGuard no_grad;
  nanguard::tracer t(traced());
  t.name_parameters(*model);
  const at::Tensor logits = model->forward(torch::randint(0, 32, {2, 6}));
  ASSERT_TRUE(t.found());
  EXPECT_EQ("aten::full", t.findings().front().op) << "unjudged, every chain is shown: the mask's first";
  t.judge_by_outputs({logits});
  const nanguard::finding& f = t.findings().at(0);
  EXPECT_EQ("aten::log", f.op) << first_of(t);
  EXPECT_EQ("mlp", f.module);
  EXPECT_EQ(cause::log_of_nonpositive, f.diagnosis.cause);
}

TEST(tracer, a_healthy_forward_only_pass_judged_by_its_outputs_has_no_finding) {
  torch::manual_seed(0);
  causal_lm model(/*log_in_mlp=*/false);
  model->eval();
  torch::NoGradGuard no_grad;
  nanguard::tracer t(traced());
  const at::Tensor logits = model->forward(torch::randint(0, 32, {2, 6}));
  t.judge_by_outputs({logits});
  EXPECT_FALSE(t.found()) << first_of(t);
}

// A pass that leaves nothing to judge needs no judge_by_outputs (nanguard.trace
// then skips collecting the outputs); a chain judged but not reached still
// may be (an output could carry it), one judged and reached is shown for good.
TEST(tracer, awaits_judgement_while_a_chain_may_still_change) {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  causal_lm model(/*log_in_mlp=*/false);
  model->eval();
  torch::nn::Linear lin(4, 8);
  at::Tensor batch = torch::randn({8, 4});
  {
    nanguard::tracer t(traced());
    lin(batch);
    EXPECT_FALSE(t.found());  // (on the deferred path: the checks are read)
    EXPECT_FALSE(t.awaits_judgement()) << "a healthy pass";
    const at::Tensor logits = model->forward(torch::randint(0, 32, {2, 6}));
    EXPECT_TRUE(t.awaits_judgement()) << "the causal mask's chain is unjudged";
    t.judge_by_outputs({logits});
    EXPECT_FALSE(t.found()) << first_of(t);
    EXPECT_TRUE(t.awaits_judgement()) << "the mask's chain was absorbed: judged, not reached";
  }
  batch[3][2] = INFINITY;
  nanguard::tracer t(traced());
  const at::Tensor out = lin(batch);
  EXPECT_TRUE(t.awaits_judgement()) << "the batch's chain is unjudged";
  t.judge_by_outputs({out});
  EXPECT_TRUE(t.found());
  EXPECT_FALSE(t.awaits_judgement()) << "the batch's chain reached the output: shown for good";
}

// +inf in the batch is bad data, not a mask: the NaN a layer norm makes of
// it later belongs to the data's chain, which reaches the outputs.
TEST(tracer, a_nan_made_from_an_infinity_in_the_data_belongs_to_the_data) {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 8);
  torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({8}));
  at::Tensor batch = torch::randn({8, 4});
  batch[3][2] = INFINITY;
  nanguard::tracer t(traced());
  t.name_tensor(batch, "batch");
  const at::Tensor out = norm(lin(batch));
  t.judge_by_outputs({out});
  ASSERT_TRUE(t.found());
  EXPECT_EQ(role::input, t.findings().front().role) << "was the layer norm: " << first_of(t);
  EXPECT_EQ("batch", t.findings().front().culprit);
}

at::Tensor masked_logits() {
  torch::manual_seed(0);
  const at::Tensor logits = torch::randn({4, 6}, torch::requires_grad());
  at::Tensor mask = at::zeros({4, 6}, at::kBool);
  mask.slice(1, 4).fill_(true);  // two classes masked out in every row
  return logits.masked_fill(mask, -INFINITY);
}

at::Tensor label_smoothed_loss(const at::Tensor& logits) {
  return at::cross_entropy_loss(logits, at::arange(4), {}, at::Reduction::Mean, -100, /*label_smoothing=*/0.1);
}

TEST(tracer, a_non_finite_loss_made_of_intended_infinities_is_a_finding) {
  nanguard::tracer t(traced());
  const at::Tensor loss = label_smoothed_loss(masked_logits());
  ASSERT_TRUE(std::isinf(loss.item<double>()));
  loss.backward();
  ASSERT_TRUE(t.found()) << "every -inf was intended, and the loss is inf";
  const nanguard::finding& f = t.findings().front();
  EXPECT_EQ(role::producer, f.role) << first_of(t);
  EXPECT_EQ(direction::forward, f.direction);
  EXPECT_EQ(cause::masked_infinity_reduced, f.diagnosis.cause) << f.diagnosis.evidence;
  EXPECT_NE(std::string::npos, f.diagnosis.remedy.find("label smoothing")) << f.diagnosis.remedy;
}

TEST(tracer, a_mask_written_as_a_constant_and_reduced_into_the_loss_names_the_reduction) {
  const at::Tensor logits = torch::randn({4, 6}, torch::requires_grad());
  nanguard::tracer t(traced());
  at::Tensor additive = at::zeros({6});
  additive.slice(0, 4).fill_(-INFINITY);
  label_smoothed_loss(logits + additive).backward();
  ASSERT_TRUE(t.found());
  EXPECT_EQ(cause::masked_infinity_reduced, t.findings().front().diagnosis.cause) << first_of(t);
}

TEST(tracer, cross_entropy_over_masked_logits_without_smoothing_has_no_finding) {
  nanguard::tracer t(traced());
  at::cross_entropy_loss(masked_logits(), at::arange(4)).backward();
  EXPECT_FALSE(t.found()) << first_of(t);
}

// Scripted code compiled here: no module hierarchy, TorchScript's ops.
std::shared_ptr<torch::jit::CompilationUnit> scripted(const std::string& source) {
  return torch::jit::compile(source);
}

TEST(tracer_torchscript, a_fully_masked_row_written_by_copy_names_the_softmax) {
  const auto cu = scripted(R"JIT(
def forward(scores):
    mask = torch.zeros(4, 4)
    mask[0] = float("-inf")
    return torch.softmax(scores + mask, -1)
)JIT");
  nanguard::tracer t(traced());
  const at::Tensor probs = cu->run_method("forward", torch::randn({4, 4})).toTensor();
  ASSERT_TRUE(t.found());
  const nanguard::finding& writer = t.findings().front();
  EXPECT_EQ(role::producer, writer.role) << "was role input, bad_data: " << first_of(t);
  EXPECT_NE(cause::bad_data, writer.diagnosis.cause);
  t.judge_by_outputs({probs});
  const nanguard::finding& f = t.findings().at(0);
  EXPECT_NE(std::string::npos, f.op.find("softmax")) << first_of(t);
  EXPECT_EQ(role::producer, f.role);
  EXPECT_EQ(cause::fully_masked_softmax, f.diagnosis.cause);
}

TEST(tracer_torchscript, names_the_nan_scalar_a_scripted_op_multiplies_by) {
  const auto cu = scripted(R"JIT(
def forward(x):
    return torch.relu(x) * float("nan")
)JIT");
  nanguard::tracer t(traced());
  cu->run_method("forward", torch::randn({2, 4}));
  ASSERT_TRUE(t.found());
  const nanguard::finding& f = t.findings().front();
  EXPECT_EQ("aten::mul", f.op) << first_of(t);
  ASSERT_FALSE(f.outputs.empty());
  EXPECT_EQ(std::vector<int64_t>({2, 4}), f.outputs.at(0).shape) << "was Float [], 1 NaN of 1: " << first_of(t);
  bool nan_operand = false;
  for (const auto& in : f.inputs) nan_operand |= in.stats.nan > 0 && in.shape.empty();
  EXPECT_TRUE(nan_operand) << first_of(t);
  // A number in the model's code: a constant, never the data.
  EXPECT_EQ("constant (argument 1)", f.culprit);
  EXPECT_EQ(cause::constant_in_model, f.diagnosis.cause) << first_of(t);
}

TEST(tracer, a_nan_number_in_eager_code_is_a_constant_in_the_model) {
  nanguard::tracer t(traced());
  at::relu(torch::randn({2, 4})) * std::nan("");  // a wrapped number, as Python's float is
  ASSERT_TRUE(t.found());
  const nanguard::finding& f = t.findings().front();
  EXPECT_EQ("constant (argument 1)", f.culprit) << first_of(t);
  EXPECT_EQ(cause::constant_in_model, f.diagnosis.cause) << first_of(t);
  EXPECT_EQ(nanguard::confidence::high, f.diagnosis.confidence);
}

TEST(tracer, a_complex_parameter_under_the_range_rules_prints_nothing) {
  const at::Tensor z = torch::randn({4}, torch::dtype(at::kComplexFloat).requires_grad(true));
  testing::internal::CaptureStderr();
  {
    nanguard::tracer t(traced());
    at::angle(z).sum().backward();
    at::atan2(at::real(z), at::imag(z)).sum();
    at::softmax(at::real(z) * 2 + at::imag(z), 0);  // a complex parameter's views under the range rules
    at::stack({at::real(z), at::imag(z)});
    at::cat({z, z}).abs().sum().backward();  // a list of complex tensors
    EXPECT_FALSE(t.found()) << first_of(t);
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ("", err) << "was Exception in RecordFunction callback: ... expected a floating-point tensor";
}

TEST(tracer, finds_a_nan_in_the_imaginary_part) {
  const at::Tensor nan_imaginary = at::complex(at::zeros({4}), at::tensor({0.0f, NAN, 0.0f, 0.0f}));
  nanguard::tracer t(traced());
  at::exp(nan_imaginary);
  ASSERT_TRUE(t.found());
  EXPECT_EQ("aten::exp", t.findings().front().op) << first_of(t);
}

}  // namespace
