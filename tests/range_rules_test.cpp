// The range rules must hold every value the op computes: each case runs an
// op through the dispatcher on random tensors of several scales, gives the
// rule the exact ranges of the arguments, and checks the output's exact
// range lies inside the rule's.
#include "tracer/range_rules.h"
#include "detail/value_range.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace {

using nanguard::detail::maybe_range;
using nanguard::detail::op_arguments;
using nanguard::detail::range_rule_for;
using nanguard::detail::value_range;

// Exact bounds of a finite tensor (the scan bounds one-signed data by 0).
value_range exact_range(const at::Tensor& t) {
  const auto [lo, hi] = at::aminmax(t.to(at::kDouble));
  return {lo.item<double>(), hi.item<double>()};
}

c10::ArrayRef<const c10::IValue> view(const std::vector<c10::IValue>& values) {
  return c10::ArrayRef<const c10::IValue>(values.data(), values.size());
}

struct rule_case {
  const char* op;
  const char* overload;
  std::function<std::vector<c10::IValue>(double scale, at::ScalarType dtype)> arguments;
};

// Runs the op and checks each floating output against the range the rule
// gives it once stored. Returns how many outputs the rule bounded.
int check_case(const rule_case& c, double scale, at::ScalarType dtype) {
  SCOPED_TRACE(::testing::Message() << c.op << "." << c.overload << " scale=" << scale << " " << dtype);
  const auto* rule = range_rule_for(c.op);
  EXPECT_NE(nullptr, rule);
  if (!rule) return 0;
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(c.op, c.overload);
  std::vector<c10::IValue> stack = c.arguments(scale, dtype);
  const std::vector<c10::IValue> arguments = stack;  // the ops here do not write their arguments
  const auto lookup = [](const at::Tensor& t) -> maybe_range { return exact_range(t); };
  const op_arguments args(view(arguments), lookup);
  std::vector<maybe_range> predicted;
  for (size_t i = 0; i < 3; ++i) predicted.push_back(rule->output(args, i));
  handle.callBoxed(stack);
  int bounded = 0;
  for (size_t i = 0; i < stack.size() && i < predicted.size(); ++i) {
    if (!stack[i].isTensor() || !stack[i].toTensor().is_floating_point() || !predicted[i]) continue;
    const at::Tensor& out = stack[i].toTensor();
    const maybe_range stored = nanguard::detail::stored_range(*predicted[i], out.scalar_type(), *rule);
    if (!stored) continue;
    const value_range actual = exact_range(out);
    EXPECT_LE(stored->lo, actual.lo) << "output " << i;
    EXPECT_GE(stored->hi, actual.hi) << "output " << i;
    ++bounded;
  }
  return bounded;
}

at::Tensor normal(std::vector<int64_t> sizes, double scale, at::ScalarType dtype) {
  return (at::randn(sizes, at::kDouble) * scale).to(dtype);
}

at::Tensor positive(std::vector<int64_t> sizes, double scale, at::ScalarType dtype) {
  return ((at::rand(sizes, at::kDouble) + 0.01) * scale).to(dtype);
}

