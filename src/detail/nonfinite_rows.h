// nonfinite_rows.h — which rows (along dim 0) of a batch tensor hold a
// NaN/Inf: what the skip_rows remedy drops and what names a bad sample's
// dataset index.
#pragma once

#include <ATen/ATen.h>

namespace nanguard::detail {

/// A bool tensor of t.size(0): whether each row holds a NaN/Inf.
/// REQUIRES: `t` is a floating-point tensor of at least one dimension.
inline at::Tensor nonfinite_rows(const at::Tensor& t) {
  return at::logical_not(at::isfinite(t)).reshape({t.size(0), -1}).any(1);
}

}  // namespace nanguard::detail
