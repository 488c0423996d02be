// precision.h — will this model survive float16 or bfloat16? Measure in
// float32 first, then verify.
//
// A `precision_advisor` observes every ATen op (forward, and backward inside
// autograd nodes) while it lives and takes a census of each floating-point
// output: how many values would overflow float16 (|x| >= 65520 rounds to Inf), fall below
// float16's smallest normal (0 < |x| < 6.1e-5: subnormal or zero once cast),
// overflow bfloat16, and the largest magnitude, per module and per op. After
// each backward, `end_step()` reads the parameters' gradients; from them and
// the backward ops' outputs the advisor works out the loss-scale range that
// keeps the backward pass from flushing to zero in float16 without
// overflowing it. `report()` turns that into
// advice: "bf16 is safe", "fp16 needs a loss scale in [a, b]", "keep these
// modules in fp32".
//
//   torch::jit::setGraphExecutorOptimize(false);   // scripted models: per-op autograd
//   nanguard::precision_advisor advisor;
//   advisor.name_parameters(scripted);                  // gradients by parameter name
//   for (int step = 0; step < 3; ++step) {
//     auto loss = torch::mse_loss(scripted.forward({x[step]}).toTensor(), y[step]);
//     loss.backward();
//     advisor.end_step();                            // reads the gradients
//     zero_grad(scripted);
//   }
//   std::cout << nanguard::to_text(advisor.report());
//
// The advice can be checked with a `precision_emulator`, which rounds every
// op output to float16 (or bfloat16) in place and names the modules whose ops
// turned finite inputs into NaN/Inf, and with `autocast` (real float16 or
// bfloat16 autocast, on the CPU or CUDA):
//
//   torch::NoGradGuard no_grad;
//   nanguard::precision_emulator fp16;               // float16 by default
//   scripted.forward({x});
//   fp16.producers();                                // {"blow"}: the modules that overflowed
#pragma once

#include <nanguard/finding.h>
#include <nanguard/float_formats.h>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace torch::jit {
struct Module;
}  // namespace torch::jit

namespace nanguard {

namespace detail {
struct observer_access;  // detail/observer_slot.h
}  // namespace detail

/// Options of a `precision_advisor`.
struct advisor_options {
  /// Fraction of the nonzero backward values (outputs of the ops autograd
  /// runs, outside modules kept in fp32) and gradient values that may still
  /// flush to zero in float16 (|x| < 2^-24) at the recommended minimum loss
  /// scale. (Values in [2^-24, 2^-14) are kept as subnormals with fewer
  /// significant bits; the census counts them as fp16_underflow.)
  TORCH_ARG(double, underflow_tolerance) = 1e-3;
  /// A module whose forward values fall below float16's smallest normal more
  /// often than this fraction gets a note in the advice (precision loss).
  TORCH_ARG(double, underflow_note_fraction) = 0.5;
  /// The largest loss scale ever recommended (also the bound when the
  /// backward pass is all zeros).
  TORCH_ARG(double, max_loss_scale) = 16777216.0;  // 2^24
  /// Observe every thread (true) or only the one that made the advisor.
  TORCH_ARG(bool, all_threads) = false;
};

/// Accumulated census of the values a module, op or gradient produced.
struct value_range {
  int64_t tensors = 0;         ///< tensors measured
  int64_t values = 0;          ///< elements measured
  int64_t nonfinite = 0;       ///< already NaN/Inf in float32
  int64_t zeros = 0;           ///< exact zeros
  int64_t fp16_overflow = 0;   ///< |x| >= 65520: Inf once cast to float16 (the census's count)
  int64_t fp16_underflow = 0;  ///< 0 < |x| < 6.1e-5: subnormal or zero in float16
  int64_t bf16_overflow = 0;   ///< |x| >= 3.396e38: Inf once cast to bfloat16
  double absmax = 0;           ///< largest finite |x|
};

/// The values one op produced in one module and direction.
struct op_precision {
  std::string module;  ///< dotted module path ("" for the top level)
  std::string op;      ///< ATen op, e.g. "aten::mul"
  nanguard::direction direction = direction::forward;  ///< forward, or inside an autograd node
  value_range values;  ///< census of its floating-point outputs
};

/// The values of one module's ops, and what to do about them.
struct module_precision {
  std::string module;    ///< dotted module path ("" for the top level)
  value_range forward;   ///< outputs of its forward ops
  value_range backward;  ///< outputs of the backward ops of its forward ops
  bool keep_fp32 = false;  ///< its forward overflows float16
};

/// One parameter's gradients over the observed steps.
struct gradient_precision {
  std::string parameter;         ///< its name, e.g. "head.weight"
  value_range values;            ///< census of its gradients
  double min_nonzero_abs = 0;    ///< smallest nonzero |g| seen (0 if all zero)
};

/// What the advisor measured, and its advice.
struct precision_report {
  int64_t steps = 0;                          ///< end_step() calls
  std::vector<op_precision> ops;              ///< per module and op, forward first
  std::vector<module_precision> modules;      ///< per module, in path order
  std::vector<gradient_precision> gradients;  ///< per named parameter
  value_range forward;                        ///< every forward op output
  value_range backward;                       ///< every backward op output
  value_range gradient;                       ///< every parameter gradient