std::vector<rule_case> cases() {
  using V = std::vector<c10::IValue>;
  using T = at::ScalarType;
  return {
      {"aten::add", "Tensor", [](double s, T d) { return V{normal({64}, s, d), normal({64}, s, d), 2.5}; }},
      {"aten::sub", "Tensor", [](double s, T d) { return V{normal({64}, s, d), normal({64}, 3 * s, d), 0.5}; }},
      {"aten::rsub", "Tensor", [](double s, T d) { return V{normal({64}, s, d), normal({64}, s, d), 2}; }},
      {"aten::mul", "Tensor", [](double s, T d) { return V{normal({64}, s, d), normal({64}, s, d)}; }},
      {"aten::mul", "Scalar", [](double s, T d) { return V{normal({64}, s, d), -0.3}; }},
      {"aten::div", "Tensor", [](double s, T d) { return V{normal({64}, s, d), -positive({64}, s, d)}; }},
      {"aten::div", "Tensor_mode",
       [](double s, T d) { return V{normal({64}, s, d), positive({64}, 1, d), std::string("floor")}; }},
      {"aten::sqrt", "", [](double s, T d) { return V{positive({64}, s, d)}; }},
      {"aten::rsqrt", "", [](double s, T d) { return V{positive({64}, s, d)}; }},
      {"aten::exp", "", [](double, T d) { return V{normal({64}, 10, d)}; }},
      {"aten::log", "", [](double s, T d) { return V{positive({64}, s, d)}; }},
      {"aten::tanh", "", [](double s, T d) { return V{normal({64}, s, d)}; }},
      {"aten::sigmoid", "", [](double s, T d) { return V{normal({64}, s, d)}; }},
      {"aten::gelu", "", [](double s, T d) { return V{normal({64}, s, d), std::string("none")}; }},
      {"aten::gelu", "", [](double s, T d) { return V{normal({64}, s, d), std::string("tanh")}; }},
      {"aten::gelu_backward", "",
       [](double s, T d) { return V{normal({64}, s, d), normal({64}, 2, d), std::string("tanh")}; }},
      {"aten::_softmax", "", [](double s, T d) { return V{normal({8, 16}, s, d), 1, false}; }},
      {"aten::_safe_softmax", "", [](double s, T d) { return V{normal({8, 16}, s, d), 1, c10::nullopt}; }},
      {"aten::_log_softmax", "", [](double s, T d) { return V{normal({8, 16}, s, d), 1, false}; }},
      {"aten::lerp", "Scalar", [](double s, T d) { return V{normal({64}, s, d), normal({64}, 3 * s, d), 0.1}; }},
      {"aten::lerp", "Scalar", [](double s, T d) { return V{normal({64}, s, d), normal({64}, s, d), -1.5}; }},
      {"aten::lerp", "Tensor",
       [](double s, T d) { return V{normal({64}, s, d), positive({64}, s, d), positive({64}, 1, d)}; }},
      {"aten::select_backward", "",
       [](double s, T d) { return V{positive({4, 5}, s, d), std::vector<int64_t>{3, 4, 5}, 0, 1}; }},
      {"aten::slice_backward", "",
       [](double s, T d) { return V{normal({4, 2}, s, d), std::vector<int64_t>{4, 6}, 1, 2, 4, 1}; }},
      {"aten::_softmax_backward_data", "",
       [](double s, T d) {
         const at::Tensor y = at::softmax(normal({8, 16}, 1, d), 1);
         return V{normal({8, 16}, s, d), y, 1, d};
       }},
      {"aten::_log_softmax_backward_data", "",
       [](double s, T d) {
         const at::Tensor y = at::log_softmax(normal({8, 16}, 1, d), 1);
         return V{normal({8, 16}, s, d), y, 1, d};
       }},
      {"aten::sum", "", [](double s, T d) { return V{positive({300}, s, d), c10::nullopt}; }},
      {"aten::sum", "dim_IntList",
       [](double s, T d) { return V{normal({30, 40}, s, d), std::vector<int64_t>{1}, false, c10::nullopt}; }},
      {"aten::mean", "dim",
       [](double s, T d) { return V{positive({30, 40}, s, d), std::vector<int64_t>{0}, true, c10::nullopt}; }},
      {"aten::mm", "", [](double s, T d) { return V{normal({16, 32}, s, d), normal({32, 8}, s, d)}; }},
      {"aten::bmm", "", [](double s, T d) { return V{normal({3, 16, 32}, s, d), positive({3, 32, 8}, s, d)}; }},
      {"aten::addmm", "",
       [](double s, T d) { return V{normal({8}, s, d), normal({16, 32}, s, d), normal({32, 8}, s, d), 0.5, 2}; }},
      {"aten::addmm", "",
       [](double s, T d) {
         return V{at::full({8}, NAN, d), normal({16, 32}, s, d), normal({32, 8}, s, d), 0, 1};  // beta 0: self unread
       }},
      {"aten::baddbmm", "",
       [](double s, T d) {
         return V{normal({3, 16, 8}, s, d), normal({3, 16, 32}, s, d), normal({3, 32, 8}, s, d), 1, -1};
       }},
      {"aten::addcmul", "",
       [](double s, T d) {
         const at::Tensor g = normal({64}, s, d);
         return V{positive({64}, s, d), g, g, 0.01};  // a square: stays positive
       }},
      {"aten::addcmul", "",
       [](double s, T d) { return V{normal({64}, s, d), normal({64}, s, d), normal({64}, s, d), -2}; }},
      {"aten::addcdiv", "",
       [](double s, T d) { return V{normal({64}, s, d), normal({64}, s, d), positive({64}, 1e-3, d), -1e-3}; }},
      {"aten::native_layer_norm", "",
       [](double s, T d) {
         return V{normal({8, 32}, s, d), std::vector<int64_t>{32}, normal({32}, 1, d), normal({32}, 1, d), 1e-5};
       }},
      {"aten::native_layer_norm", "",
       [](double s, T d) {
         return V{normal({4, 4, 8}, s, d), std::vector<int64_t>{4, 8}, c10::IValue(), c10::IValue(), 1e-5};
       }},
      {"aten::embedding_dense_backward", "",
       [](double s, T d) {
         return V{normal({20, 8}, s, d), at::randint(5, {20}), 5, -1, false};
       }},
      {"aten::relu", "", [](double s, T d) { return V{normal({64}, s, d)}; }},
      {"aten::clamp_min", "", [](double s, T d) { return V{normal({64}, s, d), 0.5}; }},
      {"aten::threshold_backward", "",
       [](double s, T d) { return V{normal({64}, s, d), normal({64}, 1, d), 0}; }},
      {"aten::masked_fill", "Scalar",
       [](double s, T d) { return V{normal({64}, s, d), at::rand({64}) > 0.5, 7.0}; }},
      {"aten::where", "self",
       [](double s, T d) { return V{at::rand({64}) > 0.5, normal({64}, s, d), positive({64}, s, d)}; }},
      {"aten::cat", "",
       [](double s, T d) { return V{std::vector<at::Tensor>{normal({4}, s, d), positive({6}, 9 * s, d)}, 0}; }},
      {"aten::neg", "", [](double s, T d) { return V{positive({64}, s, d)}; }},
      {"aten::index_select", "",
       [](double s, T d) { return V{normal({10, 4}, s, d), 0, at::randint(10, {7})}; }},
      {"aten::full", "",
       [](double s, T d) {
         return V{std::vector<int64_t>{3}, -s, d, c10::IValue(), c10::IValue(), c10::IValue()};
       }},
  };
}

