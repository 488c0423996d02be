// The precision advisor and emulator: RecordFunction observers that measure
// (advisor) or round (emulator) every floating-point op output.
//
// Like the tracer, the callbacks run ATen ops themselves (the census, the
// rounding) and guard against observing those with a plain thread-local flag:
// at::RecordFunctionGuard rebuilds ATen's callback cache each time.
#include "nanguard/precision.h"

#include "nanguard/census.h"
#include "nanguard/scope.h"

#include "census/census_paths.h"
#include "detail/observer_slot.h"
#include "detail/op_tensors.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/runtime/interpreter.h>
#include <torch/nn/module.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>

namespace nanguard {

using detail::allocates_only;
using detail::is_inplace;

namespace {

// Exponent histograms of backward magnitudes: bin b holds |x| in [2^(b+kMinExp), 2^(b+kMinExp+1)).
constexpr int kMinExp = -160;
constexpr int kBins = 300;
constexpr int kFp16MinSubnormalExp = -24;  // below 2^-24 a value is 0 in float16

using detail::callback_scope;  // also around end_step and round_to_precision_

std::string parent_of(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? "" : name.substr(0, dot);
}

// `module` is `path` or inside it ("" matches only the top level).
bool under(const std::string& module, const std::string& path) {
  if (module == path) return true;
  return !path.empty() && module.size() > path.size() && module.compare(0, path.size(), path) == 0 &&
         module[path.size()] == '.';
}

bool under_any(const std::string& module, const std::vector<std::string>& paths) {
  for (const auto& p : paths)
    if (under(module, p)) return true;
  return false;
}

void add(value_range& r, const value_range& o) {
  r.tensors += o.tensors;
  r.values += o.values;
  r.nonfinite += o.nonfinite;
  r.zeros += o.zeros;
  r.fp16_overflow += o.fp16_overflow;
  r.fp16_underflow += o.fp16_underflow;
  r.bf16_overflow += o.bf16_overflow;
  r.absmax = std::max(r.absmax, o.absmax);
}

// What the advisor keeps of one tensor's census.
value_range range_of(const tensor_stats& s) {
  return {1, s.numel, s.nonfinite(), s.zeros, s.fp16_overflow, s.fp16_underflow, s.bf16_overflow, s.absmax};
}

// What a start callback hands its end callback (both observers).
struct op_context : at::ObserverContext {
  std::vector<at::Tensor> inputs;
  std::string module;
  bool inputs_finite = true;                 // emulator: every input finite at the start
  op_context* parent = nullptr;             // the op this one runs inside, if any
};
struct node_context : at::ObserverContext {};

// The ops running on this thread, innermost last. The advisor measures the
// ops the model called (aten::linear), not the ones they run inside
// (aten::addmm, the aten::empty of its result). One stack per observer kind:
// an advisor and an emulator may observe together.
thread_local op_context* innermost_advisor_op = nullptr;
thread_local op_context* innermost_emulator_op = nullptr;
// Sequence numbers of the autograd nodes running on this thread. The engine's
// "autograd::engine::evaluate_function: X" frame pushes kEngineFrame, which
// the node X's own frame fills in: the engine's work after the node (summing
// a broadcast gradient to its input's shape) is attributed to X too.
thread_local std::vector<int64_t> node_stack;
constexpr int64_t kEngineFrame = std::numeric_limits<int64_t>::min();

bool is_alias(const op_context& ctx, const at::Tensor& out, bool inplace) {
  if (inplace) return false;
  for (const auto& in : ctx.inputs)
    if (out.is_alias_of(in)) return true;
  return false;
}

void push_op(op_context*& innermost, op_context* ctx) {
  ctx->parent = innermost;
  innermost = ctx;
}

// Pops `ctx`. (RecordFunction calls the end callbacks it started, even of a
// callback removed meanwhile, so the starts and ends pair up.)
void pop_op(op_context*& innermost, op_context* ctx) {
  if (innermost == ctx) innermost = ctx->parent;
}

// Scalars the interpreter wraps into 0-dim tensors (the 1e5 of `x * 1e5`)
// are constants, not the model's values: ops on 0-dim tensors only are skipped.
bool scalars_only(const op_context& ctx, const at::RecordFunction& fn) {
  for (const auto& t : ctx.inputs)
    if (t.dim() > 0) return false;
  for (const auto& v : fn.outputs())
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().dim() > 0) return false;
  return true;
}

std::string fmt_scale(double s) {
  const int e = int(std::lround(std::log2(s)));
  return fmt::format("{:g} (2^{})", s, e);
}

std::string label(const std::string& module) { return module.empty() ? "(top level)" : module; }

}  // namespace