  bool fp32_nonfinite = false;         ///< NaN/Inf already in float32: fix that first
  bool bf16_safe = false;              ///< nothing exceeds bfloat16's range
  std::vector<std::string> bf16_overflow_modules;  ///< modules that overflow bfloat16
  std::vector<std::string> keep_fp32;  ///< modules whose forward overflows float16
  double loss_scale_min = 1;           ///< smallest power-of-two loss scale keeping backward values from flushing to zero
  double loss_scale_max = 1;           ///< largest power-of-two loss scale the backward pass allows
  bool loss_scale_fits = false;        ///< loss_scale_min <= loss_scale_max
  std::string loss_scale_min_from;     ///< whose values need the most scaling, e.g. "the backward of squash"
  std::vector<std::string> advice;     ///< sentences, most important first
};

/// Several lines: the advice, the modules and the ops that matter.
std::string to_text(const precision_report& r);
/// A JSON object with every field.
std::string to_json(const precision_report& r);

/// Observes every op while it lives and measures float16/bfloat16 headroom.
///
/// REQUIRES: no other advisor on this thread (or, with all_threads, in the
/// process). For scripted models call torch::jit::setGraphExecutorOptimize(false)
/// first, or the backward pass runs as one fused node and only the gradients
/// are measured.
/// NOTE: a model that is already non-finite in float32 is reported as such
/// (fp32_nonfinite); its float16 advice is then not meaningful.
class precision_advisor {
 public:
  /// Starts observing. Throws c10::Error when the options are out of range
  /// or another advisor is active.
  explicit precision_advisor(advisor_options options = {});
  ~precision_advisor();
  precision_advisor(const precision_advisor&) = delete;
  precision_advisor& operator=(const precision_advisor&) = delete;

  /// Names the parameters of `module` (their gradients are read by end_step;
  /// ops reading them are attributed to their module).
  void name_parameters(const torch::nn::Module& module, const std::string& prefix = "");
  /// Names the parameters of a TorchScript module.
  void name_parameters(const torch::jit::Module& module, const std::string& prefix = "");
  /// Names one parameter.
  void name_parameter(const std::string& name, const at::Tensor& parameter);

  /// Call after backward, before zeroing the gradients: measures the named
  /// parameters' gradients and counts a step.
  void end_step();

  /// The measurements so far and the advice.
  precision_report report() const;

  /// Stops observing until resume().
  void pause();
  /// Observes again after pause().
  void resume();

