#include "guard/op_patch.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <fmt/format.h>

#include <cmath>
#include <mutex>
#include <optional>
#include <utility>

namespace nanguard::detail {
namespace {

constexpr c10::DispatchKey kPatchKey = c10::DispatchKey::DeferredInit;

// The patch in force, if any: read by the fallback on whichever thread a
// scope is open (the training thread, autograd's workers).
std::mutex patch_mutex;
op_patch* current_patch = nullptr;

op_patch* patch_for(const c10::OperatorHandle& op) {
  const std::lock_guard<std::mutex> lock(patch_mutex);
  if (!current_patch) return nullptr;
  const op_rewrite& r = current_patch->rewrite();
  // float32 looks at every op: one that mixes float32 with the low dtype is run in float32.
  return r.kind == remedy_kind::float32 || op.schema().name() == r.op ? current_patch : nullptr;
}

// The i-th of the op's `n` arguments on the stack.
c10::IValue& argument(torch::jit::Stack& stack, size_t n, size_t i) { return stack[stack.size() - n + i]; }

bool writes_an_argument(const c10::FunctionSchema& schema) {
  for (const c10::Argument& a : schema.arguments())
    if (a.alias_info() && a.alias_info()->isWrite()) return true;
  return false;
}

// ---- the rewrites; each returns whether it changed the call (`look`:
// whether it reads the values first and leaves a call that needs no change)

// clamp_input: the first input clamped into [low, high]. A pow only with a
// fractional exponent (an integer power of a negative base is no error).
bool clamp_first_input(const op_rewrite& r, bool look, const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  const size_t n = op.schema().arguments().size();
  c10::IValue& self = argument(stack, n, 0);
  if (!self.isTensor()) return false;
  if (r.op == "aten::pow") {
    if (n < 2 || !argument(stack, n, 1).isScalar()) return false;
    const double exponent = argument(stack, n, 1).toScalar().toDouble();
    if (exponent == std::floor(exponent)) return false;
  }
  const at::Tensor x = self.toTensor();
  const bool below = std::isfinite(r.low) && (!look || (x < r.low).any().item<bool>());
  const bool above = std::isfinite(r.high) && (!look || (x > r.high).any().item<bool>());
  if (!below && !above) return false;
  self = at::clamp(x, std::isfinite(r.low) ? std::optional<at::Scalar>(r.low) : std::nullopt,
                   std::isfinite(r.high) ? std::optional<at::Scalar>(r.high) : std::nullopt);
  return true;
}

// denominator_eps: a division's `other` (a reciprocal's input) with eps for its zeros.
bool fill_zero_denominator(const op_rewrite& r, bool look, const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  const size_t n = op.schema().arguments().size();
  const size_t i = r.op == "aten::div" ? 1 : 0;
  if (n <= i || !argument(stack, n, i).isTensor()) return false;
  const at::Tensor d = argument(stack, n, i).toTensor();
  const at::Tensor zero = d == 0;
  if (look && !zero.any().item<bool>()) return false;
  argument(stack, n, i) = d.masked_fill(zero, r.eps);
  return true;
}

// safe_softmax: softmax(self, dim, dtype) or _softmax(self, dim, half_to_float)
// as _safe_softmax, which gives 0 for a row with no finite entry.
bool run_safe_softmax(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  const size_t n = op.schema().arguments().size();
  if (n != 3 || !argument(stack, n, 0).isTensor()) return false;
  const at::Tensor self = argument(stack, n, 0).toTensor();
  const int64_t dim = argument(stack, n, 1).toInt();
  const c10::IValue& third = argument(stack, n, 2);
  const bool to_float = third.isBool() ? third.toBool() : !third.isNone() && third.toScalarType() == at::kFloat;
  const bool to_other = !third.isBool() && !third.isNone() && !to_float;
  at::Tensor out = to_other   ? at::_safe_softmax(self, dim, third.toScalarType())
                   : to_float ? at::_safe_softmax(self, dim, at::kFloat)
                              : at::_safe_softmax(self, dim);
  torch::jit::drop(stack, n);
  torch::jit::push(stack, std::move(out));
  return true;
}

// float32: the target's low-precision inputs cast up; another op's only when
// it mixes them with float32 (what the target's float32 output meets).
// In-place and out= ops keep their dtypes. Returns whether any input changed.
bool cast_up(const op_rewrite& r, const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  const c10::FunctionSchema& schema = op.schema();
  if (writes_an_argument(schema)) return false;
  const size_t n = schema.arguments().size();
  const bool target = schema.name() == r.op;
  bool low = false, high = false;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& a = argument(stack, n, i);
    if (!a.isTensor() || !a.toTensor().defined()) continue;
    low = low || a.toTensor().scalar_type() == r.dtype;
    high = high || a.toTensor().scalar_type() == at::kFloat;
  }
  if (!low || (!target && !high)) return false;
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& a = argument(stack, n, i);
    if (a.isTensor() && a.toTensor().defined() && a.toTensor().scalar_type() == r.dtype)
      a = a.toTensor().to(at::kFloat);
  }
  return true;
}