// ============================================================== advisor

struct precision_advisor::state {
  advisor_options options;
  std::mutex mutex;
  int64_t steps = 0;
  std::map<std::tuple<std::string, int, std::string>, value_range> ops;  // (module, direction, op)
  std::unordered_map<const c10::TensorImpl*, std::string> parameter_names;
  std::vector<std::pair<std::string, at::Tensor>> parameters;  // in naming order
  std::map<std::string, gradient_precision> gradients;
  std::unordered_map<int64_t, std::string> forward_module;  // by autograd sequence number
  std::array<int64_t, kBins> gradient_histogram{};
  std::map<std::string, std::array<int64_t, kBins>> backward_histograms;  // by module
  std::string first_nonfinite;  // "op in module"
  detail::observer_slot<state> slot{"nanguard::precision_advisor"};  // last: uninstalled first
};

namespace {

using advisor_state = detail::observer_access::state<precision_advisor>;

advisor_state* current_advisor() {
  return detail::observer_slot<advisor_state>::current();
}

std::string module_of(advisor_state& st, const std::vector<at::Tensor>& inputs) {
  const std::string scripted = dotted_module_path(torch::jit::currentModuleHierarchy());
  if (!scripted.empty()) return scripted;
  const std::string& open = current_scope();
  for (const auto& t : inputs) {
    const auto it = st.parameter_names.find(t.unsafeGetTensorImpl());
    if (it == st.parameter_names.end()) continue;
    const std::string owner = parent_of(it->second);
    if (open.empty() || owner == open || owner.rfind(open + ".", 0) == 0) return owner;
  }
  return open;
}

std::unique_ptr<at::ObserverContext> advisor_start(const at::RecordFunction& fn) {
  advisor_state* st = current_advisor();
  if (!st) return nullptr;
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    if (!node_stack.empty() && node_stack.back() == kEngineFrame) node_stack.back() = fn.seqNr();
    node_stack.push_back(fn.seqNr());
    return std::make_unique<node_context>();
  }
  // The engine's frames are no ops: the ops a node runs are measured as
  // outermost ops.
  if (std::strncmp(fn.name(), "autograd::engine::evaluate_function", 35) == 0) {
    node_stack.push_back(kEngineFrame);
    return std::make_unique<node_context>();
  }
  if (std::strncmp(fn.name(), "autograd::", 10) == 0) return nullptr;
  callback_scope no_recursion;
  auto ctx = std::make_unique<op_context>();
  for (const auto& v : fn.inputs()) detail::collect_tensors(v, ctx->inputs);
  std::lock_guard<std::mutex> lock(st->mutex);
  if (node_stack.empty()) {
    ctx->module = module_of(*st, ctx->inputs);
    if (fn.seqNr() >= 0) st->forward_module[fn.seqNr()] = ctx->module;
  } else if (auto it = st->forward_module.find(node_stack.back()); it != st->forward_module.end()) {
    ctx->module = it->second;
  }
  push_op(innermost_advisor_op, ctx.get());
  return ctx;
}

// Adds the exponents of the nonzero finite |x| to `h`; returns the smallest
// such |x| (0 if none).
double add_histogram(std::array<int64_t, kBins>& h, const at::Tensor& x) {
  at::Tensor a = x.detach().abs().to(at::kDouble).flatten();
  a = a.masked_select(at::isfinite(a).logical_and(a > 0));
  if (a.numel() == 0) return 0;
  const at::Tensor bins = (at::floor(at::log2(a)) - kMinExp).clamp(0, kBins - 1).to(at::kLong);
  // Read on the host: the tensors may be on a GPU.
  const at::Tensor counts = at::bincount(bins, {}, kBins).to(at::kCPU, at::kLong).contiguous();
  const int64_t* c = counts.data_ptr<int64_t>();
  for (int b = 0; b < kBins; ++b) h[size_t(b)] += c[b];
  return a.min().item<double>();
}