 private:
  struct state;
  friend struct detail::observer_access;  // its RecordFunction callbacks share the state
  std::unique_ptr<state> state_;
};

/// Options of a `precision_emulator`.
struct emulator_options {
  /// The precision each op output is rounded to: at::kHalf, at::kBFloat16,
  /// or at::kFloat to only watch (e.g. under cpu_autocast).
  TORCH_ARG(at::ScalarType, dtype) = at::kHalf;
  /// Modules whose ops are left in float32 (a path and everything under it).
  TORCH_ARG(std::vector<std::string>, keep_fp32) = {};
  /// Observe every thread (true) or only the one that made the emulator.
  TORCH_ARG(bool, all_threads) = false;
};

/// Emulates low precision: while it lives, every floating-point op output is
/// rounded in place to float16 (or bfloat16) and back, so values beyond the
/// range become Inf; the modules whose ops turned finite inputs into NaN/Inf
/// are recorded.
///
/// REQUIRES: run the model under torch::NoGradGuard (outputs are changed in
/// place, which autograd forbids for saved tensors).
/// NOTE: parameters and inputs are not rounded (round them with
/// `round_to_precision_` for a closer emulation); ops compute in float32 and
/// only their results are rounded, so this finds range problems
/// (overflow, underflow), not the accumulated rounding error of float16 math.
///
///   torch::NoGradGuard no_grad;
///   nanguard::precision_emulator e(nanguard::emulator_options().keep_fp32(report.keep_fp32));
///   auto y = scripted.forward({x}).toTensor();     // finite if the advice holds
class precision_emulator {
 public:
  /// Starts rounding. Throws c10::Error for a dtype other than Half,
  /// BFloat16 or Float, or when another emulator is active.
  explicit precision_emulator(emulator_options options = {});
  ~precision_emulator();
  precision_emulator(const precision_emulator&) = delete;
  precision_emulator& operator=(const precision_emulator&) = delete;

  /// Modules (dotted paths, "" for the top level) whose ops turned finite
  /// inputs into NaN/Inf, in the order they first did.
  const std::vector<std::string>& producers() const;
  /// The first op that did, as a finding (role producer); empty op if none.
  const finding& first() const;

 private:
  struct state;
  friend struct detail::observer_access;  // its RecordFunction callbacks share the state
  std::unique_ptr<state> state_;
};

/// Rounds `t` in place to `dtype` (at::kHalf or at::kBFloat16) and back.
///
///   torch::NoGradGuard g;
///   for (auto p : scripted.parameters()) nanguard::round_to_precision_(p, at::kHalf);
void round_to_precision_(at::Tensor& t, at::ScalarType dtype);

/// Enables autocast on one device type for this thread while it lives (on
/// the CPU matmul, linear and conv run in `dtype`; on CUDA the ops of
/// torch.autocast's lists), and restores the previous state. The same
/// switch as `torch.autocast(device_type, dtype)`.
///
///   { nanguard::autocast fp16(at::kCUDA, at::kHalf); loss = scripted.forward({x}).toTensor().mean(); }
class autocast {
 public:
  /// Enables autocast on `device` (at::kCPU or at::kCUDA) with `dtype`
  /// (at::kBFloat16 or at::kHalf). Throws c10::Error for another dtype.
  autocast(at::DeviceType device, at::ScalarType dtype);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  at::DeviceType device_;
  bool was_enabled_;
  at::ScalarType previous_dtype_;
};

/// Enables bfloat16 (or float16) autocast on the CPU for this thread while it
/// lives (matmul, linear, conv run in bfloat16), and restores the previous state.
///
///   { nanguard::cpu_autocast bf16; y = scripted.forward({x}).toTensor(); }
class cpu_autocast : public autocast {
 public:
  /// Enables CPU autocast with `dtype` (at::kBFloat16 or at::kHalf).
  explicit cpu_autocast(at::ScalarType dtype = at::kBFloat16) : autocast(at::kCPU, dtype) {}
};

}  // namespace nanguard
