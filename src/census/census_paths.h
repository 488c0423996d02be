// census_paths.h — the census's other ways to read a tensor, for the
// library's own checks and for its tests.
#pragma once

#include <nanguard/tensor_stats.h>

#include <ATen/core/Tensor.h>

namespace nanguard::detail {

/// The dtypes the census kernels read: float32, float64, float16, bfloat16.
/// Others (float8) are read as float32, which keeps their NaN and Inf.
inline bool census_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

/// `x`'s values in logical order in contiguous memory, as the census
/// kernels (CPU and CUDA) read them: a negative view (z.conj().imag,
/// at::_neg_view) holds its values negated in memory, so it is resolved.
inline at::Tensor logical_values(const at::Tensor& x) { return x.resolve_neg().contiguous(); }

/// The census computed with plain ATen ops on `x`'s own device: the
/// reference the other paths are tested against.
tensor_stats census_aten(const at::Tensor& x);

/// has_nonfinite on the calling thread only, for checks that run right
/// after an op (the precision advisor): waking the intra-op threads for them
/// cost more than it saved (measured: big outputs scanned at ~11 GB/s in
/// parallel, ~20 GB/s on one thread; far worse on a busy machine). The
/// tracer reads ranges the same way (value_range.h).
bool has_nonfinite_on_this_thread(const at::Tensor& x);

}  // namespace nanguard::detail
