// op_tensors.h — what the RecordFunction observers (tracer, precision
// advisor) look at in an op: its floating-point and complex tensors, and its kind.
#pragma once

#include <ATen/ops/view_as_real.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "census/census_paths.h"

#include <cstring>
#include <vector>

namespace nanguard::detail {

/// The dispatch keys of tensors that stand for values without holding them:
/// a tensor subclass with Python dispatch (FakeTensor and FunctionalTensor,
/// which Dynamo, AOTAutograd and Inductor run ops on while they compile; a
/// DTensor, whose local shard is a tensor of its own), functionalization's
/// and functorch's wrappers. Their data pointer is null or throws.
constexpr c10::DispatchKeySet kStandInKeys({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                            c10::DispatchKey::FuncTorchGradWrapper,
                                            c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::BatchedNestedTensor});

/// True when the values of `t` lie in memory that can be read. Not so for
/// the stand-ins of kStandInKeys, nor for what ops on FakeTensors make while
/// torch.compile compiles (a storage without data, as on the meta device):
/// a test of the key set and of a pointer, as it runs per op.
inline bool holds_values(const at::TensorBase& t) {
  return !t.key_set().has_any(kStandInKeys) && t.has_storage() && t.storage().data() != nullptr;
}

/// A tensor that can hold values worth checking: defined, floating or
/// complex, non-empty, strided, with values to read.
inline bool measurable(const at::Tensor& t) {
  return t.defined() && (t.is_floating_point() || t.is_complex()) && t.numel() > 0 &&
         t.layout() == at::kStrided && holds_values(t);
}

/// What the observers read of a measurable tensor: a complex one as its real
/// and imaginary parts (torch.view_as_real: a last dimension of 2, sharing
/// its storage), a float8 one as float32 (a copy, which keeps its NaN and
/// Inf: the census reads no float8), any other as it is.
inline at::Tensor real_values(const at::Tensor& t) {
  if (t.is_complex()) return at::view_as_real(t.is_conj() ? t.resolve_conj() : t);
  return census_dtype(t.scalar_type()) ? t : t.to(at::kFloat);
}

/// Appends the measurable tensors of an op argument (a tensor or a tensor
/// list) to `out`, a vector of at::Tensor, as their real_values.
template <typename Tensors>
void collect_tensors(const c10::IValue& v, Tensors& out) {
  if (v.isTensor()) {
    if (measurable(v.toTensor())) out.push_back(real_values(v.toTensor()));
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector())
      if (measurable(t)) out.push_back(real_values(t));
  }
}

/// True when an argument of the op is a complex tensor, or a list holding
/// one: the range rules (range_rules.h) reason about real arithmetic only.
inline bool any_complex(c10::ArrayRef<const c10::IValue> args) {
  for (const c10::IValue& v : args) {
    if (v.isTensor() && v.toTensor().is_complex()) return true;
    if (v.isTensorList())
      for (const c10::IValue& t : v.toListRef())
        if (t.isTensor() && t.toTensor().is_complex()) return true;
  }
  return false;
}

/// True for in-place ops (`aten::add_`), not for dunder names.
inline bool is_inplace(const char* op) {
  const size_t n = std::strlen(op);
  return n > 1 && op[n - 1] == '_' && op[n - 2] != '_';
}

/// Ops whose outputs are uninitialised memory: garbage, not values.
inline bool allocates_only(const char* op) {
  static const char* const prefixes[] = {"aten::empty", "aten::new_empty", "aten::resize", "aten::set_"};
  for (const char* p : prefixes)
    if (std::strncmp(op, p, std::strlen(p)) == 0) return true;
  return false;
}

}  // namespace nanguard::detail