TEST(range_rules, hold_every_value_the_ops_compute) {
  at::manual_seed(7);
  for (const auto& c : cases())
    for (const auto dtype : {at::kFloat, at::kDouble})
      for (const double scale : {1e-6, 1.0, 1e3, 1e9}) {
        EXPECT_GE(check_case(c, scale, dtype), 1) << c.op << " bounded no output";
      }
}

TEST(range_rules, decline_what_they_cannot_bound) {
  const auto lookup = [](const at::Tensor& t) -> maybe_range { return exact_range(t); };
  const auto output = [&](const char* op, std::vector<c10::IValue> values) {
    const op_arguments args(view(values), lookup);
    return range_rule_for(op)->output(args, 0);
  };
  // Both signs, so its range holds 0 (8 random normals are one-signed 1 time in 128).
  const at::Tensor x = at::linspace(-1, 1, 8);
  EXPECT_FALSE(output("aten::div", {x, x}).has_value()) << "a divisor that may be 0";
  EXPECT_FALSE(output("aten::sqrt", {x}).has_value()) << "a negative argument";
  EXPECT_FALSE(output("aten::log", {at::zeros({3})}).has_value()) << "log(0)";
  EXPECT_FALSE(output("aten::mul", {x, double(NAN)}).has_value()) << "a NaN factor";
  EXPECT_FALSE(output("aten::add", {x, at::full({8}, INFINITY)}).has_value()) << "an infinite argument";
  EXPECT_FALSE(output("aten::addmm", {at::full({8}, NAN), x.view({1, 8}), x.view({8, 1}), 1, 1}).has_value());
  EXPECT_FALSE(output("aten::exp", {at::full({2}, 1e13)}).has_value()) << "past the largest argument";
  // The rules know nothing of tensors the lookup does not.
  const auto unknown = [](const at::Tensor&) -> maybe_range { return c10::nullopt; };
  const std::vector<c10::IValue> values{x, x};
  EXPECT_FALSE(range_rule_for("aten::mul")->output(op_arguments(view(values), unknown), 0).has_value());
  EXPECT_EQ(nullptr, range_rule_for("aten::pow"));
}

TEST(range_rules, take_any_finite_argument_where_the_kernel_computes_nothing_else) {
  const auto lookup = [](const at::Tensor& t) -> maybe_range { return exact_range(t); };
  const std::vector<c10::IValue> huge{at::full({2}, 1e30)};  // Adam's second moment of a loose gradient bound
  const maybe_range root = range_rule_for("aten::sqrt")->output(op_arguments(view(huge), lookup), 0);
  ASSERT_TRUE(root.has_value());
  EXPECT_LE(root->hi, 1.01e15);
  EXPECT_TRUE(range_rule_for("aten::log")->output(op_arguments(view(huge), lookup), 0).has_value());
  const std::vector<c10::IValue> decayed{at::full({2}, 1e30), 0.999};
  EXPECT_TRUE(range_rule_for("aten::mul")->output(op_arguments(view(decayed), lookup), 0).has_value());
  const std::vector<c10::IValue> updated{at::full({2}, 1e30), at::ones({2}), at::ones({2}), 0.001};
  EXPECT_TRUE(range_rule_for("aten::addcmul")->output(op_arguments(view(updated), lookup), 0).has_value());
  EXPECT_FALSE(range_rule_for("aten::gelu")->output(op_arguments(view(huge), lookup), 0).has_value())
      << "a kernel that computes more keeps the limit";
}

TEST(range_rules, store_ranges_finite_in_the_output_dtype) {
  using nanguard::detail::stored_range;
  const auto& computes = *range_rule_for("aten::mul");
  const auto& copies = *range_rule_for("aten::clone");
  EXPECT_TRUE(stored_range({-1, 3e38}, at::kFloat, computes).has_value());
  EXPECT_FALSE(stored_range({-1, 4e38}, at::kFloat, computes).has_value()) << "overflows float32";
  EXPECT_TRUE(stored_range({-1, 4e38}, at::kDouble, computes).has_value());
  EXPECT_FALSE(stored_range({-1, 1}, at::kHalf, computes).has_value()) << "16-bit kernels' rounding is not bounded";
  EXPECT_TRUE(stored_range({-1, 6e4}, at::kHalf, copies).has_value());
  EXPECT_FALSE(stored_range({-1, 65500}, at::kHalf, copies).has_value()) << "may round up past 65504";
  EXPECT_FALSE(stored_range({NAN, NAN}, at::kDouble, copies).has_value());
}

}  // namespace