// Autocast casts an op's inputs below the patch: the float32 target runs without it.
c10::DispatchKeySet without_autocast(c10::DispatchKeySet ks) {
  for (const c10::DispatchKey k : {c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA})
    ks = ks.remove(k);
  return ks;
}

void patch_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::DispatchKeySet below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kPatchKey);
  op_patch* patch = patch_for(op);
  if (!patch) return op.redispatchBoxed(below, stack);
  // The rewrite's own ops (and what the rewritten op calls) run unpatched.
  const c10::impl::ExcludeDispatchKeyGuard unpatched(kPatchKey);
  const op_rewrite& r = patch->rewrite();
  bool changed = false;
  switch (r.kind) {
    case remedy_kind::clamp_input: changed = clamp_first_input(r, patch->counts_changes(), op, *stack); break;
    case remedy_kind::denominator_eps:
      changed = fill_zero_denominator(r, patch->counts_changes(), op, *stack);
      break;
    case remedy_kind::safe_softmax:
      if (run_safe_softmax(op, *stack)) return patch->count_rewrite();
      break;
    case remedy_kind::float32: {
      cast_up(r, op, *stack);  // counted below as a call of the target, cast or not
      const bool target = op.schema().name() == r.op;
      if (target) patch->count_rewrite();
      return op.redispatchBoxed(target ? without_autocast(below) : below, stack);
    }
    default: break;
  }
  if (changed) patch->count_rewrite();
  op.redispatchBoxed(below, stack);
}

// Registers the fallback once, the first time a patch is made; it stays
// registered for the process (a patch that is not in scope costs nothing).
void register_fallback() {
  static const bool registered = [] {
    static torch::Library library(torch::Library::IMPL, "_", kPatchKey, __FILE__, __LINE__);
    library.fallback(torch::CppFunction::makeFromBoxedFunction<&patch_fallback>());
    return true;
  }();
  (void)registered;
}

std::string bound(double v) { return fmt::format("{:g}", v); }

}  // namespace

op_rewrite op_rewrite::clamp_input(std::string op, double low, double high) {
  op_rewrite r;
  r.kind = remedy_kind::clamp_input;
  r.op = std::move(op);
  r.low = low;
  r.high = high;
  return r;
}

op_rewrite op_rewrite::denominator_eps(std::string op, double eps) {
  op_rewrite r;
  r.kind = remedy_kind::denominator_eps;
  r.op = std::move(op);
  r.eps = eps;
  return r;
}

op_rewrite op_rewrite::safe_softmax(std::string op) {
  op_rewrite r;
  r.kind = remedy_kind::safe_softmax;
  r.op = std::move(op);
  return r;
}

op_rewrite op_rewrite::float32(std::string op, at::ScalarType dtype) {
  op_rewrite r;
  r.kind = remedy_kind::float32;
  r.op = std::move(op);
  r.dtype = dtype;
  return r;
}

std::string op_rewrite::description() const {
  switch (kind) {
    case remedy_kind::clamp_input:
      if (!std::isfinite(high)) return fmt::format("the input of {} clamped to >= {}", op, bound(low));
      if (!std::isfinite(low)) return fmt::format("the input of {} clamped to <= {}", op, bound(high));
      return fmt::format("the input of {} clamped to [{}, {}]", op, bound(low), bound(high));
    case remedy_kind::denominator_eps: return fmt::format("eps {} on the zero denominators of {}", bound(eps), op);
    case remedy_kind::safe_softmax: return fmt::format("a safe softmax (0 for a fully masked row) for {}", op);
    case remedy_kind::float32: return fmt::format("{} in float32 instead of {}", op, c10::toString(dtype));
    default: return to_string(kind);
  }
}

op_patch::op_patch(op_rewrite rewrite, bool count_changes)
    : rewrite_(std::move(rewrite)), count_changes_(count_changes) {
  register_fallback();
  const std::lock_guard<std::mutex> lock(patch_mutex);
  TORCH_CHECK(!current_patch, "nanguard: an op patch for ", current_patch ? current_patch->rewrite_.op : "",
              " is in force; one patch at a time");
  current_patch = this;
}

op_patch::~op_patch() {
  const std::lock_guard<std::mutex> lock(patch_mutex);
  current_patch = nullptr;
}

op_patch::scope::scope() : include_(std::make_unique<c10::impl::IncludeDispatchKeyGuard>(kPatchKey)) {}

op_patch::scope::~scope() = default;

}  // namespace nanguard::detail