void advisor_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
  if (dynamic_cast<node_context*>(raw)) {
    if (!node_stack.empty()) node_stack.pop_back();
    return;
  }
  auto* ctx = static_cast<op_context*>(raw);
  advisor_state* st = current_advisor();
  if (!ctx) return;
  callback_scope no_recursion;
  if (st && !ctx->parent && !allocates_only(fn.name()) && !scalars_only(*ctx, fn)) {
    const bool inplace = is_inplace(fn.name());
    const int dir = node_stack.empty() ? 0 : 1;
    for (const auto& v : fn.outputs()) {
      if (!v.isTensor()) continue;
      if (!detail::measurable(v.toTensor())) continue;
      const at::Tensor out = detail::real_values(v.toTensor());
      if (is_alias(*ctx, out, inplace)) continue;
      const tensor_stats s = census(out);
      std::lock_guard<std::mutex> lock(st->mutex);
      add(st->ops[{ctx->module, dir, fn.name()}], range_of(s));
      if (dir == 1) add_histogram(st->backward_histograms[ctx->module], out);
      if (!s.all_finite() && st->first_nonfinite.empty())
        st->first_nonfinite = fmt::format("{} ({}) in {}", fn.name(), dir ? "backward" : "forward",
                                          label(ctx->module));
    }
  }
  pop_op(innermost_advisor_op, ctx);
}

void add_gradient(advisor_state& st, const std::string& name, const at::Tensor& grad) {
  const tensor_stats s = census(grad);
  gradient_precision& g = st.gradients[name];
  g.parameter = name;
  add(g.values, range_of(s));
  const double mn = add_histogram(st.gradient_histogram, grad);
  if (mn > 0) g.min_nonzero_abs = g.min_nonzero_abs == 0 ? mn : std::min(g.min_nonzero_abs, mn);
}

}  // namespace

precision_advisor::precision_advisor(advisor_options options) : state_(std::make_unique<state>()) {
  TORCH_CHECK(options.underflow_tolerance() >= 0 && options.underflow_tolerance() < 1,
              "nanguard::precision_advisor: underflow_tolerance must be in [0, 1), got ",
              options.underflow_tolerance(), "; e.g. 1e-3 lets 0.1% of the backward values underflow");
  TORCH_CHECK(options.underflow_note_fraction() > 0 && options.underflow_note_fraction() <= 1,
              "nanguard::precision_advisor: underflow_note_fraction must be in (0, 1], got ",
              options.underflow_note_fraction());
  TORCH_CHECK(options.max_loss_scale() >= 1 && std::isfinite(options.max_loss_scale()),
              "nanguard::precision_advisor: max_loss_scale must be finite and at least 1, got ",
              options.max_loss_scale(), "; the default is 2^24");
  state_->options = options;
  state_->slot.claim(state_.get(), options.all_threads());
  resume();
}

precision_advisor::~precision_advisor() = default;

void precision_advisor::name_parameter(const std::string& name, const at::Tensor& parameter) {
  TORCH_CHECK(parameter.defined(), "nanguard::precision_advisor::name_parameter: the parameter '", name,
              "' is undefined");
  std::lock_guard<std::mutex> lock(state_->mutex);
  const auto [it, added] = state_->parameter_names.emplace(parameter.unsafeGetTensorImpl(), name);
  if (added) state_->parameters.emplace_back(name, parameter);
  else it->second = name;
}

void precision_advisor::name_parameters(const torch::nn::Module& module, const std::string& prefix) {
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    name_parameter(prefix.empty() ? p.key() : prefix + "." + p.key(), p.value());
}

void precision_advisor::name_parameters(const torch::jit::Module& module, const std::string& prefix) {
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    name_parameter(prefix.empty() ? p.name : prefix + "." + p.name, p.value);
}

void precision_advisor::end_step() {
  callback_scope no_recursion;  // the ATen ops below are not the model's
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (const auto& [name, p] : state_->parameters) {
    const at::Tensor& g = p.grad();
    if (detail::measurable(g)) add_gradient(*state_, name, detail::real_values(g));
  }
  state_->forward_module.clear();
  state_->steps += 1;
}

