// op_tensors.h — what the RecordFunction observers (tracer, precision
// advisor) look at in an op: its floating-point tensors and its kind.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstring>
#include <vector>

namespace nanguard::detail {

/// A tensor that can hold values worth checking: defined, floating, non-empty,
/// with values to read (strided, not on the meta device).
inline bool measurable(const at::Tensor& t) {
  return t.defined() && t.is_floating_point() && t.numel() > 0 && t.layout() == at::kStrided && !t.is_meta();
}

/// Appends the measurable tensors of an op argument (a tensor or a tensor
/// list) to `out`, a vector of at::Tensor.
template <typename Tensors>
void collect_tensors(const c10::IValue& v, Tensors& out) {
  if (v.isTensor()) {
    if (measurable(v.toTensor())) out.push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector())
      if (measurable(t)) out.push_back(t);
  }
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
