// range_rules.h — the range an op's output lies in, worked out from the
// ranges of its arguments (interval arithmetic), so that the tracer knows
// the output is finite without reading it.
//
// Every rule is sound for the float arithmetic the op does: each rounding
// moves a result by at most one unit in the last place, and rounding is
// monotone, so widening a bound by the relative error of the operations on
// the way keeps every computed value inside. The tracer reads what no rule
// covers (and what a rule cannot prove finite), which gives it an exact
// range to start from again.
#pragma once

#include "detail/value_range.h"

#include <ATen/core/ivalue.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/Optional.h>

namespace nanguard::detail {

using maybe_range = c10::optional<value_range>;

/// An op's arguments as a rule sees them: numbers, and tensors whose range
/// the tracer knows.
class op_arguments {
 public:
  /// The range of a tensor the tracer has seen, if any.
  using range_lookup = c10::function_ref<maybe_range(const at::Tensor&)>;

  op_arguments(c10::ArrayRef<const c10::IValue> args, range_lookup range_of) : args_(args), range_of_(range_of) {}

  size_t size() const { return args_.size(); }
  const c10::IValue& operator[](size_t i) const { return args_[i]; }
  /// The range of argument i (a number, or a tensor seen finite), when it
  /// is known and small enough for any rule's arithmetic; nullopt otherwise.
  maybe_range range(size_t i) const;
  /// The range of argument i when known and finite, at any magnitude: for
  /// rules whose kernels do no arithmetic beyond the function they bound.
  maybe_range any_finite_range(size_t i) const;
  /// The hull of the ranges of a tensor-list argument (aten::cat).
  maybe_range list_range(size_t i) const;
  /// Argument i as a number (also a 0-dim CPU tensor); `absent` when it is
  /// missing or None, NaN when it is something else.
  double number(size_t i, double absent) const;
  /// Argument i when it is a defined tensor.
  const at::Tensor* tensor(size_t i) const;

 private:
  c10::ArrayRef<const c10::IValue> args_;
  range_lookup range_of_;
};

/// How an op's output ranges follow from its arguments.
struct range_rule {
  /// The range of output `index`, or nullopt when it cannot be bounded.
  maybe_range (*output)(const op_arguments& args, size_t index) = nullptr;
  /// Its outputs hold only argument values and constants, bit for bit
  /// (aten::cat, aten::relu): their ranges hold in any dtype. The others
  /// compute in float32 or float64 and are trusted only there.
  bool copies_values = false;
};

/// The rule for an op (`aten::add`), or nullptr when there is none.
const range_rule* range_rule_for(const char* op_name);

/// The range an output of `dtype` that `rule` put in `r` holds once stored
/// in that dtype, when it is finite there; nullopt when it may not be (or
/// when the rule computes and the dtype is 16-bit: those kernels' rounding
/// is not bounded here).
maybe_range stored_range(const value_range& r, at::ScalarType dtype, const range_rule& rule);

}  // namespace nanguard::detail