namespace {

// The values measured, summed per op, per module and direction, per
// gradient and overall, and what they say of fp32, fp16's forward and bf16.
void summarise(const advisor_state& st, precision_report& r) {
  r.steps = st.steps;
  std::map<std::string, module_precision> modules;
  for (const auto& [key, values] : st.ops) {
    const auto& [module, dir, op] = key;
    r.ops.push_back({module, op, dir ? direction::backward : direction::forward, values});
    module_precision& m = modules[module];
    m.module = module;
    add(dir ? m.backward : m.forward, values);
    add(dir ? r.backward : r.forward, values);
  }
  std::stable_sort(r.ops.begin(), r.ops.end(), [](const op_precision& a, const op_precision& b) {
    return a.direction < b.direction;
  });
  for (const auto& [name, g] : st.gradients) {
    r.gradients.push_back(g);
    add(r.gradient, g.values);
  }
  for (auto& [name, m] : modules) {
    m.keep_fp32 = m.forward.fp16_overflow > 0;
    if (m.keep_fp32) r.keep_fp32.push_back(name);
    if (m.forward.bf16_overflow + m.backward.bf16_overflow > 0) r.bf16_overflow_modules.push_back(name);
    r.modules.push_back(m);
  }
  r.fp32_nonfinite = r.forward.nonfinite + r.backward.nonfinite + r.gradient.nonfinite > 0;
  r.bf16_safe = r.bf16_overflow_modules.empty() && r.gradient.bf16_overflow == 0;
}

// The smallest k keeping all but `tolerance` of the nonzero values counted
// in `hist` from flushing to zero in fp16 once scaled by 2^k (e + k >= -24
// for a value of exponent e); 0 if it counts none.
int smallest_scale_exponent(const std::array<int64_t, kBins>& hist, double tolerance) {
  int64_t nonzero = 0;
  for (int64_t c : hist) nonzero += c;
  if (nonzero == 0) return 0;
  const double allowed = tolerance * double(nonzero);
  int k = -64;
  for (;; ++k) {
    int64_t flushed = 0;
    for (int b = 0; b < kBins && b + kMinExp + k < kFp16MinSubnormalExp; ++b) flushed += hist[size_t(b)];
    if (double(flushed) <= allowed || k >= 200) return k;
  }
}

// The largest |x| of the backward values and gradients outside the modules
// kept in fp32: what a loss scale must keep within fp16's range.
double scaled_absmax(const precision_report& r) {
  double absmax = 0;
  for (const auto& m : r.modules)
    if (!m.keep_fp32) absmax = std::max(absmax, m.backward.absmax);
  for (const auto& g : r.gradients)
    if (!under_any(parent_of(g.parameter), r.keep_fp32)) absmax = std::max(absmax, g.values.absmax);
  return absmax;
}

// The range of fp16 loss scales. Lower bound: the smallest 2^k that keeps
// all but `underflow_tolerance` of the nonzero backward values (outside the
// modules kept in fp32) and gradients from flushing to zero in fp16. Upper
// bound: the largest 2^k that keeps every one of them within fp16's range.
void fit_loss_scale(const advisor_state& st, precision_report& r) {
  const double tolerance = st.options.underflow_tolerance();
  std::array<int64_t, kBins> h = st.gradient_histogram;
  for (const auto& [module, mh] : st.backward_histograms)
    if (!under_any(module, r.keep_fp32))
      for (int b = 0; b < kBins; ++b) h[size_t(b)] += mh[size_t(b)];
  const int k_min = smallest_scale_exponent(h, tolerance);
  // Whose values need the most scaling: a module's backward, or the gradients.
  int k_worst = smallest_scale_exponent(st.gradient_histogram, tolerance);
  r.loss_scale_min_from = "the gradients";
  for (const auto& [module, mh] : st.backward_histograms) {
    if (under_any(module, r.keep_fp32)) continue;
    const int k = smallest_scale_exponent(mh, tolerance);
    if (k > k_worst) k_worst = k, r.loss_scale_min_from = fmt::format("the backward of {}", label(module));
  }
  const int k_cap = int(std::floor(std::log2(st.options.max_loss_scale())));
  const double absmax = scaled_absmax(r);
  const int k_max = absmax > 0 ? std::min(k_cap, int(std::floor(std::log2(fp16_max / absmax)))) : k_cap;
  r.loss_scale_min = std::ldexp(1.0, k_min);
  r.loss_scale_max = std::ldexp(1.0, k_max);
  r.loss_scale_fits = k_min <= k_max;
}

// The advice on fp16's loss scale, and the modules whose forward values
// fp16 flushes.
void advise_fp16(const advisor_state& st, precision_report& r) {
  const advisor_options& o = st.options;
  auto& a = r.advice;
  const double backward_absmax = scaled_absmax(r);
  if (r.loss_scale_fits) {
    a.push_back(fmt::format(
        "fp16 needs a loss scale in [{}, {}]{}: below, more than {:g}% of the nonzero backward and gradient "
        "values flush to zero in fp16 (|x| < 6e-8; the smallest are in {}); above, the backward pass overflows "
        "(largest backward |x| {:.4g})",
        fmt_scale(r.loss_scale_min), fmt_scale(r.loss_scale_max),
        r.loss_scale_min <= 1 && r.loss_scale_max >= 1 ? " (1, no scaling, is in range)" : "",
        o.underflow_tolerance() * 100, r.loss_scale_min_from, backward_absmax));
  } else {
    a.push_back(fmt::format(
        "no fp16 loss scale fits: the backward values need at least {} but the backward pass overflows above {} "
        "(largest backward |x| {:.4g}); use bf16, or keep the modules with the largest backward values in fp32",
        fmt_scale(r.loss_scale_min), fmt_scale(r.loss_scale_max), backward_absmax));
  }
  for (const auto& m : r.modules) {
    const int64_t nonzero = m.forward.values - m.forward.zeros - m.forward.nonfinite;
    if (nonzero > 0 && double(m.forward.fp16_underflow) > o.underflow_note_fraction() * double(nonzero))
      a.push_back(fmt::format("note: {:.0f}% of {}'s forward values are below fp16's smallest normal (6.1e-5): "
                              "they lose precision or flush to zero in fp16",
                              100.0 * double(m.forward.fp16_underflow) / double(nonzero), label(m.module)));
  }
}

// The advice, most important first.
void advise(const advisor_state& st, precision_report& r) {
  auto& a = r.advice;
  if (r.fp32_nonfinite)
    a.push_back(fmt::format(
        "the model already makes NaN/Inf in float32 (first: {}): fix that first (nanguard::tracer "
        "names the op); the advice below ignores those values",
        st.first_nonfinite.empty() ? std::string("in the gradients") : st.first_nonfinite));
  const double absmax = std::max({r.forward.absmax, r.backward.absmax, r.gradient.absmax});
  if (r.bf16_safe)
    a.push_back(fmt::format("bf16 is safe: the largest magnitude seen is {:.4g}, within bfloat16's range "
                            "(3.39e38); it needs no loss scaling (bfloat16 has float32's exponent range)",
                            absmax));
  else
    a.push_back(fmt::format("bf16 is not safe: {} exceed bfloat16's range (3.39e38); keep them in fp32",
                            r.bf16_overflow_modules.empty() ? std::string("the gradients")
                                                            : fmt::format("{}", fmt::join(r.bf16_overflow_modules, ", "))));
  if (!r.keep_fp32.empty()) {
    std::vector<std::string> why;
    for (const auto& m : r.modules)
      if (m.keep_fp32)
        why.push_back(fmt::format("{} ({} values overflow fp16, largest {:.4g})", label(m.module), m.forward.fp16_overflow,
                                  m.forward.absmax));
    a.push_back(fmt::format("keep these modules in fp32: {}", fmt::join(why, ", ")));
  } else {
    a.push_back(fmt::format("fp16 forward is in range: no forward value overflows it (largest {:.4g})",
                            r.forward.absmax));
  }
  advise_fp16(st, r);
}

}  // namespace

precision_report precision_advisor::report() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  precision_report r;
  summarise(*state_, r);
  fit_loss_scale(*state_, r);
  advise(*state_, r);
  return r;
}

void precision_advisor::pause() { state_->slot.uninstall(); }

void precision_advisor::resume() {
  state_->slot.install(advisor_start, advisor_end, /*autograd_nodes=*/true);
}

// ============================================================== report rendering

namespace {

nlohmann::json json_of(const value_range& v) {
  return {{"tensors", v.tensors},           {"values", v.values},
          {"nonfinite", v.nonfinite},       {"zeros", v.zeros},
          {"fp16_overflow", v.fp16_overflow}, {"fp16_underflow", v.fp16_underflow},
          {"bf16_overflow", v.bf16_overflow}, {"absmax", v.absmax}};
}

std::string pct(int64_t n, int64_t of) {
  return of == 0 ? "-" : fmt::format("{:.2f}%", 100.0 * double(n) / double(of));
}

}  // namespace

std::string to_json(const precision_report& r) {
  nlohmann::json j;
  j["steps"] = r.steps;
  j["fp32_nonfinite"] = r.fp32_nonfinite;
  j["bf16_safe"] = r.bf16_safe;
  j["bf16_overflow_modules"] = r.bf16_overflow_modules;
  j["keep_fp32"] = r.keep_fp32;
  j["loss_scale"] = {{"min", r.loss_scale_min},
                     {"max", r.loss_scale_max},
                     {"fits", r.loss_scale_fits},
                     {"min_from", r.loss_scale_min_from}};
  j["advice"] = r.advice;
  j["forward"] = json_of(r.forward);
  j["backward"] = json_of(r.backward);
  j["gradient"] = json_of(r.gradient);
  j["modules"] = nlohmann::json::array();
  for (const auto& m : r.modules)
    j["modules"].push_back({{"module", m.module},
                            {"keep_fp32", m.keep_fp32},
                            {"forward", json_of(m.forward)},
                            {"backward", json_of(m.backward)}});
  j["ops"] = nlohmann::json::array();
  for (const auto& o : r.ops)
    j["ops"].push_back(
        {{"module", o.module}, {"op", o.op}, {"direction", to_string(o.direction)}, {"values", json_of(o.values)}});
  j["gradients"] = nlohmann::json::array();
  for (const auto& g : r.gradients)
    j["gradients"].push_back(
        {{"parameter", g.parameter}, {"min_nonzero_abs", g.min_nonzero_abs}, {"values", json_of(g.values)}});
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string to_text(const precision_report& r) {
  std::string s = fmt::format("precision advice after {} step{} ({} forward, {} backward, {} gradient values):\n",
                              r.steps, r.steps == 1 ? "" : "s", r.forward.values, r.backward.values,
                              r.gradient.values);
  for (const auto& a : r.advice) s += "  - " + a + "\n";
  s += fmt::format("modules (forward values; backward |x| max):\n  {:<24} {:>10} {:>11} {:>12} {:>10} {:>11} {:>11}  {}\n",
                   "module", "values", "fp16 ovf", "fp16<6.1e-5", "bf16 ovf", "max |x|", "bwd max", "advice");
  for (const auto& m : r.modules)
    s += fmt::format("  {:<24} {:>10} {:>11} {:>12} {:>10} {:>11.4g} {:>11.4g}  {}\n", label(m.module), m.forward.values,
                     m.forward.fp16_overflow, pct(m.forward.fp16_underflow, m.forward.values),
                     m.forward.bf16_overflow, m.forward.absmax, m.backward.absmax, m.keep_fp32 ? "keep fp32" : "");
  bool header = false;
  for (const auto& o : r.ops) {
    if (o.values.fp16_overflow == 0 && o.values.bf16_overflow == 0) continue;
    if (!header) s += "ops whose values overflow fp16:\n", header = true;
    s += fmt::format("  {:<24} {:<22} {:<8} {} of {} values overflow fp16, max |x| {:.4g}\n", label(o.module), o.op,
                     to_string(o.direction), o.values.fp16_overflow, o.values.values, o.values.absmax);
  }
  if (!r.gradients.empty()) {
    s += fmt::format("gradients:\n  {:<28} {:>10} {:>12} {:>11} {:>11}\n", "parameter", "values", "fp16<6.1e-5",
                     "min |g|>0", "max |g|");
    for (const auto& g : r.gradients)
      s += fmt::format("  {:<28} {:>10} {:>12} {:>11.4g} {:>11.4g}\n", g.parameter, g.values.values,
                       pct(g.values.fp16_underflow, g.values.values), g.min_nonzero_abs, g.values.absmax);
  }
  return s;
}

// ============================================================== emulator

struct precision_emulator::state {
  emulator_options options;
  std::mutex mutex;
  std::vector<std::string> producers;
  finding first;
  detail::observer_slot<state> slot{"nanguard::precision_emulator"};  // last: uninstalled first
};

namespace {

using emulator_state = detail::observer_access::state<precision_emulator>;

emulator_state* current_emulator() {
  return detail::observer_slot<emulator_state>::current();
}

std::unique_ptr<at::ObserverContext> emulator_start(const at::RecordFunction& fn) {
  if (!current_emulator()) return nullptr;
  callback_scope no_recursion;
  auto ctx = std::make_unique<op_context>();
  for (const auto& v : fn.inputs()) detail::collect_tensors(v, ctx->inputs);
  for (const auto& t : ctx->inputs) ctx->inputs_finite &= !detail::has_nonfinite_on_this_thread(t);
  ctx->module = dotted_module_path(torch::jit::currentModuleHierarchy());
  if (ctx->module.empty()) ctx->module = current_scope();
  push_op(innermost_emulator_op, ctx.get());
  return ctx;
}

void emulator_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
  auto* ctx = static_cast<op_context*>(raw);
  emulator_state* st = current_emulator();
  if (!ctx) return;
  callback_scope no_recursion;
  if (st && !allocates_only(fn.name()) && !scalars_only(*ctx, fn)) {
    const bool inplace = is_inplace(fn.name());
    const bool keep = under_any(ctx->module, st->options.keep_fp32());
    const at::ScalarType dtype = st->options.dtype();
    int index = 0;
    for (const auto& v : fn.outputs()) {
      const int output = index++;
      if (!v.isTensor()) continue;
      if (!detail::measurable(v.toTensor())) continue;
      at::Tensor out = detail::real_values(v.toTensor());
      if (is_alias(*ctx, out, inplace)) continue;
      if (!keep && dtype != at::kFloat && out.scalar_type() != dtype &&
          c10::elementSize(out.scalar_type()) > c10::elementSize(dtype))
        round_to_precision_(out, dtype);
      if (!ctx->inputs_finite || !detail::has_nonfinite_on_this_thread(out)) continue;
      std::lock_guard<std::mutex> lock(st->mutex);
      if (std::find(st->producers.begin(), st->producers.end(), ctx->module) == st->producers.end())
        st->producers.push_back(ctx->module);
      if (st->first.op.empty()) {
        const tensor_stats s = census(out);
        finding& f = st->first;
        f.op = fn.name();
        f.module = ctx->module;
        f.role = role::producer;
        f.sequence_nr = fn.seqNr();
        f.thread = fn.threadId();
        for (size_t i = 0; i < ctx->inputs.size(); ++i)
          f.inputs.push_back({"input " + std::to_string(i), c10::toString(ctx->inputs[i].scalar_type()),
                              ctx->inputs[i].sizes().vec(), census(ctx->inputs[i])});
        f.outputs.push_back({"output " + std::to_string(output), c10::toString(out.scalar_type()), out.sizes().vec(), s});
        f.output = output;
        f.index = s.first_nonfinite_index;
        f.value = s.first_nonfinite_value;
      }
    }
  }
  pop_op(innermost_emulator_op, ctx);
}

}  // namespace

precision_emulator::precision_emulator(emulator_options options) : state_(std::make_unique<state>()) {
  const at::ScalarType d = options.dtype();
  TORCH_CHECK_TYPE(d == at::kHalf || d == at::kBFloat16 || d == at::kFloat,
                   "nanguard::precision_emulator: dtype must be Half, BFloat16 or Float (watch only), got ",
                   c10::toString(d));
  state_->options = std::move(options);
  state_->slot.claim(state_.get(), state_->options.all_threads());
  state_->slot.install(emulator_start, emulator_end, /*autograd_nodes=*/false);
}

precision_emulator::~precision_emulator() = default;

const std::vector<std::string>& precision_emulator::producers() const { return state_->producers; }

const finding& precision_emulator::first() const { return state_->first; }

void round_to_precision_(at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16,
                   "nanguard::round_to_precision_: dtype must be Half or BFloat16, got ", c10::toString(dtype));
  TORCH_CHECK(t.defined(), "nanguard::round_to_precision_: the tensor is undefined; pass one that holds data");
  TORCH_CHECK_TYPE(t.is_floating_point(), "nanguard::round_to_precision_: needs a floating-point tensor, got ",
                   t.scalar_type());
  callback_scope no_recursion;
  at::Tensor values = t.detach();  // shares storage: rounds t itself, outside autograd
  values.copy_(values.to(dtype));
}

// ============================================================== autocast

autocast::autocast(at::DeviceType device, at::ScalarType dtype)
    : device_(device),
      was_enabled_(at::autocast::is_autocast_enabled(device)),
      previous_dtype_(at::autocast::get_autocast_dtype(device)) {
  TORCH_CHECK_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf,
                   "nanguard::autocast: autocast runs in BFloat16 or Half, got ", c10::toString(dtype),
                   "; pass at::kBFloat16 or at::kHalf");
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::set_autocast_enabled(device, true);
}

autocast::~autocast() {
  at::autocast::set_autocast_enabled(device_, was_enabled_);
  at::autocast::set_autocast_dtype(device_, previous_dtype_);
  if (!was_enabled_) at::autocast::clear_cache();
}

}  // namespace nanguard
